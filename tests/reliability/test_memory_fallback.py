"""on_backend_error="memory": while the store cannot answer, each worker limits in memory.

With Redis stopped or frozen (SIGSTOP), a 5/minute login rule still admits 5 of 8 requests
from one client and answers the other 3 with 429 (never 500, never all 8): the same policies
decided by an in-process MemoryBackend, empty at the outage. When the store answers again,
the store decides, and what the outage counted is dropped. Metrics say `fallback` for the
requests the cool-down sends there. ASGI and WSGI alike (one guard).
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from starlette.responses import PlainTextResponse

import ratelimit_mw as rl
from ratelimit_mw import asgi, keys, wsgi
from reliability._apps import install_clock
from reliability._support import PrivateRedis

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
async def test_asgi_limits_in_memory_through_an_outage_and_drops_it_after(
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
        try:
            during = [await login("a") for _ in range(8)]
            assert during == [200] * 5 + [429] * 3
            assert [await login("b") for _ in range(6)] == [200] * 5 + [429]  # per client
        finally:
            mend()
        assert events.seen["fallback"] >= 12 and events.seen["backend_error"] >= 1
        clock.advance(1.0)  # past the cool-down: the next request probes the store
        after = [await login("a") for _ in range(6)]
    await backend.aclose()
    # The store decides again, from its own count: the outage's 5 are dropped with the
    # memory. A frozen server runs, when it thaws, the call the deadline gave up on (it was
    # in its socket): that one hit is the store's.
    kept = 5 if how == "stopped" else 4
    assert after == [200] * kept + [429] * (6 - kept)


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
