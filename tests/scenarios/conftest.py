"""Fixtures for the scenario suites: the async twin of the `limiter` fixture.

Every scenario runs on the memory backend and on the real Redis (`backend` / `abackend`), with
the fake clock handed to the scripts as `now`, so hours and days pass without waiting.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis.asyncio

import ratelimit_mw as rl

REDIS_URL = os.environ.get("RATELIMIT_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture(params=["memory", "redis"])
async def abackend(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """The async backends: memory, and an AsyncRedisBackend bound to this test's event loop."""
    if request.param == "memory":
        yield rl.MemoryBackend()
        return
    client = redis.asyncio.Redis.from_url(REDIS_URL)
    yield rl.AsyncRedisBackend(client)
    await client.aclose()


@pytest.fixture
def alimiter(abackend: Any, prefix: str, clock: Any) -> rl.AsyncLimiter:
    return rl.AsyncLimiter(abackend, prefix=prefix, clock=clock, sleep=clock.asleep)


@pytest.fixture(autouse=True)
def _drop_keys_afterwards(prefix: str, redis_client: Any) -> Iterator[None]:
    """The fake clock books days ahead, so keys would outlive the run: drop them after each test."""
    yield
    keys = list(redis_client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        redis_client.delete(*keys)
