"""Fixtures of the conformance suite: `driver` (four adapters x memory, Redis) and `routed`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from support.driver import ADAPTERS, Driver


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=ADAPTERS)
def driver(request: pytest.FixtureRequest, store: str, prefix: str, clock: Any,
           redis_client: Any) -> Iterator[Driver]:
    made = Driver(str(request.param), store, prefix, clock)
    yield made
    made.close()
    if store == "redis":
        for key in redis_client.scan_iter(f"{prefix}:*"):
            redis_client.delete(key)


@pytest.fixture
def routed(driver: Driver) -> Driver:
    """The driver, for tests of route decorators (plain WSGI has no router)."""
    if not driver.routes:
        pytest.skip("plain WSGI has no router: decorators need the Flask extension")
    return driver


