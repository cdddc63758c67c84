"""The start-up check: ``ping()`` / ``aping()`` connect, load the script and describe the store.

A wrong host must be found at deploy time: every backend raises BackendError from its check,
never a redis-py exception, and a reachable one has the script loaded afterwards.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis

import ratelimit_mw as rl
from ratelimit_mw.core import scripts
from tests.conftest import REDIS_URL

URL = REDIS_URL
KEYS = {"backend", "server", "version", "cluster", "nodes", "rtt_ms", "script_sha"}


def check_report(report: dict[str, Any], backend: str, nodes: int) -> None:
    assert set(report) == KEYS
    assert report["backend"] == backend
    assert report["server"] == "redis"  # Valkey's: tests/backends/test_valkey.py
    assert report["cluster"] is (backend == "redis-cluster")
    assert report["nodes"] == nodes
    assert isinstance(report["rtt_ms"], float) and report["rtt_ms"] >= 0.0
    assert report["script_sha"] == scripts.sha1()
    assert isinstance(report["version"], str) and report["version"][0].isdigit()


def test_the_memory_backend_is_always_reachable() -> None:
    report = rl.MemoryBackend().ping()
    assert report == {"backend": "memory", "server": None, "version": None, "cluster": False,
                      "nodes": 1, "rtt_ms": 0.0, "script_sha": ""}


async def test_the_memory_backend_async_check_gives_the_same_report() -> None:
    backend = rl.MemoryBackend()
    assert await backend.aping() == backend.ping()


def test_ping_loads_the_script_on_the_server(redis_client: redis.Redis) -> None:
    backend = rl.RedisBackend.from_url(URL)
    try:
        check_report(backend.ping(), "redis", 1)
        assert redis_client.script_exists(scripts.sha1()) == [True]
    finally:
        backend.close()


async def test_aping_loads_the_script_on_the_server(redis_client: redis.Redis) -> None:
    backend = rl.AsyncRedisBackend.from_url(URL)
    try:
        check_report(await backend.aping(), "redis", 1)
        assert redis_client.script_exists(scripts.sha1()) == [True]
    finally:
        await backend.aclose()


async def test_aping_opens_the_connection_that_serves_the_checks(
    redis_client: redis.Redis, prefix: str,
) -> None:
    """After the start-up check the first check connects nothing: a cold worker's first
    burst finds its connection open and the script loaded instead of setting both up
    inside the middleware's deadline."""
    name = f"{prefix}-aping"

    def connections() -> int:
        return sum(client["name"] == name for client in redis_client.client_list())

    backend = rl.AsyncRedisBackend.from_url(URL, client_name=name)
    try:
        await backend.aping()
        opened = connections()
        limiter = rl.AsyncLimiter(backend, prefix=prefix, deny_cache=0)
        assert (await limiter.hit(rl.Policy("5/minute"), "ip:1")).remaining == 4
        assert connections() == opened == 1
    finally:
        await backend.aclose()


# The failure names the store as a URL without its password, never the client's repr.
def test_a_wrong_host_is_a_backend_error_at_start_up() -> None:
    backend = rl.RedisBackend.from_url("redis://:s3cret@127.0.0.1:1/0")
    with pytest.raises(rl.BackendError, match=r"start-up check failed for redis://127\.0\.0"
                                              r"\.1:1/0: ConnectionError") as failed:
        rl.Limiter(backend).ping()
    assert "s3cret" not in str(failed.value) and "Pool" not in str(failed.value)


async def test_a_wrong_host_is_a_backend_error_at_start_up_async() -> None:
    backend = rl.AsyncRedisBackend.from_url("redis://:s3cret@127.0.0.1:1/2")
    with pytest.raises(rl.BackendError, match=r"start-up check failed for redis://127\.0\.0"
                                              r"\.1:1/2: ConnectionError") as failed:
        await rl.AsyncLimiter(backend).ping()
    assert "s3cret" not in str(failed.value) and "Pool" not in str(failed.value)
    await backend.aclose()


def test_a_cluster_that_is_down_is_a_backend_error_at_start_up() -> None:
    backend = rl.RedisBackend.from_url("redis+cluster://127.0.0.1:1/0")
    with pytest.raises(rl.BackendError, match="start-up check failed for redis"):
        backend.ping()


async def test_a_cluster_that_is_down_is_a_backend_error_at_start_up_async() -> None:
    backend = rl.AsyncRedisBackend.from_url("redis+cluster://127.0.0.1:1/0")
    with pytest.raises(rl.BackendError, match="start-up check failed for redis"):
        await backend.aping()
    await backend.aclose()


def _primaries(url: str) -> list[redis.Redis]:
    probe = redis.Redis.from_url(url.replace("+cluster://", "://", 1))
    try:
        ports = sorted(int(address.rsplit(":", 1)[1])
                       for address, node in probe.cluster("NODES").items()
                       if "master" in node["flags"])
    finally:
        probe.close()
    return [redis.Redis(port=port) for port in ports]


@pytest.mark.cluster
def test_ping_loads_the_script_on_every_primary_of_a_cluster(redis_cluster_url: str) -> None:
    nodes = _primaries(redis_cluster_url)
    for node in nodes:
        node.script_flush()
    backend = rl.RedisBackend.from_url(redis_cluster_url)
    try:
        check_report(backend.ping(), "redis-cluster", len(nodes))
        assert [node.script_exists(scripts.sha1()) for node in nodes] == [[True]] * len(nodes)
    finally:
        backend.close()
        for node in nodes:
            node.close()


@pytest.mark.cluster
async def test_aping_loads_the_script_on_every_primary_of_a_cluster(
    redis_cluster_url: str,
) -> None:
    nodes = _primaries(redis_cluster_url)
    for node in nodes:
        node.script_flush()
    backend = rl.AsyncRedisBackend.from_url(redis_cluster_url)
    try:
        check_report(await backend.aping(), "redis-cluster", len(nodes))
        assert [node.script_exists(scripts.sha1()) for node in nodes] == [[True]] * len(nodes)
    finally:
        await backend.aclose()
        for node in nodes:
            node.close()
