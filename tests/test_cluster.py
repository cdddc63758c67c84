"""On a Redis Cluster: one call per slot, no CROSSSLOT, compensation across slots, exactness.

The cluster is private (three masters on free loopback ports, started once per session by the
`redis_cluster_url` fixture and always stopped). Every test writes under its own prefix.
"""

from __future__ import annotations

import multiprocessing
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

import pytest
import redis
import redis.asyncio
import redis.cluster
from redis.crc import key_slot

import ratelimit_mw as rl
from ratelimit_mw.core import codec

if TYPE_CHECKING:
    from conftest import StepClock

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ALGORITHMS = sorted(rl.ALGORITHMS)


def plain(url: str) -> str:
    return url.replace("+cluster://", "://", 1)


@pytest.fixture
def prefix() -> str:
    return "k" + uuid.uuid4().hex[:12]


@pytest.fixture(scope="module")
def cluster_client(redis_cluster_url: str) -> Iterator[redis.cluster.RedisCluster]:
    client = redis.cluster.RedisCluster.from_url(plain(redis_cluster_url))
    yield client
    client.close()


@pytest.fixture
def cluster_backend(cluster_client: redis.cluster.RedisCluster) -> rl.RedisBackend:
    return rl.RedisBackend(cluster_client)


@pytest.fixture
async def async_cluster_backend(redis_cluster_url: str) -> AsyncIterator[rl.AsyncRedisBackend]:
    backend = rl.AsyncRedisBackend(redis.asyncio.RedisCluster.from_url(plain(redis_cluster_url)))
    yield backend
    await backend.aclose()


def node_ports(client: redis.cluster.RedisCluster) -> list[int]:
    return sorted(node.port for node in client.get_primaries())


def flush_scripts(client: redis.cluster.RedisCluster) -> None:
    for port in node_ports(client):
        node = redis.Redis(port=port)
        node.script_flush()
        node.close()


def test_from_url_gives_a_cluster_backend_with_safe_timeouts(redis_cluster_url: str) -> None:
    backend = rl.RedisBackend.from_url(redis_cluster_url)
    try:
        assert backend.is_cluster
        assert isinstance(backend.client, redis.cluster.RedisCluster)
        node = backend.client.get_default_node()
        kwargs = node.redis_connection.connection_pool.connection_kwargs
        assert kwargs["socket_timeout"] == pytest.approx(0.1)
        assert rl.Limiter(backend, prefix="k" + uuid.uuid4().hex[:8]).hit("1/minute", "u")
    finally:
        backend.close()


async def test_async_from_url_gives_a_cluster_backend(redis_cluster_url: str) -> None:
    backend = rl.AsyncRedisBackend.from_url(redis_cluster_url)
    try:
        assert backend.is_cluster
        limiter = rl.AsyncLimiter(backend, prefix="k" + uuid.uuid4().hex[:8])
        assert [(await limiter.hit("2/minute", "u")).allowed for _ in range(3)] == [
            True, True, False]
    finally:
        await backend.aclose()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_multi_tier_policies_never_cross_slots_for_any_identity(
    cluster_backend: rl.RedisBackend, cluster_client: redis.cluster.RedisCluster, prefix: str,
    step_clock: StepClock, algorithm: str,
) -> None:
    limiter = rl.Limiter(cluster_backend, prefix=prefix, clock=step_clock, deny_cache=0)
    policy = rl.Policy("2/minute;3/hour;4/day", algorithm=algorithm, penalty=60)
    identities = [f"user:{i}" for i in range(60)] + ["{}", "a}b{c", "é" * 100, "#x"]
    for identity in identities:
        assert [limiter.hit(policy, identity).allowed for _ in range(3)] == [True, True, False]
        assert limiter.peek(policy, identity).banned
    keys = list(cluster_client.scan_iter(match=f"{prefix}:*"))
    slots = {key_slot(key) for key in keys}
    assert len(slots) == len(identities)  # each identity is one slot, with all its keys
    nodes = {cluster_client.get_node_from_key(key).port for key in keys}
    assert len(nodes) == len(node_ports(cluster_client))  # and they spread over every master


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_refusal_in_a_later_slot_gives_back_what_the_earlier_slot_took(
    cluster_backend: rl.RedisBackend, prefix: str, step_clock: StepClock, algorithm: str,
) -> None:
    limiter = rl.Limiter(cluster_backend, prefix=prefix, clock=step_clock, deny_cache=0)
    ip = rl.Policy("5/minute;8/hour", algorithm=algorithm, name="ip")
    user = rl.Policy("1/minute", algorithm="gcra", name="user")
    assert key_slot(b"{ip:1}") != key_slot(b"{user:1}")
    checks = [rl.Check(ip, "ip:1"), rl.Check(user, "user:1")]
    assert limiter.check(checks).allowed
    before = limiter.peek(ip, "ip:1")
    refused = limiter.check(checks)  # ip:1's slot admits first, then user:1's refuses
    assert not refused.allowed and refused.identity == "user:1"
    assert len(refused.tiers) == 3
    after = limiter.peek(ip, "ip:1")
    assert [t.remaining for t in after.tiers] == [t.remaining for t in before.tiers] == [4, 7]


