"""A cold worker meeting a burst on a busy event loop is not taken for a failing Redis.

A worker with no connection yet (Django under ASGI has no lifespan to open one first) opens
it inside its first requests. 400 requests at once through the ASGI middleware at its
defaults (100 ms deadline, ``on_backend_error="allow"``) on an event loop whose every turn
takes 50 ms (tasks that each hold it a little, as a burst of incoming requests does; timers
run on time, so no deadline's look is stretched): setting up takes several such turns, and
exactly 100 of ``100/minute`` must be admitted, none let through by the failure policy. With
the connect inside the request's 100 ms (the rule before 7bc5dfd) all 400 were admitted.
Both for the library's ``from_url`` and for a client with redis-py's 5 s timeouts, over TCP,
TLS and a unix socket, under asyncio and uvloop.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import redis.asyncio
from backends.loops import event_loops, run_on
from starlette.responses import PlainTextResponse
from transports import transport_url

import ratelimit_mw as rl
from ratelimit_mw import asgi, keys

pytestmark = pytest.mark.slow

BURST = 400
LIMIT = 100
TURN = 0.05  # seconds each turn of the loop takes while the burst is served
HOLDERS = 50  # tasks that each hold the loop TURN / HOLDERS per turn

BUILDS: dict[str, Callable[[str], Any]] = {
    "from_url": rl.AsyncRedisBackend.from_url,
    "redis-py 5 s timeouts": lambda url: rl.AsyncRedisBackend(redis.asyncio.from_url(
        url, socket_timeout=5, socket_connect_timeout=5)),
}


async def _busy_burst(backend: Any, prefix: str) -> Counter[int]:
    """BURST requests of one client at once through the middleware, on a loop kept busy."""
    middleware = asgi.RateLimitMiddleware(
        PlainTextResponse("ok"), rl.AsyncLimiter(backend, prefix=prefix),
        default=f"{LIMIT}/minute", key=keys.header("x-client"))
    served = False

    async def hold() -> None:
        while not served:
            until = time.perf_counter() + TURN / HOLDERS
            while time.perf_counter() < until:
                pass
            await asyncio.sleep(0)

    holders = [asyncio.ensure_future(hold()) for _ in range(HOLDERS)]
    transport = httpx.ASGITransport(app=middleware)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            responses = await asyncio.gather(*(client.get("/", headers={"x-client": "burst"})
                                               for _ in range(BURST)))
    finally:
        served = True
        await asyncio.gather(*holders)
    await middleware.limiter.reset(rl.Policy(f"{LIMIT}/minute"), "h:x-client:burst")
    return Counter(r.status_code for r in responses)


@pytest.mark.parametrize("new_loop", event_loops())
@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("transport", ["tcp", "tls", "unix"])
def test_a_cold_worker_under_a_burst_on_a_busy_loop_admits_exactly_the_limit(
    request: pytest.FixtureRequest, transport: str, build: str,
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    url = transport_url(request, transport)

    async def main() -> Counter[int]:
        backend = BUILDS[build](url)  # cold: no start-up check, no connection
        try:
            return await _busy_burst(backend, "tcb" + uuid.uuid4().hex[:10])
        finally:
            await backend.aclose()

    assert run_on(new_loop, main) == Counter({200: LIMIT, 429: BURST - LIMIT})
