"""on_backend_error="memory": while the store cannot answer, each worker limits in memory.

With Redis stopped or frozen (SIGSTOP), a 5/minute login rule still admits 5 of 8 requests
from one client and answers the other 3 with 429 (never 500, never all 8): the same policies
decided by an in-process MemoryBackend. When the store answers again, the store decides; the
memory keeps what the outages counted until their windows end, so a store that fails again
and again within one window is not a fresh quota each time: per window, the store admits at
most the limit and each worker's memory at most the limit. Metrics say `fallback` for the
requests the cool-down sends there. ASGI and WSGI alike (one guard).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.responses import PlainTextResponse
from support import CountingBackend, MonotonicClock, free_port

import ratelimit_mw as rl
from ratelimit_mw import asgi, keys, wsgi
from ratelimit_mw.http.breaker import TIMEOUTS, Breaker
from reliability._apps import install_clock
from reliability._support import AppServer, Figures, PrivateRedis

pytestmark = pytest.mark.slow


class _Events:
    def __init__(self) -> None:
        self.seen: Counter[str] = Counter()

    def observe(self, event: str, policy: str, seconds: float) -> None:
        self.seen[event] += 1


def _wsgi_ok(environ: Any, start_response: Any) -> list[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


def _fault(server: PrivateRedis, how: str) -> Callable[[], None]:
    """Break the server; return what mends it."""
    if how == "stopped":
        server.stop()
        return lambda: server.start() and None
    os.kill(server.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
    return lambda: os.kill(server.proc.pid, signal.SIGCONT)  # type: ignore[union-attr]


@pytest.mark.parametrize("how", ["stopped", "sigstop"])
async def test_asgi_limits_in_memory_through_an_outage_and_the_store_decides_after(
    private_redis: Callable[..., PrivateRedis], prefix: str, how: str,
) -> None:
    server = private_redis()
    events = _Events()
    backend = rl.AsyncRedisBackend.from_url(server.url)
    limiter = rl.AsyncLimiter(backend, prefix=prefix, metrics=events)
    middleware = asgi.RateLimitMiddleware(
        PlainTextResponse("ok"), limiter, key=keys.header("x-client"),
        rules=[asgi.Rule("/login", "5/minute")], on_backend_error="memory")
    clock = install_clock(middleware)
    transport = httpx.ASGITransport(app=middleware)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        async def login(who: str) -> int:
            return (await client.get("/login", headers={"x-client": who})).status_code

        assert await login("before") == 200  # connected: the store answers
        mend = _fault(server, how)
        # A stopped Redis opens the breaker at once; a frozen one after TIMEOUTS timeouts
        # in a row, each a deadline after the last on the breaker's clock.
        failing = 1 if how == "stopped" else TIMEOUTS
        try:
            during = []
            for _ in range(8):
                during.append(await login("a"))
                if len(during) < failing:
                    clock.advance(0.1)
            assert during == [200] * 5 + [429] * 3
            assert [await login("b") for _ in range(6)] == [200] * 5 + [429]  # per client
        finally:
            mend()
        # Each request is decided in memory: those that failed, and those the open breaker
        # sent there (`fallback`).
        assert events.seen["fallback"] == 14 - failing
        assert events.seen["backend_error"] == failing
        # Past the cool-down the next request probes the store, and is answered: an opening
        # begun while the server was frozen times out under it, and the probe dials afresh.
        clock.advance(1.0)
        after = [await login("a") for _ in range(6)]
    await backend.aclose()
    # The store decides again, from its own count: the outage's 5 were the memory's. A
    # frozen server runs, when it thaws, the calls the deadline gave up on that were in its
    # socket (the first; the later ones too if they found the connection still open): those
    # hits are the store's.
    if how == "stopped":
        assert after == [200] * 5 + [429]
    else:
        kept = after.count(200)
        assert 5 - failing <= kept <= 4 and after == [200] * kept + [429] * (6 - kept)


def _wsgi_login(server: PrivateRedis, prefix: str, rate: str
                ) -> tuple[wsgi.RateLimitMiddleware, Any]:
    """A WSGI app whose /login is limited to `rate` per X-Client, failing over to memory."""
    backend = rl.RedisBackend.from_url(server.url)
    middleware = wsgi.RateLimitMiddleware(
        _wsgi_ok, rl.Limiter(backend, prefix=prefix), key=keys.header("x-client"),
        rules=[wsgi.Rule("/login", rate)], on_backend_error="memory")
    return middleware, backend


def test_wsgi_limits_in_memory_while_redis_is_down(
    private_redis: Callable[..., PrivateRedis], prefix: str,
) -> None:
    server = private_redis()
    middleware, backend = _wsgi_login(server, prefix, "5/minute")
    transport = httpx.WSGITransport(app=middleware)
    with httpx.Client(transport=transport, base_url="http://t") as client:
        assert client.get("/login", headers={"x-client": "w"}).status_code == 200
        server.stop()
        statuses = [client.get("/login", headers={"x-client": "w"}).status_code
                    for _ in range(8)]
    backend.close()
    assert statuses == [200] * 5 + [429] * 3


def test_memory_is_a_failure_policy_the_configuration_accepts() -> None:
    with pytest.raises(rl.ConfigurationError, match='"memory"'):
        asgi.RateLimitMiddleware(PlainTextResponse("ok"), rl.AsyncLimiter(),
                                 default="1/minute", on_backend_error="memroy")


def test_a_probe_answered_by_the_deny_cache_neither_closes_the_breaker_nor_drops_the_memory(
    private_redis: Callable[..., PrivateRedis], prefix: str,
) -> None:
    """The cool-down's probe is asked of the store itself: a refused client's request,
    answered in process by the deny cache, would close the breaker on a store nobody asked,
    and the memory's counts would go with it (a 3/minute rule admitted 3 more every
    cool-down: about 3 a second)."""
    server = private_redis()
    middleware, backend = _wsgi_login(server, prefix, "3/minute")
    clock = install_clock(middleware)
    transport = httpx.WSGITransport(app=middleware)
    with httpx.Client(transport=transport, base_url="http://t") as client:
        def login(who: str) -> int:
            return client.get("/login", headers={"x-client": who}).status_code

        assert [login("refused") for _ in range(4)] == [200] * 3 + [429]  # now deny-cached
        server.stop()
        assert [login("a") for _ in range(4)] == [200] * 3 + [429]
        for _ in range(3):
            clock.advance(1.1)  # the cool-down is over: the next request is the probe
            login("refused")  # the probe fails: the memory answers it (it starts empty)
            assert middleware.guard.breaker.is_open
            assert [login("a") for _ in range(2)] == [429, 429]  # the memory kept its count
    backend.close()


def test_outages_within_one_window_draw_on_one_memory_count() -> None:
    """The memory keeps its counts when the store comes back: outage after outage within one
    minute, a 5/minute rule admits 5 from memory in all, not 5 per outage (each outage began
    with an empty memory: 12 of 12 here, and ~3x the documented N x the limit for a fleet
    under a flapping Redis). Once the window has passed, the memory admits again."""
    clock = MonotonicClock()
    store = CountingBackend()  # the store; fails while `failure` is set
    middleware = wsgi.RateLimitMiddleware(
        _wsgi_ok, rl.Limiter(store, clock=clock), key=keys.header("x-client"),
        rules=[wsgi.Rule("/login", "5/minute")], on_backend_error="memory")
    breaker = middleware.guard.breaker
    middleware.guard.breaker = Breaker(breaker.cooldown, breaker.policy, clock)
    transport = httpx.WSGITransport(app=middleware)
    with httpx.Client(transport=transport, base_url="http://t") as client:
        def login() -> int:
            return client.get("/login", headers={"x-client": "a"}).status_code

        from_memory: list[int] = []
        for _ in range(4):
            store.failure = rl.BackendError("down")
            from_memory += [login() for _ in range(3)]  # the failed call, then the cool-down
            store.failure = None
            clock.advance(1.1)  # the cool-down is over: the next request probes the store
            assert login() == 200  # the store answers (its own count: one a round)
            assert not middleware.guard.breaker.is_open
        assert from_memory == [200] * 5 + [429] * 7
        clock.advance(60.0)  # the minute is over: the memory's entries have expired
        store.failure = rl.BackendError("down")
        assert [login() for _ in range(6)] == [200] * 5 + [429]


# -- a flapping store under uvicorn's workers ----------------------------------------------
FLAP_LIMIT = 10
FLAP_WORKERS = 4


def make_flapping_app() -> Any:
    """What uvicorn serves in the flapping test (``--factory``): FLAP_LIMIT a minute per
    X-Client in the Redis at RL_REDIS_URL, in memory while it is out (probed every 0.2 s)."""
    backend = rl.AsyncRedisBackend.from_url(os.environ["RL_REDIS_URL"])
    limiter = rl.AsyncLimiter(backend, prefix=os.environ["RL_PREFIX"])
    return asgi.RateLimitMiddleware(
        PlainTextResponse("ok"), limiter, key=keys.header("x-client"),
        default=f"{FLAP_LIMIT}/minute", on_backend_error="memory", backend_cooldown=0.2)


def test_a_flapping_store_admits_at_most_a_limit_per_worker_and_one_for_the_store(
    private_redis: Callable[..., PrivateRedis], tmp_path: Path, figures: Figures,
) -> None:
    """4 uvicorn workers, 10/minute, one client hammering while Redis is stopped and started
    every 0.6 s for 7 s (all within one minute): at most (4 + 1) x 10 admitted. The server
    keeps its data through the restarts (append-only file), as a restarted production Redis
    does: one that comes back empty starts its own count again."""
    server = private_redis("--appendonly", "yes", "--appendfsync", "always",
                           "--dir", str(tmp_path))
    port = free_port()
    app = AppServer(
        [sys.executable, "-m", "uvicorn", "reliability.test_memory_fallback:make_flapping_app",
         "--factory", "--host", "127.0.0.1", "--port", str(port), "--workers",
         str(FLAP_WORKERS), "--log-level", "warning", "--no-access-log"],
        {"RL_REDIS_URL": server.url, "RL_PREFIX": "tmf" + uuid.uuid4().hex[:10]}, port)
    statuses: list[int] = []  # appends from several threads (atomic)
    done = threading.Event()

    def hammer() -> None:
        # A connection per request, so that every worker gets some.
        with httpx.Client(base_url=app.base_url, timeout=10,
                          limits=httpx.Limits(max_keepalive_connections=0)) as client:
            while not done.is_set():
                statuses.append(client.get("/", headers={"x-client": "flap"}).status_code)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    try:
        for thread in threads:
            thread.start()
        for _ in range(6):
            time.sleep(0.6)  # up: the store counts (and refuses once its 10 are spent)
            server.stop()
            time.sleep(0.6)  # down: each worker's memory decides
            server.start()
        time.sleep(0.6)
    finally:
        done.set()
        for thread in threads:
            thread.join()
        log = app.stop()
    seen = Counter(statuses)
    figures.record("memory_fallback.flapping.admitted",
                   f"{seen[200]} of {len(statuses)} (bound {(FLAP_WORKERS + 1) * FLAP_LIMIT}: "
                   f"{FLAP_WORKERS} workers, {FLAP_LIMIT}/minute, 6 outages)")
    assert set(seen) <= {200, 429}, (seen, log[-2000:])
    assert FLAP_LIMIT < seen[200] <= (FLAP_WORKERS + 1) * FLAP_LIMIT, seen
