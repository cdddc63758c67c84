"""ratelimit_mw.testing: the `ratelimit` fixture (a pytest plugin, loaded because the package
is installed) isolates every limiter of the process for one test, on a clock the test moves.

The app below counts on the real Redis, as an app's own settings would have it; under the
fixture nothing reaches Redis and counts start from nothing in every test.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

import ratelimit_mw as rl
from ratelimit_mw.asgi import RateLimitMiddleware
from ratelimit_mw.testing import Clock, isolated
from tests.conftest import REDIS_URL

PREFIX = "tst" + uuid.uuid4().hex[:8]
LIMITER = rl.AsyncLimiter(rl.AsyncRedisBackend.from_url(REDIS_URL), prefix=PREFIX)


async def hello(request: object) -> PlainTextResponse:
    return PlainTextResponse("hi")


APP = RateLimitMiddleware(Starlette(routes=[Route("/", hello)]), LIMITER, default="2/minute")


def _redis_keys() -> list[bytes]:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        return list(client.scan_iter(f"{PREFIX}:*"))
    finally:
        client.close()


@pytest.mark.parametrize("run", [1, 2])  # the second run would be refused if counts leaked
def test_the_fixture_isolates_the_app_and_lets_the_test_move_the_clock(
        ratelimit: object, run: int) -> None:
    with TestClient(APP) as client:
        assert [client.get("/").status_code for _ in range(3)] == [200, 200, 429]
        ratelimit.clock.advance(60)  # type: ignore[attr-defined]
        assert client.get("/").status_code == 200
    assert _redis_keys() == []


def test_the_limiter_has_its_store_clock_and_cache_back_afterwards() -> None:
    limiter = rl.AsyncLimiter(rl.AsyncRedisBackend.from_url(REDIS_URL), prefix=PREFIX)
    backend, deny = limiter.backend, limiter._deny
    with isolated(limiter) as isolation:
        assert limiter.backend is isolation.backend and limiter.clock is isolation.clock
    assert limiter.backend is backend and limiter._deny is deny and limiter.clock is None


def test_acquire_moves_the_clock_instead_of_sleeping() -> None:
    limiter = rl.Limiter()
    policy = rl.Policy("1/minute", algorithm="fixed-window")
    with isolated(limiter, clock=Clock(1_800_000_000.0)) as isolation:
        assert limiter.hit(policy, "u").allowed
        decision = limiter.acquire(policy, "u", timeout=120)
        assert decision.allowed
        assert 60 <= isolation.clock.now - 1_800_000_000.0 <= 66  # the wait and its jitter

    async def asynchronous() -> float:
        alimiter = rl.AsyncLimiter()
        with isolated(alimiter, clock=Clock(1_800_000_000.0)) as isolation:
            await alimiter.hit(policy, "u")
            await alimiter.acquire(policy, "u", timeout=120)
            return isolation.clock.now - 1_800_000_000.0

    assert 60 <= asyncio.run(asynchronous()) <= 66


def test_limiters_isolated_together_share_one_store() -> None:
    one, two = rl.Limiter(prefix="a"), rl.Limiter(prefix="a")
    policy = rl.Policy("1/minute")
    with isolated(one, two):
        assert one.hit(policy, "u").allowed
        assert not two.hit(policy, "u").allowed


def test_a_clock_moves_forward_only() -> None:
    with pytest.raises(ValueError, match="forward"):
        Clock().advance(-1)
