"""Redis Sentinel: ``redis+sentinel://`` finds the primary and follows a failover, no restart.

A real primary, a replica and three sentinels (``redis-server --sentinel``) run on free
loopback ports for this module (tests/sentinel.py) and are stopped afterwards. Traffic runs
through the ASGI middleware (async backend) and a sync Limiter while SENTINEL FAILOVER
swaps the primary: no request may end in a 500 or an exception other than BackendError, and
afterwards the same backend objects count exactly on the new primary. The start-up check
and the failovers run on Valkey 8 Sentinel too (valkey+sentinel://).
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections import Counter
from typing import Any

import pytest
import redis
from reliability._apps import asgi_app, asgi_client, install_clock
from reliability._support import PrivateRedis, refused_port
from sentinel import LocalSentinel

import ratelimit_mw as rl
from ratelimit_mw import asgi, keys
from ratelimit_mw.core import scripts

pytestmark = pytest.mark.slow


@pytest.fixture
def sentinel(request: pytest.FixtureRequest) -> LocalSentinel:
    """The Redis Sentinel set, or the Valkey one where a test is parametrised with
    ``indirect=True`` (`ON_BOTH`)."""
    return request.getfixturevalue(  # type: ignore[no-any-return]
        f"{getattr(request, 'param', 'redis')}_sentinel")


ON_BOTH = pytest.mark.parametrize("sentinel", ["redis", "valkey"], indirect=True)


def primary_client(sentinel: LocalSentinel) -> redis.Redis:
    return redis.Redis(port=sentinel.primary(), socket_timeout=2)


@ON_BOTH
async def test_the_start_up_check_reaches_the_primary_through_the_sentinels(
    sentinel: LocalSentinel, prefix: str,
) -> None:
    sync_backend = rl.RedisBackend.from_url(sentinel.url)
    async_backend = rl.AsyncRedisBackend.from_url(sentinel.url)
    primary = primary_client(sentinel)
    try:
        primary.script_flush()
        for report in (sync_backend.ping(), await async_backend.aping()):
            assert (report["backend"], report["cluster"], report["nodes"]) == (
                "redis-sentinel", False, 1)
        assert primary.script_exists(scripts.sha1()) == [True]
        limiter = rl.Limiter(sync_backend, prefix=prefix, deny_cache=0)
        assert [limiter.hit("2/minute", "u").allowed for _ in range(3)] == [True, True, False]
        assert primary.keys(f"{prefix}:*")  # written on the primary the sentinels name
    finally:
        primary.close()
        sync_backend.close()
        await async_backend.aclose()


async def test_a_service_the_sentinels_do_not_watch_is_a_backend_error(
    sentinel: LocalSentinel,
) -> None:
    url = sentinel.url.replace(f"/{sentinel.service}/", "/no-such-service/")
    with pytest.raises(rl.BackendError, match="start-up check failed"):
        rl.RedisBackend.from_url(url).ping()
    backend = rl.AsyncRedisBackend.from_url(url)
    with pytest.raises(rl.BackendError, match="start-up check failed"):
        await backend.aping()
    await backend.aclose()


async def test_a_reconnect_inside_a_retry_asks_the_sentinels_for_the_primary(
    sentinel: LocalSentinel,
) -> None:
    """redis-py 8 reconnects inside a command's retry through ``connect_check_health``,
    which used the connection's last address: after a failover, the demoted primary."""
    sync_backend = rl.RedisBackend.from_url(sentinel.url)
    async_backend = rl.AsyncRedisBackend.from_url(sentinel.url)
    try:
        with refused_port() as gone:  # where the primary was before it failed over
            conn = sync_backend.client.connection_pool.get_connection()
            conn.disconnect()
            conn.host, conn.port = "127.0.0.1", gone
            conn.connect_check_health(check_health=False)  # the retry's reconnect
            assert conn.port == sentinel.primary()
            sync_backend.client.connection_pool.release(conn)
            aconn = await async_backend.client.connection_pool.get_connection()
            await aconn.disconnect()
            aconn.host, aconn.port = "127.0.0.1", gone
            await aconn.connect_check_health(check_health=False)
            assert aconn.port == sentinel.primary()
            await async_backend.client.connection_pool.release(aconn)
    finally:
        sync_backend.close()
        await async_backend.aclose()


