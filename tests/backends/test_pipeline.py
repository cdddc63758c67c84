"""The pipelined async connection: exactly redis-py's answers, fewer steps."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis
import redis.asyncio

import ratelimit_mw as rl
from ratelimit_mw.backends import pipeline as _pipeline
from ratelimit_mw.core import scripts

REDIS = "redis://127.0.0.1:6379"


def policy(algorithm: str = "gcra") -> rl.Policy:
    return rl.Policy("10/minute;50/hour", algorithm=algorithm, name=uuid.uuid4().hex[:10])


@pytest.mark.parametrize(
    ("client", "eligible"),
    [
        (lambda: redis.asyncio.Redis(), True),
        (lambda: redis.asyncio.Redis.from_url(f"{REDIS}/1"), True),
        (lambda: redis.asyncio.Redis(protocol=3), False),
        (lambda: redis.asyncio.Redis(ssl=True), False),
        (lambda: redis.asyncio.Redis(unix_socket_path="/tmp/nothing.sock"), False),
    ],
    ids=["plain", "url-with-db", "resp3", "tls", "unix-socket"],
)
def test_only_plain_tcp_resp2_clients_take_the_pipelined_path(client, eligible) -> None:
    assert _pipeline.eligible(client()) is eligible
    assert (rl.AsyncRedisBackend(client())._pipe is not None) is eligible


async def test_pipelined_and_redis_py_paths_give_the_same_answers(prefix: str) -> None:
    piped = rl.AsyncRedisBackend(redis.asyncio.Redis())
    plain = rl.AsyncRedisBackend(redis.asyncio.Redis(protocol=3))
    assert piped._pipe is not None and plain._pipe is None
    for algorithm in rl.ALGORITHMS:
        shared = policy(algorithm)
        a = rl.AsyncLimiter(piped, prefix=prefix + "a", deny_cache=0)
        b = rl.AsyncLimiter(plain, prefix=prefix + "b", deny_cache=0)
        for _ in range(12):
            x, y = await a.hit(shared, "ip:1"), await b.hit(shared, "ip:1")
            assert (x.allowed, x.remaining, x.limit) == (y.allowed, y.remaining, y.limit)
    await piped.aclose()
    await plain.aclose()


async def test_concurrent_calls_pipeline_on_one_connection_and_admit_exactly_the_limit(
    prefix: str,
) -> None:
    backend = rl.AsyncRedisBackend(redis.asyncio.Redis())
    limiter = rl.AsyncLimiter(backend, prefix=prefix, deny_cache=0)
    shared = policy("sliding-log")
    decisions = await asyncio.gather(*(limiter.hit(shared, "ip:1") for _ in range(200)))
    assert sum(d.allowed for d in decisions) == 10
    await backend.aclose()


async def test_a_flushed_script_cache_is_reloaded(prefix: str, redis_client: redis.Redis) -> None:
    backend = rl.AsyncRedisBackend(redis.asyncio.Redis())
    limiter = rl.AsyncLimiter(backend, prefix=prefix, deny_cache=0)
    shared = policy()
    assert (await limiter.hit(shared, "ip:1")).remaining == 9
    redis_client.script_flush()
    assert (await limiter.hit(shared, "ip:1")).remaining == 8
    await backend.aclose()


async def test_a_cancelled_call_leaves_the_replies_in_order(prefix: str) -> None:
    backend = rl.AsyncRedisBackend(redis.asyncio.Redis())
    limiter = rl.AsyncLimiter(backend, prefix=prefix, deny_cache=0)
    shared = policy()
    await limiter.hit(shared, "ip:warm")  # connect first, so the cancel hits an in-flight call
    cancelled = asyncio.ensure_future(limiter.hit(shared, "ip:1"))
    await asyncio.sleep(0)
    cancelled.cancel()
    others = [await limiter.hit(shared, "ip:2") for _ in range(3)]
    assert [d.remaining for d in others] == [9, 8, 7]
    await backend.aclose()


def test_each_event_loop_gets_its_own_connection(prefix: str) -> None:
    backend = rl.AsyncRedisBackend(redis.asyncio.Redis())
    limiter = rl.AsyncLimiter(backend, prefix=prefix, deny_cache=0)
    shared = policy()
    first = asyncio.run(limiter.hit(shared, "ip:1"))
    second = asyncio.run(limiter.hit(shared, "ip:1"))  # a new loop: no "attached to a
    assert (first.remaining, second.remaining) == (9, 8)  # different loop" error


async def test_the_database_from_the_url_is_selected(prefix: str) -> None:
    backend = rl.AsyncRedisBackend.from_url(f"{REDIS}/1")
    limiter = rl.AsyncLimiter(backend, prefix=prefix, deny_cache=0)
    await limiter.hit(policy(), "ip:1")
    in_db1 = redis.Redis(db=1)
    assert list(in_db1.scan_iter(match=f"{prefix}:*"))
    assert not list(redis.Redis(db=0).scan_iter(match=f"{prefix}:*"))
    await backend.aclose()


async def test_a_rejected_password_is_a_backend_error() -> None:
    backend = rl.AsyncRedisBackend.from_url("redis://:wrong@127.0.0.1:6379/0")
    with pytest.raises(rl.BackendError, match="AUTH"):
        await rl.AsyncLimiter(backend).hit(policy(), "ip:1")


async def test_a_silent_server_times_out_and_the_connection_is_dropped() -> None:
    """A server that answers the connection's set-up (SCRIPT LOAD), then nothing."""
    async def answer_setup_only(reader: asyncio.StreamReader,
                                writer: asyncio.StreamWriter) -> None:
        await reader.read(1 << 16)
        writer.write(b"$40\r\n" + scripts.sha1().encode() + b"\r\n")
        await writer.drain()
        await reader.read()  # silent until the client hangs up

    server = await asyncio.start_server(answer_setup_only, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    backend = rl.AsyncRedisBackend.from_url(f"redis://127.0.0.1:{port}", socket_timeout=0.05)
    try:
        with pytest.raises(rl.BackendError, match="Timeout reading"):
            await rl.AsyncLimiter(backend).hit(policy(), "ip:1")
        assert backend._pipe._protocol.lost is not None
    finally:
        server.close()
        await backend.aclose()


async def test_a_server_silent_from_the_start_times_out_and_is_hung_up_on() -> None:
    hung_up = asyncio.Event()

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(1 << 16):
            pass
        hung_up.set()

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    backend = rl.AsyncRedisBackend.from_url(f"redis://127.0.0.1:{port}", socket_timeout=0.05)
    try:
        with pytest.raises(rl.BackendError, match="Timeout"):
            await rl.AsyncLimiter(backend).hit(policy(), "ip:1")
        await asyncio.wait_for(hung_up.wait(), 10)  # no half-set-up connection is kept
        assert backend._pipe._protocol is None
    finally:
        server.close()
        await backend.aclose()


async def test_a_closed_port_is_a_backend_error() -> None:
    backend = rl.AsyncRedisBackend.from_url("redis://127.0.0.1:1")
    with pytest.raises(rl.BackendError, match="connecting"):
        await rl.AsyncLimiter(backend).hit(policy(), "ip:1")


async def test_a_burst_leaves_in_two_writes_the_first_check_at_once(prefix: str) -> None:
    """Auto-pipelining: the check that finds the connection idle is written at once (Redis
    starts on it); the rest of the burst, sent while it is in flight, leaves in one write."""
    backend = rl.AsyncRedisBackend(redis.asyncio.Redis())
    limiter = rl.AsyncLimiter(backend, prefix=prefix, deny_cache=0)
    shared = policy("fixed-window")
    await limiter.hit(shared, "ip:warm")  # connected, script loaded
    transport = backend._pipe._protocol.transport
    writes: list[int] = []
    real_write = transport.write

    def counting_write(data: bytes) -> None:
        writes.append(data.count(b"EVALSHA"))
        real_write(data)

    transport.write = counting_write
    decisions = await asyncio.gather(*(limiter.hit(shared, f"ip:{i % 3}") for i in range(300)))
    assert writes == [1, 299]
    assert [sum(d.allowed for d in decisions[i::3]) for i in range(3)] == [10, 10, 10]
    sequential = [(await limiter.hit(shared, "ip:seq")).remaining for _ in range(3)]
    assert sequential == [9, 8, 7] and writes == [1, 299, 1, 1, 1]
    await backend.aclose()


async def test_every_call_queued_on_a_hung_server_fails_within_the_timeout() -> None:
    """One deadline timer per connection: the oldest unanswered call decides for all."""
    released = asyncio.Event()  # set only when the test ends: the server never answers

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1 << 16)
        await released.wait()

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    backend = rl.AsyncRedisBackend.from_url(f"redis://127.0.0.1:{port}", socket_timeout=0.05)
    limiter = rl.AsyncLimiter(backend)
    try:
        # The outer wait_for only turns a hang (no deadline at all) into a failure.
        outcomes = await asyncio.wait_for(asyncio.gather(
            *(limiter.hit(policy(), f"ip:{i}") for i in range(20)), return_exceptions=True), 30)
        assert all(isinstance(o, rl.BackendError) and "Timeout" in str(o) for o in outcomes)
    finally:
        released.set()
        server.close()
        await backend.aclose()
