"""Fixtures for the ASGI middleware and FastAPI dependency tests.

`abackend` runs each test twice: on the memory backend and on the real Redis through
redis.asyncio. A redis.asyncio client belongs to the event loop it first runs on, so every
test gets a fresh one, used inside one `with TestClient(app)` block (`serve`), and closed on
that block's loop before the block ends. The shared fixtures (`clock`, `prefix`,
`redis_client`) come from tests/conftest.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import pytest
import redis.asyncio
from asgi_support import REDIS_URL
from starlette.testclient import TestClient

import ratelimit_mw as rl

Serve = Callable[..., TestClient]


@pytest.fixture(params=["memory", "redis"])
def abackend(request: pytest.FixtureRequest, redis_client: Any) -> Any:
    if request.param == "memory":
        return rl.MemoryBackend()
    return rl.AsyncRedisBackend(redis.asyncio.Redis.from_url(REDIS_URL))


@pytest.fixture
def alimiter(abackend: Any, prefix: str, clock: Any) -> rl.AsyncLimiter:
    """An AsyncLimiter on `abackend` whose scripts read the test's fake clock."""
    return rl.AsyncLimiter(abackend, prefix=prefix, clock=clock, sleep=clock.asleep)


@pytest.fixture
def serve(abackend: Any) -> Iterator[Serve]:
    """serve(app, **TestClient kwargs) -> a TestClient already inside its `with` block.

    One per test: the test's redis.asyncio client is bound to this client's loop, and is
    closed on it when the test ends.
    """
    with ExitStack() as stack:
        made: list[TestClient] = []

        def make(app: Any, **kwargs: Any) -> TestClient:
            if made:
                raise AssertionError("one TestClient per test: the redis client is loop-bound")
            client = stack.enter_context(TestClient(app, **kwargs))
            made.append(client)
            if isinstance(abackend, rl.AsyncRedisBackend):
                stack.callback(client.portal.call, abackend.aclose)
            return client

        yield make