@ON_BOTH
async def test_traffic_through_a_failover_never_fails_and_counts_exactly_afterwards(
    sentinel: LocalSentinel, prefix: str, capsys: pytest.CaptureFixture[str],
) -> None:
    # Timeouts of half a second: the claim is about following the primary, and a loaded
    # CI machine answering in more than 100 ms must not be taken for a failover failure.
    async_backend = rl.AsyncRedisBackend.from_url(sentinel.url, socket_timeout=0.5)
    sync_backend = rl.RedisBackend.from_url(sentinel.url, socket_timeout=0.5)
    async_limiter = rl.AsyncLimiter(async_backend, prefix=prefix, deny_cache=0)
    sync_limiter = rl.Limiter(sync_backend, prefix=prefix, deny_cache=0)
    middleware = asgi.RateLimitMiddleware(asgi_app(), async_limiter, default="100000/minute",
                                          key=keys.header("x-client"), backend_timeout=0.5)
    breaker_clock = install_clock(middleware)
    done = threading.Event()
    sync_outcomes: Counter[str] = Counter()

    def sync_traffic() -> None:
        i = 0
        while not done.is_set():
            i += 1
            try:
                sync_outcomes["decided"] += bool(sync_limiter.hit("100000/minute", f"s{i % 20}"))
            except rl.BackendError:
                sync_outcomes["BackendError"] += 1  # the failure the limiter may raise
            except Exception as exc:  # pragma: no cover - what this test rules out
                sync_outcomes[f"unexpected {type(exc).__name__}: {exc}"] += 1
            done.wait(0.005)

    statuses: Counter[int] = Counter()
    undecided = 0
    async with asgi_client(middleware) as client:
        assert (await client.get("/", headers={"x-client": "warm"})).status_code == 200
        sync_limiter.hit("1/minute", "warm")
        thread = threading.Thread(target=sync_traffic)
        thread.start()
        failover = asyncio.ensure_future(asyncio.to_thread(sentinel.failover))
        i = 0
        try:
            while not failover.done():
                i += 1
                # An app exception would propagate out of the ASGI transport: none may.
                response = await client.get("/", headers={"x-client": f"a{i % 20}"})
                statuses[response.status_code] += 1
                undecided += not response.json()["decided"]
                await asyncio.sleep(0.005)
            old, new = await failover
        finally:
            done.set()
            thread.join()
        # A call that failed during the switch opened the breaker: let its cool-down pass.
        breaker_clock.advance(middleware.guard.breaker.cooldown)
        after = [await client.get("/", headers={"x-client": f"after{n}"}) for n in range(20)]

    with capsys.disabled():  # the figures for the docs, shown with -s or on failure
        print(f"\nsentinel failover {old}->{new}: ASGI statuses {dict(statuses)}, admitted "
              f"by the failure policy {undecided}; sync calls {dict(sync_outcomes)}")
    assert set(statuses) == {200}, statuses  # no 500 (and nothing refused at this rate)
    assert set(sync_outcomes) <= {"decided", "BackendError"}, sync_outcomes
    assert sync_outcomes["decided"] > 0
    assert all(r.status_code == 200 and r.json()["decided"] for r in after)

    # The same backend objects, no restart: exact counts, on the new primary.
    policy = rl.Policy("5/minute", name="exact")
    assert [(await async_limiter.hit(policy, "fresh-a")).allowed for _ in range(8)] == \
        [True] * 5 + [False] * 3
    assert [sync_limiter.hit(policy, "fresh-s").allowed for _ in range(8)] == \
        [True] * 5 + [False] * 3
    assert sentinel.primary() == new != old
    promoted = redis.Redis(port=new, socket_timeout=2)
    try:
        assert promoted.keys(f"{prefix}:{{fresh-a}}:*") and promoted.keys(f"{prefix}:{{fresh-s}}:*")
        for key in promoted.scan_iter(match=f"{prefix}:*"):
            promoted.delete(key)
    finally:
        promoted.close()
        sync_backend.close()
        await async_backend.aclose()


