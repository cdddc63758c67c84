"""What `from_url` builds: clients that fail fast, wait for a free connection, and start
even when the store is down."""

from __future__ import annotations

import asyncio
import threading

import pytest
import redis

import ratelimit_mw as rl
from tests.conftest import REDIS_URL

URL = REDIS_URL


def test_the_pool_waits_for_a_free_connection_up_to_the_socket_timeout() -> None:
    backend = rl.RedisBackend.from_url(URL)
    pool = backend.client.connection_pool
    assert isinstance(pool, redis.BlockingConnectionPool)
    assert pool.timeout == 0.1
    assert pool.max_connections == 100


def test_a_burst_larger_than_the_pool_is_served_not_failed(prefix: str) -> None:
    limiter = rl.Limiter(rl.RedisBackend.from_url(URL, max_connections=2, socket_timeout=2.0),
                         prefix=prefix, deny_cache=0)
    policy = rl.Policy("15/minute", algorithm="gcra")
    results: list[object] = []

    def worker() -> None:
        try:
            results.append(limiter.hit(policy, "ip:1").allowed)
        except rl.BackendError as exc:  # pragma: no cover - the failure this test rules out
            results.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(30)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results.count(True) == 15 and results.count(False) == 15


async def test_the_async_pool_waits_too(prefix: str) -> None:
    # Timeouts of 2 s, as the sync test above: the defaults' 0.1 s connect timeout failed
    # this test on a 2-CPU machine busy with other work (a connect took longer), which is
    # the fail-fast the defaults are for, not what this test is about.
    backend = rl.AsyncRedisBackend.from_url(URL, max_connections=2, socket_timeout=2.0,
                                            socket_connect_timeout=2.0)
    assert isinstance(backend.client.connection_pool, redis.asyncio.BlockingConnectionPool)
    limiter = rl.AsyncLimiter(backend, prefix=prefix, deny_cache=0)
    decisions = await asyncio.gather(*(limiter.hit("10/minute", "ip:1") for _ in range(40)))
    assert sum(d.allowed for d in decisions) == 10
    await backend.aclose()


def test_a_cluster_that_is_down_at_start_up_fails_calls_not_the_app() -> None:
    backend = rl.RedisBackend.from_url("redis+cluster://127.0.0.1:1/0")
    assert backend.is_cluster
    limiter = rl.Limiter(backend)
    with pytest.raises(rl.BackendError, match=r"(?i)cluster"):
        limiter.hit("1/minute", "ip:1")
    with pytest.raises(rl.BackendError, match=r"(?i)cluster"):  # and keeps trying
        limiter.hit("1/minute", "ip:1")
