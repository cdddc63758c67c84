"""The pipelined async cluster path: routing by slot, redirects, reconnects, bursts, and the
same answers as redis-py's cluster client.

Against the private 3-master cluster the test run starts (`redis_cluster_url`). A test that
moves a slot moves it back and deletes what it wrote.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

import pytest
import redis
import redis.asyncio
from redis.crc import key_slot
from reliability._support import refused_port

import ratelimit_mw as rl
from ratelimit_mw.backends import cluster as _cluster
from ratelimit_mw.core.identity import encode_identity, identity_slot

if TYPE_CHECKING:
    from conftest import StepClock

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("MOVED 3999 127.0.0.1:6381", ("MOVED", ("127.0.0.1", 6381))),
        ("ASK 3999 10.0.0.2:7000", ("ASK", ("10.0.0.2", 7000))),
        ("MOVED 12 :7001", ("MOVED", ("replier", 7001))),  # a node that does not know its IP
        ("ASK 1 ::1:7002", ("ASK", ("::1", 7002))),
        ("NOSCRIPT No matching script", None),
        ("ERR something MOVED", None),
        ("CLUSTERDOWN The cluster is down", None),
    ],
)
def test_redirects_are_read_from_error_replies(message: str, expected: object) -> None:
    assert _cluster.parse_redirect(message, ("replier", 1)) == expected


def test_the_slot_map_names_a_primary_for_every_range() -> None:
    reply = [
        [0, 5460, [b"127.0.0.1", 7000, b"id-a"], [b"127.0.0.1", 7003, b"id-r"]],
        [5461, 10922, [b"", 7001, b"id-b"]],
        [10923, 16383, [b"127.0.0.1", 7002, b"id-c"]],
    ]
    table = _cluster.parse_slots(reply, ("asked", 7001))
    assert len(table) == _cluster.SLOTS
    assert table[0] == table[5460] == ("127.0.0.1", 7000)  # the primary, not the replica
    assert table[5461] == table[10922] == ("asked", 7001)
    assert table[10923] == table[16383] == ("127.0.0.1", 7002)


def test_a_partial_slot_map_leaves_the_unserved_slots_empty() -> None:
    table = _cluster.parse_slots([[0, 99, [b"h", 1, b"x"]]], ("h", 1))
    assert table[99] == ("h", 1) and table[100] is None


@pytest.mark.parametrize("key", ["rl:{u0}:p.sl:0", "rl:{a}b}:x", "no-tag", "{}x", "x{y}{z}"])
def test_the_slot_is_the_one_redis_computes(key: str) -> None:
    assert _cluster.slot_of(key) == key_slot(key.encode())


# -- against the real cluster ---------------------------------------------------------------
def nodes(url: str) -> dict[int, redis.Redis]:
    """Port → a client on that primary."""
    probe = redis.Redis.from_url(url.replace("+cluster://", "://", 1))
    try:
        ports = sorted(int(address.rsplit(":", 1)[1])
                       for address, node in probe.cluster("NODES").items()
                       if "master" in node["flags"])
    finally:
        probe.close()
    return {port: redis.Redis(port=port, decode_responses=True) for port in ports}


@pytest.fixture
def primaries(redis_cluster_url: str) -> Iterator[dict[int, redis.Redis]]:
    clients = nodes(redis_cluster_url)
    yield clients
    for client in clients.values():
        client.close()


@pytest.fixture
async def backend(redis_cluster_url: str) -> AsyncIterator[rl.AsyncRedisBackend]:
    backend = rl.AsyncRedisBackend.from_url(redis_cluster_url, socket_timeout=5,
                                            socket_connect_timeout=5, client_name="rlpipe")
    assert isinstance(backend._pipe, _cluster.PipelinedCluster)
    yield backend
    await backend.aclose()


def owner(primaries: dict[int, redis.Redis], slot: int) -> int:
    any_node = next(iter(primaries.values()))
    for start, end, primary, *_ in any_node.execute_command("CLUSTER", "SLOTS"):
        if start <= slot <= end:
            return int(primary[1])
    raise AssertionError(f"nobody serves slot {slot}")


def slot_calls(primaries: dict[int, redis.Redis], command: str) -> int:
    total = 0
    for client in primaries.values():
        stats = client.info("commandstats").get(f"cmdstat_{command}")
        total += int(stats["calls"]) if stats else 0
    return total


async def test_a_burst_larger_than_any_pool_admits_exactly_the_limit(
    backend: rl.AsyncRedisBackend, prefix: str,
) -> None:
    limiter = rl.AsyncLimiter(backend, prefix=prefix, deny_cache=0)
    policies = [rl.Policy("250/hour", algorithm=a, name=a[:2]) for a in sorted(rl.ALGORITHMS)]
    decisions = await asyncio.gather(*(limiter.hit(policies[i % 4], f"user:{i % 12}")
                                       for i in range(1200)))
    assert sum(d.allowed for d in decisions) == 1200  # 25 per (policy, user) pair
    decisions = await asyncio.gather(*(limiter.hit(policies[0], "burst") for _ in range(1000)))
    assert sum(d.allowed for d in decisions) == 250


async def test_concurrent_first_calls_share_one_load_of_the_slot_map(
    backend: rl.AsyncRedisBackend, primaries: dict[int, redis.Redis], prefix: str,
) -> None:
    before = slot_calls(primaries, "cluster|slots")
    limiter = rl.AsyncLimiter(backend, prefix=prefix, deny_cache=0)
    decisions = await asyncio.gather(*(limiter.hit("5/minute", f"u{i % 40}")
                                       for i in range(200)))
    assert sum(d.allowed for d in decisions) == 200
    assert slot_calls(primaries, "cluster|slots") - before == 1


async def test_a_killed_connection_is_retried_once_and_counts_stay_exact(
    backend: rl.AsyncRedisBackend, primaries: dict[int, redis.Redis], prefix: str,
) -> None:
    limiter = rl.AsyncLimiter(backend, prefix=prefix, deny_cache=0)
    identities = [f"u{i}" for i in range(12)]  # spread over every primary
    for identity in identities:
        await limiter.hit("3/minute", identity)
    killed = 0
    for client in primaries.values():
        for entry in client.client_list():
            if entry["name"] == "rlpipe":
                client.client_kill_filter(_id=entry["id"])
                killed += 1
    assert killed == len(primaries)
    assert [(await limiter.hit("3/minute", i)).remaining for i in identities] == [1] * 12


def same_slot_identity(slot: int, taken: str) -> str:
    """Another identity whose keys hash to `slot` (the identity is the hash tag)."""
    for i in range(1_000_000):
        candidate = f"v{i}"
        if candidate != taken and key_slot(encode_identity(candidate).encode()) == slot:
            return candidate
    raise AssertionError("no identity found for the slot")  # pragma: no cover


async def test_a_migrating_slot_is_followed_through_ask_and_then_moved(
    backend: rl.AsyncRedisBackend, primaries: dict[int, redis.Redis], prefix: str,
) -> None:
    limiter = rl.AsyncLimiter(backend, prefix=prefix, deny_cache=0)
    policy = rl.Policy("4/hour", algorithm="sliding-log", name="mig")
    first = "u0"
    slot = key_slot(encode_identity(first).encode())
    second = same_slot_identity(slot, first)
    source_port = owner(primaries, slot)
    target_port = next(p for p in primaries if p != source_port)
    source, target = primaries[source_port], primaries[target_port]
    ids = {port: client.execute_command("CLUSTER", "MYID") for port, client in primaries.items()}
    assert (await limiter.hit(policy, first)).remaining == 3  # slot map loaded, key on source
    asks = slot_calls(primaries, "asking")
    try:
        target.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source_port])
        source.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target_port])
        # Keys still on the source are served there; a new identity's keys are not: ASK.
        assert (await limiter.hit(policy, first)).remaining == 2
        assert (await limiter.hit(policy, second)).remaining == 3
        assert slot_calls(primaries, "asking") == asks + 1
        keys = source.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100)
        assert keys
        source.execute_command("MIGRATE", "127.0.0.1", target_port, "", 0, 5000, "KEYS", *keys)
        for port in (target_port, source_port, *primaries):
            primaries[port].execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[target_port])
        # The source now answers MOVED: the call follows it, and every count goes on exactly.
        assert (await limiter.hit(policy, first)).remaining == 1
        assert (await limiter.hit(policy, second)).remaining == 2
        assert [(await limiter.hit(policy, first)).allowed for _ in range(2)] == [True, False]
        await asyncio.sleep(0.05)  # the background reload after MOVED
        assert backend._pipe._slots[slot] == ("127.0.0.1", target_port)
    finally:
        for client in primaries.values():
            for key in client.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
                client.execute_command("ASKING")
                client.delete(key)
        for port in (source_port, target_port, *primaries):
            primaries[port].execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[source_port])


@pytest.mark.parametrize("seed", range(4))
async def test_pipelined_and_redis_py_cluster_clients_give_identical_decisions(
    redis_cluster_url: str, prefix: str, step_clock: StepClock, seed: int,
) -> None:
    """The async pipelined cluster against redis-py's sync RedisCluster (what RedisBackend
    drives): random hits, peeks, refunds and resets of random costs on a controlled clock,
    every Decision compared."""
    plain_url = redis_cluster_url.replace("+cluster://", "://", 1)
    piped = rl.AsyncRedisBackend(redis.asyncio.RedisCluster.from_url(plain_url))
    reference = rl.RedisBackend(redis.cluster.RedisCluster.from_url(plain_url))
    a = rl.AsyncLimiter(piped, prefix=prefix + "a", clock=step_clock, deny_cache=0)
    b = rl.Limiter(reference, prefix=prefix + "b", clock=step_clock, deny_cache=0)
    rng = random.Random(seed)
    policies = [rl.Policy("5/second;12/minute", algorithm=name, name=name[:2])
                for name in sorted(rl.ALGORITHMS)]
    try:
        for _ in range(120):
            policy, identity = rng.choice(policies), f"id{rng.randrange(6)}"
            op = rng.choices(["hit", "peek", "refund", "reset"], [8, 2, 1, 1])[0]
            step_clock.advance_ms(rng.randrange(0, 400))
            if op == "hit":
                cost = rng.randint(1, 4)
                x, y = await a.hit(policy, identity, cost), b.hit(policy, identity, cost)
            elif op == "peek":
                x, y = await a.peek(policy, identity), b.peek(policy, identity)
            elif op == "refund":
                x, y = await a.refund(policy, identity), b.refund(policy, identity)
            else:
                x, y = await a.reset(policy, identity), b.reset(policy, identity)
            assert x == y, (op, policy, identity)
    finally:
        await piped.aclose()
        reference.close()


async def test_a_wrong_startup_node_is_a_backend_error(prefix: str) -> None:
    backend = rl.AsyncRedisBackend.from_url("redis+cluster://127.0.0.1:1/0")
    assert isinstance(backend._pipe, _cluster.PipelinedCluster)
    with pytest.raises(rl.BackendError, match="CLUSTER SLOTS"):
        await rl.AsyncLimiter(backend, prefix=prefix).hit("1/minute", "u")
    await backend.aclose()


async def test_a_lost_start_up_node_is_not_needed_once_the_primaries_are_known(
    backend: rl.AsyncRedisBackend, prefix: str,
) -> None:
    limiter = rl.AsyncLimiter(backend, prefix=prefix, deny_cache=0)
    assert (await limiter.hit("3/minute", "u")).remaining == 2
    cluster = backend._pipe
    with refused_port() as gone:
        cluster.startup = [("127.0.0.1", gone)]  # the node the URL named is gone
        cluster._stale = True  # as after a lost connection
        assert (await limiter.hit("3/minute", "u")).remaining == 1  # asked another primary
    assert not cluster._stale


async def test_node_of_names_the_primary_that_serves_an_identity(
        backend: rl.AsyncRedisBackend, primaries: dict[int, redis.Redis],
        redis_cluster_url: str, prefix: str) -> None:
    """What the middleware keys its breaker per node by: the async and the sync backends
    name the primary whose slot range holds the identity's keys (None before the map is
    loaded)."""
    identities = ["u0", "user:42", "{x}", "é" * 80]
    assert backend.node_of("u0") is None
    limiter = rl.AsyncLimiter(backend, prefix=prefix)
    sync = rl.RedisBackend.from_url(redis_cluster_url)
    try:
        for identity in identities:
            await limiter.hit("5/minute", identity)
            rl.Limiter(sync, prefix=prefix).hit("5/minute", identity)
        for identity in identities:
            slot = identity_slot(identity)
            assert slot == key_slot(f"{prefix}:{{{encode_identity(identity)}}}:x".encode())
            port = owner(primaries, slot)
            assert backend.node_of(identity)[1] == port
            assert str(sync.node_of(identity)).endswith(f":{port}")
    finally:
        sync.close()
