"""Script cache loss and Redis restarts, through the ASGI and WSGI middleware.

Clients are built the way the README says (``RedisBackend.from_url`` /
``AsyncRedisBackend.from_url``). A ``SCRIPT FLUSH`` in the middle of a stream is invisible:
every request is still decided, and the counts carry on. A restart (SHUTDOWN NOSAVE, then the
same port again) costs only the outage itself, answered by the failure policy; the first
request after the cool-down is decided again, on a fresh connection with the script
reloaded. The middleware answers ``on_backend_error="deny"`` wherever the test claims no
failure at all, so a failure could not hide as an admission.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis
import redis.cluster
from werkzeug.test import Client

import ratelimit_mw as rl
from ratelimit_mw import asgi, keys, wsgi
from reliability._apps import asgi_app, asgi_client, install_clock, remaining, wsgi_app
from reliability._support import (
    SHARED_REDIS_URL,
    CountingAsyncBackend,
    CountingBackend,
    PrivateRedis,
)

pytestmark = pytest.mark.slow

# Two policies per request: the sliding log governs (fewest left), GCRA counts alongside.
POLICIES = [rl.Policy("5/hour", name="restart"),
            rl.Policy("9/hour", algorithm="gcra", name="restart-gc")]
KEY = keys.header("x-client")


def flush_scripts(url: str) -> None:
    """SCRIPT FLUSH on the server, or on every primary of the cluster."""
    if url.startswith("redis+cluster://"):
        client: Any = redis.cluster.RedisCluster.from_url(url.replace("+cluster", ""))
    else:
        client = redis.Redis.from_url(url)
    try:
        client.script_flush()
    finally:
        client.close()


def _url(request: pytest.FixtureRequest, store: str) -> str:
    return request.getfixturevalue("redis_cluster_url") if store == "cluster" \
        else SHARED_REDIS_URL


# -- SCRIPT FLUSH ----------------------------------------------------------------------------
@pytest.mark.parametrize("store", ["redis", "cluster"])
async def test_a_script_flush_mid_stream_is_invisible_through_the_asgi_middleware(
    request: pytest.FixtureRequest, store: str, prefix: str
) -> None:
    url = _url(request, store)
    backend = rl.AsyncRedisBackend.from_url(url)
    mw = asgi.RateLimitMiddleware(asgi_app(), rl.AsyncLimiter(backend, prefix=prefix),
                                  default=POLICIES, key=KEY, on_backend_error="deny")
    headers = {"x-client": uuid.uuid4().hex}
    seen: list[tuple[int, int | None]] = []
    async with asgi_client(mw) as client:
        for i in range(7):
            if i == 3:
                flush_scripts(url)
            response = await client.get("/", headers=headers)
            seen.append((response.status_code, remaining(response.headers)))
    await backend.aclose()
    assert seen == [(200, 4), (200, 3), (200, 2), (200, 1), (200, 0), (429, 0), (429, 0)]


@pytest.mark.parametrize("store", ["redis", "cluster"])
def test_a_script_flush_mid_stream_is_invisible_through_the_wsgi_middleware(
    request: pytest.FixtureRequest, store: str, prefix: str
) -> None:
    url = _url(request, store)
    backend = rl.RedisBackend.from_url(url)
    mw = wsgi.RateLimitMiddleware(wsgi_app, rl.Limiter(backend, prefix=prefix),
                                  default=POLICIES, key=KEY, on_backend_error="deny")
    client = Client(mw)
    headers = {"x-client": uuid.uuid4().hex}
    seen: list[tuple[int, int | None]] = []
    for i in range(7):
        if i == 3:
            flush_scripts(url)
        response = client.get("/", headers=headers)
        seen.append((response.status_code, remaining(response.headers)))
    backend.close()
    assert seen == [(200, 4), (200, 3), (200, 2), (200, 1), (200, 0), (429, 0), (429, 0)]


# -- restart, step by step -------------------------------------------------------------------
def _expect_outage(policy: str, status: int, response_headers: Any, decided: bool) -> None:
    if policy == "allow":
        assert (status, decided, remaining(response_headers)) == (200, False, None)
    else:
        assert status == 503
        assert response_headers["Retry-After"] == "1"


@pytest.mark.parametrize("policy", ["allow", "deny"])
async def test_asgi_decisions_resume_after_a_redis_restart(
    private_redis: Callable[..., PrivateRedis], policy: str, prefix: str
) -> None:
    server = private_redis()
    backend = rl.AsyncRedisBackend.from_url(server.url)
    counting = CountingAsyncBackend(backend)
    mw = asgi.RateLimitMiddleware(asgi_app(), rl.AsyncLimiter(counting, prefix=prefix),
                                  default=POLICIES, key=KEY, on_backend_error=policy)
    clock = install_clock(mw)
    headers = {"x-client": "restart"}
    async with asgi_client(mw) as client:

        async def get() -> tuple[int, Any, bool]:
            response = await client.get("/", headers=headers)
            decided = response.status_code == 200 and response.json()["decided"]
            return response.status_code, response.headers, decided

        before = [await get() for _ in range(2)]
        server.stop()
        during = [await get() for _ in range(3)]
        calls_during = counting.calls - 2
        server.start()  # same port, empty: nothing was persisted
        clock.advance(1.01)  # past the cool-down
        after = [await get() for _ in range(6)]
    await backend.aclose()

    assert [(s, remaining(h)) for s, h, _ in before] == [(200, 4), (200, 3)]
    for status, response_headers, decided in during:
        _expect_outage(policy, status, response_headers, decided)
    assert calls_during == 1  # the breaker skipped Redis after the first failure
    # Decided again from the first request on: counts start over on the emptied server.
    assert [(s, remaining(h)) for s, h, _ in after] == [
        (200, 4), (200, 3), (200, 2), (200, 1), (200, 0), (429, 0)]


@pytest.mark.parametrize("policy", ["allow", "deny"])
def test_wsgi_decisions_resume_after_a_redis_restart(
    private_redis: Callable[..., PrivateRedis], policy: str, prefix: str
) -> None:
    server = private_redis()
    backend = rl.RedisBackend.from_url(server.url)
    counting = CountingBackend(backend)
    mw = wsgi.RateLimitMiddleware(wsgi_app, rl.Limiter(counting, prefix=prefix),
                                  default=POLICIES, key=KEY, on_backend_error=policy)
    clock = install_clock(mw)
    client = Client(mw)
    headers = {"x-client": "restart"}

    def get() -> tuple[int, Any, bool]:
        response = client.get("/", headers=headers)
        decided = response.status_code == 200 and response.get_json()["decided"]
        return response.status_code, response.headers, decided

    before = [get() for _ in range(2)]
    server.stop()
    during = [get() for _ in range(3)]
    calls_during = counting.calls - 2
    server.start()
    clock.advance(1.01)
    after = [get() for _ in range(6)]
    backend.close()

    assert [(s, remaining(h)) for s, h, _ in before] == [(200, 4), (200, 3)]
    for status, response_headers, decided in during:
        _expect_outage(policy, status, response_headers, decided)
    assert calls_during == 1
    assert [(s, remaining(h)) for s, h, _ in after] == [
        (200, 4), (200, 3), (200, 2), (200, 1), (200, 0), (429, 0)]


# -- restart under a live stream -------------------------------------------------------------
# Many concurrent callers, each on its own identity with a large limit, keep going while the
# server goes down and comes back. For each caller the remaining count it is told must only
# ever go down, except once, when the restart empties the server: a reply read on the wrong
# connection (another caller's answer) or a lost count would break that.
STREAM_POLICY = rl.Policy("1000/hour", name="stream")
STREAMERS = 12


def _check_stream(streams: dict[int, list[tuple[int, int | None]]]) -> None:
    for caller, seen in streams.items():
        statuses = {status for status, _ in seen}
        assert statuses <= {200}, (caller, statuses)  # allow: never a 5xx, never a 429
        counts = [r for _, r in seen if r is not None]
        resets = sum(1 for a, b in itertools.pairwise(counts) if b >= a)
        assert resets <= 1, (caller, counts)
        assert counts and counts[-1] < 1000
        assert any(r is None for _, r in seen), caller  # it did live through the outage


async def test_asgi_stream_survives_a_restart_with_every_reply_on_its_own_caller(
    private_redis: Callable[..., PrivateRedis], prefix: str
) -> None:
    server = private_redis()
    backend = rl.AsyncRedisBackend.from_url(server.url)
    # No cool-down: every request of the stream tries Redis, through the restart.
    mw = asgi.RateLimitMiddleware(asgi_app(), rl.AsyncLimiter(backend, prefix=prefix),
                                  default=STREAM_POLICY, key=KEY, backend_cooldown=0)
    streams: dict[int, list[tuple[int, int | None]]] = {i: [] for i in range(STREAMERS)}
    phase = {"restarted": False}

    async def caller(i: int, client: Any) -> None:
        decided_after = 0
        deadline = time.monotonic() + 10
        while decided_after < 5 and time.monotonic() < deadline:
            response = await client.get("/", headers={"x-client": f"stream-{i}"})
            r = remaining(response.headers)
            streams[i].append((response.status_code, r))
            if phase["restarted"] and r is not None:
                decided_after += 1
            await asyncio.sleep(0.005)

    async with asgi_client(mw) as client:
        callers = [asyncio.create_task(caller(i, client)) for i in range(STREAMERS)]
        await asyncio.sleep(0.2)
        await asyncio.to_thread(server.stop)
        await asyncio.sleep(0.2)
        await asyncio.to_thread(server.start)
        phase["restarted"] = True
        await asyncio.gather(*callers)
    await backend.aclose()
    _check_stream(streams)


def test_wsgi_stream_survives_a_restart_with_every_reply_on_its_own_caller(
    private_redis: Callable[..., PrivateRedis], prefix: str
) -> None:
    server = private_redis()
    backend = rl.RedisBackend.from_url(server.url)
    mw = wsgi.RateLimitMiddleware(wsgi_app, rl.Limiter(backend, prefix=prefix),
                                  default=STREAM_POLICY, key=KEY, backend_cooldown=0)
    streams: dict[int, list[tuple[int, int | None]]] = {i: [] for i in range(STREAMERS)}
    restarted = threading.Event()
    errors: list[BaseException] = []

    def caller(i: int) -> None:
        client = Client(mw)
        decided_after = 0
        deadline = time.monotonic() + 10
        try:
            while decided_after < 5 and time.monotonic() < deadline:
                response = client.get("/", headers={"x-client": f"stream-{i}"})
                r = remaining(response.headers)
                streams[i].append((response.status_code, r))
                if restarted.is_set() and r is not None:
                    decided_after += 1
                time.sleep(0.005)
        except BaseException as exc:  # surfaces in the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(STREAMERS)]
    for thread in threads:
        thread.start()
    time.sleep(0.2)
    server.stop()
    time.sleep(0.2)
    server.start()
    restarted.set()
    for thread in threads:
        thread.join(timeout=30)
    backend.close()
    assert errors == []
    _check_stream(streams)