def role(port: int) -> str:
    client = redis.Redis(port=port, socket_timeout=2)
    try:
        return str(client.info("replication")["role"])
    finally:
        client.close()


@ON_BOTH
async def test_the_async_backend_follows_the_announcement_not_the_demotion(
    sentinel: LocalSentinel, prefix: str,
) -> None:
    """After SENTINEL FAILOVER the async checks move to the promoted replica as soon as a
    sentinel announces it (+failover-state-wait-promotion, +switch-master), while the old
    primary still takes writes as a primary: every count written there until its demotion
    (seconds later) is thrown away when it becomes a replica. Here the checks reach the new
    primary before the old one is demoted, and every check of the switch is decided (none
    refused, none failed)."""
    backend = rl.AsyncRedisBackend.from_url(sentinel.url, socket_timeout=0.5)
    limiter = rl.AsyncLimiter(backend, prefix=prefix, deny_cache=0)
    old = sentinel.primary()
    new = sentinel.replica_port if old == sentinel.primary_port else sentinel.primary_port
    outcomes: Counter[str] = Counter()
    moved_while_old_was_primary = False
    try:
        await limiter.ping()  # connected, listening to the sentinels
        await asyncio.sleep(0.2)  # the listeners have subscribed
        failover = asyncio.ensure_future(asyncio.to_thread(sentinel.failover))
        on_new = redis.Redis(port=new, socket_timeout=2)
        on_old = redis.Redis(port=old, socket_timeout=2)
        i = 0
        while not failover.done():
            i += 1
            try:
                outcomes["admitted" if (await limiter.hit("1000000/hour", f"f{i}")).allowed
                         else "refused"] += 1
            except rl.BackendError:
                outcomes["BackendError"] += 1
            # Written on the new primary itself (not replicated from the old one, which does
            # not have it), while the old one is still a primary.
            pattern = f"{prefix}:{{f{i}}}:*"
            if not moved_while_old_was_primary and role(old) == "master" \
                    and not on_old.keys(pattern) and on_new.keys(pattern):
                moved_while_old_was_primary = True
            await asyncio.sleep(0.01)
        await failover
        on_new.close()
        on_old.close()
        assert moved_while_old_was_primary, outcomes
        assert set(outcomes) <= {"admitted", "BackendError"}, outcomes
        assert (await limiter.hit("1000000/hour", "after")).allowed
        promoted = redis.Redis(port=new, socket_timeout=2)
        for key in promoted.scan_iter(match=f"{prefix}:*"):
            promoted.delete(key)
        promoted.close()
    finally:
        await backend.aclose()


@pytest.mark.parametrize(
    ("message", "primary"),
    [
        ([b"message", b"+switch-master", b"mymaster 127.0.0.1 6379 127.0.0.1 6380"],
         ("127.0.0.1", 6380)),
        (["message", "+switch-master", "mymaster 10.0.0.1 6379 10.0.0.2 6379"],
         ("10.0.0.2", 6379)),
        ([b"message", b"+switch-master", b"other 127.0.0.1 6379 127.0.0.1 6380"], None),
        ([b"subscribe", b"+switch-master", 1], None),
        ([b"message", b"+switch-master", b"mymaster 127.0.0.1 6379"], None),
        ([b"message", b"+switch-master", b"mymaster a b c notaport"], None),
        (None, None),
        ([b"pong", b""], None),
        ([b"message", b"+failover-state-wait-promotion",
          b"slave 127.0.0.1:6380 127.0.0.1 6380 @ mymaster 127.0.0.1 6379"], ("127.0.0.1", 6380)),
        ([b"message", b"+failover-state-wait-promotion",
          b"slave 127.0.0.1:6380 127.0.0.1 6380 @ other 127.0.0.1 6379"], None),
        ([b"message", b"+selected-slave",
          b"slave 127.0.0.1:6380 127.0.0.1 6380 @ mymaster 127.0.0.1 6379"], None),
    ],
    ids=["bytes", "str", "another-service", "subscribed", "short", "bad-port", "none", "pong",
         "promotion", "promotion-of-another", "selected-only"],
)
def test_an_announcement_names_the_new_primary_of_its_service_only(
    message: object, primary: tuple[str, int] | None,
) -> None:
    from ratelimit_mw.backends.sentinel import announced

    assert announced(message, "mymaster") == primary