def test_every_slot_is_asked_so_the_longest_wait_and_every_ban_count(
    cluster_backend: rl.RedisBackend, prefix: str, step_clock: StepClock,
) -> None:
    # As on one node: the slot refusing for an hour governs even when another slot's
    # 1-second refusal comes first, and its penalty starts a ban (the plan stopped at the
    # first refusal: Retry-After 1 s, refused again then, and no ban).
    limiter = rl.Limiter(cluster_backend, prefix=prefix, clock=step_clock, deny_cache=0)
    short = rl.Policy("1/second", name="short")
    long = rl.Policy("1/hour", name="long", penalty="2 hours")
    assert key_slot(b"{a:1}") != key_slot(b"{b:1}")
    checks = [rl.Check(short, "a:1"), rl.Check(long, "b:1")]
    assert limiter.check(checks).allowed
    refused = limiter.check(checks)
    assert not refused.allowed and refused.policy is long and refused.retry_after == 7200.0
    assert limiter.peek(long, "b:1").banned
    step_clock.advance_ms(1_000)
    assert limiter.peek(short, "a:1").allowed  # the refused request took nothing there


async def test_async_cluster_checks_give_back_across_slots(
    async_cluster_backend: rl.AsyncRedisBackend, prefix: str, step_clock: StepClock,
) -> None:
    limiter = rl.AsyncLimiter(async_cluster_backend, prefix=prefix, clock=step_clock,
                              deny_cache=0)
    ip = rl.Policy("5/minute", name="ip")
    user = rl.Policy("1/minute", algorithm="fixed-window", name="user")
    checks = [rl.Check(ip, "ip:1"), rl.Check(user, "user:1")]
    assert (await limiter.check(checks)).allowed
    assert not (await limiter.check(checks)).allowed
    assert (await limiter.peek(ip, "ip:1")).remaining == 4
    await limiter._give_back(checks)
    assert (await limiter.peek(ip, "ip:1")).remaining == 5
    assert (await limiter.peek(user, "user:1")).remaining == 1


async def test_async_cluster_gives_back_a_turn_of_slots_per_slot_and_past_a_failing_node(
    async_cluster_backend: rl.AsyncRedisBackend, prefix: str, step_clock: StepClock,
) -> None:
    # The responses that ended in one turn of a worker's loop: their slots go back in one
    # call per identity's slot; a node that fails its call keeps no other node's slots.
    limiter = rl.AsyncLimiter(async_cluster_backend, prefix=prefix, clock=step_clock,
                              deny_cache=0)
    slots = rl.Policy.in_flight(1, name="export")
    names = ["alice", "bob", "carol"]
    hits = []
    for name in names:
        compiled = limiter.compile([(slots, 1)])
        token = compiled.token()
        assert (await limiter.hit_compiled(compiled, (name,), None, token=token)).allowed
        hits.append(((rl.Check(slots, name),), token, 0))
    sent: list[codec.ScriptCall] = []
    arun = async_cluster_backend.arun

    async def alice_s_node_fails(call: codec.ScriptCall,
                                 deadline: float | None = None) -> list[int]:
        sent.append(call)
        if call.layout[0][1] == "alice":
            raise rl.BackendError("alice's node timed out")
        return await arun(call, deadline)

    async_cluster_backend.arun = alice_s_node_fails  # type: ignore[method-assign]
    try:
        with pytest.raises(rl.BackendError):
            await limiter.give_back_all(hits)
    finally:
        del async_cluster_backend.arun
    assert sorted(call.layout[0][1] for call in sent) == names  # one call each, all tried
    assert not (await limiter.peek(slots, "alice")).allowed  # its lease will free it
    assert (await limiter.peek(slots, "bob")).allowed
    assert (await limiter.peek(slots, "carol")).allowed