async def test_a_switch_announced_while_connecting_is_followed_and_survives_a_failed_connect(
) -> None:
    """An announcement that comes while a connection is being made to the old primary is
    not lost: that connection is given up and the retry goes to the announced one. One
    whose first connect fails is still where the next connect goes (the sentinels asked
    instead may still name the old primary)."""
    from ratelimit_mw.backends.pipeline import PipelinedConnection
    from ratelimit_mw.backends.settings import Settings
    from tests.conftest import REDIS_URL

    old = ("127.0.0.1", redis.Redis.from_url(REDIS_URL).connection_pool.connection_kwargs[
        "port"])
    new = PrivateRedis().start()
    connection: PipelinedConnection

    async def locate() -> tuple[str, int]:
        connection._switched("127.0.0.1", new.port)  # announced while connecting
        return old

    connection = PipelinedConnection(Settings(host=old[0], port=old[1], locate=locate,
                                              timeout=2, connect_timeout=2))
    try:
        assert await connection.command("PING") == b"PONG"
        assert connection.protocol.address == ("127.0.0.1", new.port)  # type: ignore[union-attr]
        new.stop()
        connection._switched("127.0.0.1", new.port)  # announced, and down for a moment
        with pytest.raises(redis.ConnectionError):
            await connection.command("PING")
        new.start()
        assert await connection.command("PING") == b"PONG"
        assert connection.protocol.address == ("127.0.0.1", new.port)  # type: ignore[union-attr]
    finally:
        await connection.aclose()
        new.kill()


def test_a_sentinel_backend_serves_each_event_loop_and_closes_from_another(
    sentinel: LocalSentinel, prefix: str,
) -> None:
    """The sentinels are asked on connections of the running loop (redis-py's sentinel
    clients belong to the loop they first ran on), and the listeners of a loop that has
    gone are not awaited on another."""
    backend = rl.AsyncRedisBackend.from_url(sentinel.url, socket_timeout=1)
    limiter = rl.AsyncLimiter(backend, prefix=prefix, deny_cache=0)
    policy = rl.Policy("5/minute", name="loops")
    first = asyncio.run(limiter.hit(policy, "u"))
    second = asyncio.run(limiter.hit(policy, "u"))
    assert (first.remaining, second.remaining) == (4, 3)
    asyncio.run(backend.aclose())
    primary = primary_client(sentinel)
    try:
        for key in primary.scan_iter(match=f"{prefix}:*"):
            primary.delete(key)
    finally:
        primary.close()


def test_a_users_sentinel_connection_class_keeps_its_methods_on_the_sync_backend(
    sentinel: LocalSentinel, prefix: str,
) -> None:
    import redis.sentinel

    from ratelimit_mw.backends.sentinel import following

    connects: list[int] = []

    class Audited(redis.sentinel.SentinelManagedConnection):
        def _connect(self) -> Any:
            connects.append(self.port)
            return super()._connect()

    assert issubclass(following(Audited), Audited) and following(Audited) is following(Audited)
    client = redis.sentinel.Sentinel(
        [("127.0.0.1", port) for port in sentinel.sentinel_ports],
        sentinel_kwargs={"socket_timeout": 1}).master_for(
            sentinel.service, connection_class=Audited, socket_timeout=1)
    backend = rl.RedisBackend(client)
    try:
        assert rl.Limiter(backend, prefix=prefix, deny_cache=0).hit("5/minute", "u").allowed
        assert connects == [sentinel.primary()]  # its own _connect ran, on the primary
    finally:
        backend.close()
        primary = primary_client(sentinel)
        for key in primary.scan_iter(match=f"{prefix}:*"):
            primary.delete(key)
        primary.close()


async def test_the_primary_is_found_as_redis_py_finds_it_on_the_running_loop(
    sentinel: LocalSentinel,
) -> None:
    """`primary_of` asks on connections of its own, but decides as redis-py's
    discover_master does: a server that is no sentinel is passed over (and the one that
    answered is asked first next time), force_master_ip applies, and a sentinel that sees
    too few others names nothing."""
    import redis.asyncio.sentinel

    from ratelimit_mw.backends.sentinel import primary_of
    from tests.conftest import REDIS_URL

    addresses = [("127.0.0.1", port) for port in sentinel.sentinel_ports]
    manager = redis.asyncio.sentinel.Sentinel(addresses, sentinel_kwargs={"socket_timeout": 1})
    not_a_sentinel = redis.asyncio.Redis.from_url(REDIS_URL)
    manager.sentinels.insert(0, not_a_sentinel)
    assert await primary_of(manager, sentinel.service) == ("127.0.0.1", sentinel.primary())
    assert manager.sentinels[0] is not not_a_sentinel
    forced = redis.asyncio.sentinel.Sentinel(addresses, force_master_ip="10.9.8.7")
    assert await primary_of(forced, sentinel.service) == ("10.9.8.7", sentinel.primary())
    strict = redis.asyncio.sentinel.Sentinel(addresses, min_other_sentinels=5)
    with pytest.raises(redis.asyncio.sentinel.MasterNotFoundError, match="no sentinel"):
        await primary_of(strict, sentinel.service)
    with pytest.raises(redis.asyncio.sentinel.MasterNotFoundError):
        await primary_of(manager, "no-such-service")
    for client in (*manager.sentinels, *forced.sentinels, *strict.sentinels):
        await client.aclose()


async def test_a_hung_sentinel_listed_first_leaves_the_others_time_to_answer(
    sentinel: LocalSentinel, prefix: str,
) -> None:
    """A sentinel that accepts and never answers (a blackholed host) costs its own
    timeout, not the whole connect: the next sentinel names the primary and the checks
    go on at the library's defaults."""
    import socket

    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)  # the kernel completes the handshake; nobody ever reads
        hosts = ",".join(f"127.0.0.1:{port}"
                         for port in (hung.getsockname()[1], *sentinel.sentinel_ports))
        backend = rl.AsyncRedisBackend.from_url(
            f"redis+sentinel://{hosts}/{sentinel.service}/0")
        try:
            report = await backend.aping()
            assert report["backend"] == "redis-sentinel"
            limiter = rl.AsyncLimiter(backend, prefix=prefix, deny_cache=0)
            assert (await limiter.hit("5/minute", "u")).remaining == 4
            await limiter.reset("5/minute", "u")
        finally:
            await backend.aclose()



@pytest.mark.skipif(sys.version_info < (3, 11),
                    reason="Python 3.10's bounded is asyncio.wait_for: no look after a stall")
@ON_BOTH
async def test_a_loop_stalled_while_the_sentinels_are_asked_still_finds_the_primary(
    sentinel: LocalSentinel,
) -> None:
    """The lookup's bound (a connect timeout per sentinel, all told) follows the deadline
    rule of every call: a worker that stalls past it (a collection, a busy start-up) while a
    hung sentinel is asked does not fail its start-up check; the next sentinel answers."""
    import socket
    import time

    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        hosts = ",".join(f"127.0.0.1:{port}"
                         for port in (hung.getsockname()[1], *sentinel.sentinel_ports))
        backend = rl.AsyncRedisBackend.from_url(
            f"{sentinel.flavour.name}+sentinel://{hosts}/{sentinel.service}/0")
        # While the hung sentinel is waited for, the whole loop stops for longer than the
        # lookup's bound (four sentinels x the 0.1 s default connect timeout).
        asyncio.get_running_loop().call_later(0.05, time.sleep, 0.5)
        try:
            report = await backend.aping()
            assert report["backend"] == "redis-sentinel"
        finally:
            await backend.aclose()