@pytest.mark.parametrize("algorithm", ALGORITHMS)
async def test_async_cluster_runs_every_algorithm(
    async_cluster_backend: rl.AsyncRedisBackend, prefix: str, step_clock: StepClock,
    algorithm: str,
) -> None:
    limiter = rl.AsyncLimiter(async_cluster_backend, prefix=prefix, clock=step_clock,
                              deny_cache=0)
    policy = rl.Policy("2/minute;3/hour", algorithm=algorithm)
    for i in range(20):
        results = [(await limiter.hit(policy, f"u{i}")).allowed for _ in range(3)]
        assert results == [True, True, False]
    step_clock.advance(120)
    assert (await limiter.hit(policy, "u0")).remaining == 0  # the hour tier: 3 - 3


def test_a_script_flush_on_every_node_is_survived(
    cluster_backend: rl.RedisBackend, cluster_client: redis.cluster.RedisCluster, prefix: str,
) -> None:
    limiter = rl.Limiter(cluster_backend, prefix=prefix, deny_cache=0)
    policy = rl.Policy("3/minute", algorithm="sliding-window")
    identities = [f"u{i}" for i in range(12)]
    for identity in identities:
        limiter.hit(policy, identity)
    flush_scripts(cluster_client)
    assert [limiter.hit(policy, identity).remaining for identity in identities] == [1] * 12


async def test_a_script_flush_on_every_node_is_survived_async(
    async_cluster_backend: rl.AsyncRedisBackend, cluster_client: redis.cluster.RedisCluster,
    prefix: str,
) -> None:
    limiter = rl.AsyncLimiter(async_cluster_backend, prefix=prefix, deny_cache=0)
    identities = [f"u{i}" for i in range(12)]
    for identity in identities:
        await limiter.hit("3/minute", identity)
    flush_scripts(cluster_client)
    assert [(await limiter.hit("3/minute", i)).remaining for i in identities] == [1] * 12


def cluster_hammer(url: str, prefix: str, algorithm: str, attempts: int,
                   start_at: float) -> int:
    backend = rl.RedisBackend.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    limiter = rl.Limiter(backend, prefix=prefix, deny_cache=0)
    policy = rl.Policy("20/hour;30/day", algorithm=algorithm)
    limiter.peek(policy, "shared")
    time.sleep(max(0.0, start_at - time.time()))
    admitted = sum(limiter.hit(policy, "shared").allowed for _ in range(attempts))
    backend.close()
    return admitted


def test_processes_racing_on_the_cluster_admit_exactly_the_limit(
    redis_cluster_url: str,
) -> None:
    if 86_400 - time.time() % 86_400 < 20:  # a day window must not roll mid-race
        time.sleep(21)
    context = multiprocessing.get_context("spawn")
    with context.Pool(3) as pool:
        for algorithm in ALGORITHMS:
            prefix = "k" + uuid.uuid4().hex[:12]
            start_at = time.time() + 0.5
            admitted = pool.starmap(
                cluster_hammer,
                [(redis_cluster_url, prefix, algorithm, 12, start_at) for _ in range(3)],
                chunksize=1,
            )
            assert sum(admitted) == 20, (algorithm, admitted)


def test_one_call_per_identity_on_a_cluster(prefix: str) -> None:
    """The core groups by identity: all tiers of one identity share one slot and one call."""
    a = rl.Policy("1/second;5/minute", name="a", penalty=5)
    b = rl.Policy("2/second", name="b", algorithm="gcra")
    checks = [rl.Check(a, "x"), rl.Check(b, "y"), rl.Check(b, "x")]
    groups = codec.group_by_slot(checks)
    for group in groups:
        call = codec.build(codec.HIT, group, prefix)
        assert len({key_slot(key.encode()) for key in call.keys}) == 1
    assert len(groups) == 2
