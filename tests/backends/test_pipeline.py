"""The pipelined async connection: exactly redis-py's answers, fewer steps."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
import redis.asyncio
from backends.loops import event_loops, io_callback, run_on
from redis.exceptions import ConnectionError as RedisConnectionError

import ratelimit_mw as rl
from ratelimit_mw.backends.protocol import RedisProtocol
from ratelimit_mw.core import scripts
from tests.conftest import REDIS_URL, other_db_url

REDIS = REDIS_URL


def policy(algorithm: str = "gcra") -> rl.Policy:
    return rl.Policy("10/minute;50/hour", algorithm=algorithm, name=uuid.uuid4().hex[:10])


@pytest.mark.parametrize(
    ("client", "transport"),
    [
        (lambda: redis.asyncio.Redis(), ("localhost", 6379, None, False)),
        (lambda: redis.asyncio.Redis.from_url("redis://127.0.0.1:6379/1"),
         ("127.0.0.1", 6379, None, False)),
        (lambda: redis.asyncio.Redis(protocol=3), ("localhost", 6379, None, False)),
        (lambda: redis.asyncio.Redis(ssl=True, port=6380), ("localhost", 6380, None, True)),
        (lambda: redis.asyncio.Redis(unix_socket_path="/tmp/nothing.sock"),
         ("localhost", 6379, "/tmp/nothing.sock", False)),
    ],
    ids=["plain", "url-with-db", "resp3", "tls", "unix-socket"],
)
def test_every_client_takes_the_one_connection_design_with_its_transport(
    client: Callable[[], Any], transport: tuple[str, int, str | None, bool],
) -> None:
    settings = rl.AsyncRedisBackend(client())._pipe.settings
    assert (settings.host, settings.port, settings.path, settings.tls is not None) == transport


def test_the_tls_context_is_redis_pys_own_with_the_clients_ssl_options() -> None:
    import ssl

    client = redis.asyncio.Redis(ssl=True, ssl_cert_reqs="none")
    settings = rl.AsyncRedisBackend(client)._pipe.settings
    assert settings.tls.verify_mode == ssl.CERT_NONE and not settings.tls.check_hostname
    required = rl.AsyncRedisBackend(redis.asyncio.Redis(ssl=True))._pipe.settings.tls
    assert required.verify_mode == ssl.CERT_REQUIRED and required.check_hostname


def test_a_tls_cluster_mirrors_its_tls_on_every_node() -> None:
    client = redis.asyncio.RedisCluster(host="127.0.0.1", port=7000, ssl=True,
                                        ssl_cert_reqs="none")
    cluster = rl.AsyncRedisBackend(client)._pipe
    node = cluster.connection(("127.0.0.1", 7001)).settings
    assert node.tls is cluster.settings.tls is not None and (node.host, node.port) == (
        "127.0.0.1", 7001)


def test_a_connection_class_it_cannot_mirror_is_refused_with_what_to_write() -> None:
    class Custom(redis.asyncio.connection.AbstractConnection):
        pass

    client = redis.asyncio.Redis(connection_pool=redis.asyncio.ConnectionPool(
        connection_class=Custom))
    with pytest.raises(rl.ConfigurationError, match="SSLConnection or UnixDomainSocket"):
        rl.AsyncRedisBackend(client)


async def test_a_resp3_client_gets_the_same_answers_as_the_sync_backend(prefix: str) -> None:
    piped = rl.AsyncRedisBackend(redis.asyncio.Redis.from_url(REDIS, protocol=3))
    sync = rl.RedisBackend(redis.Redis.from_url(REDIS))
    for algorithm in rl.ALGORITHMS:
        shared = policy(algorithm)
        a = rl.AsyncLimiter(piped, prefix=prefix + "a", deny_cache=0)
        b = rl.Limiter(sync, prefix=prefix + "b", deny_cache=0)
        for _ in range(12):
            x, y = await a.hit(shared, "ip:1"), b.hit(shared, "ip:1")
            assert (x.allowed, x.remaining, x.limit) == (y.allowed, y.remaining, y.limit)
    await piped.aclose()
    sync.close()


async def test_concurrent_calls_pipeline_on_one_connection_and_admit_exactly_the_limit(
    prefix: str,
) -> None:
    backend = rl.AsyncRedisBackend(redis.asyncio.Redis.from_url(REDIS))
    limiter = rl.AsyncLimiter(backend, prefix=prefix, deny_cache=0)
    shared = policy("sliding-log")
    decisions = await asyncio.gather(*(limiter.hit(shared, "ip:1") for _ in range(200)))
    assert sum(d.allowed for d in decisions) == 10
    await backend.aclose()


async def test_a_flushed_script_cache_is_reloaded(prefix: str, redis_client: redis.Redis) -> None:
    backend = rl.AsyncRedisBackend(redis.asyncio.Redis.from_url(REDIS))
    limiter = rl.AsyncLimiter(backend, prefix=prefix, deny_cache=0)
    shared = policy()
    assert (await limiter.hit(shared, "ip:1")).remaining == 9
    redis_client.script_flush()
    assert (await limiter.hit(shared, "ip:1")).remaining == 8
    await backend.aclose()


async def test_a_cancelled_call_leaves_the_replies_in_order(prefix: str) -> None:
    backend = rl.AsyncRedisBackend(redis.asyncio.Redis.from_url(REDIS))
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
    backend = rl.AsyncRedisBackend(redis.asyncio.Redis.from_url(REDIS))
    limiter = rl.AsyncLimiter(backend, prefix=prefix, deny_cache=0)
    shared = policy()
    first = asyncio.run(limiter.hit(shared, "ip:1"))
    second = asyncio.run(limiter.hit(shared, "ip:1"))  # a new loop: no "attached to a
    assert (first.remaining, second.remaining) == (9, 8)  # different loop" error


async def test_the_database_from_the_url_is_selected(prefix: str) -> None:
    backend = rl.AsyncRedisBackend.from_url(other_db_url())
    limiter = rl.AsyncLimiter(backend, prefix=prefix, deny_cache=0)
    await limiter.hit(policy(), "ip:1")
    in_other = redis.Redis.from_url(other_db_url())
    in_ours = redis.Redis.from_url(REDIS)
    try:
        written = list(in_other.scan_iter(match=f"{prefix}:*"))
        assert written
        assert not list(in_ours.scan_iter(match=f"{prefix}:*"))
        in_other.delete(*written)  # the run's sweep covers its own database only
    finally:
        in_other.close()
        in_ours.close()
        await backend.aclose()


async def test_a_rejected_password_is_a_backend_error() -> None:
    parts = urlsplit(REDIS)
    backend = rl.AsyncRedisBackend.from_url(urlunsplit(parts._replace(
        netloc=f":wrong@{parts.hostname}:{parts.port or 6379}")))
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
        assert backend._pipe.protocol.lost is not None
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
        assert backend._pipe.protocol is None
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
    backend = rl.AsyncRedisBackend(redis.asyncio.Redis.from_url(REDIS))
    limiter = rl.AsyncLimiter(backend, prefix=prefix, deny_cache=0)
    shared = policy("fixed-window")
    await limiter.hit(shared, "ip:warm")  # connected, script loaded
    transport = backend._pipe.protocol.transport
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


# --- One look before failing: a stall of the client's own loop is not a server's timeout ------

PING = b"*1\r\n$4\r\nPING\r\n"


async def send_then_stall(send: Callable[[], asyncio.Future[Any]],
                          seconds: float) -> Any:
    """Send from inside an I/O callback that then holds the loop for `seconds` (a long batch
    of incoming requests, a GC pause): the reply arrives while the loop is busy."""
    sent: asyncio.Future[asyncio.Future[Any]] = asyncio.get_running_loop().create_future()

    def send_and_stall() -> None:
        sent.set_result(send())
        time.sleep(seconds)

    with io_callback(send_and_stall) as make_readable:
        make_readable()
        return await (await sent)  # the reply, or what failed the call


@pytest.mark.parametrize("new_loop", event_loops())
def test_a_reply_that_came_while_the_loop_was_stalled_past_the_give_up_is_read(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    """The middleware's deadline (the give-up timer) passes during the stall; the reply is
    in the socket by then, so the call has it instead of failing open (under uvloop the
    timer runs before the poll that would read it)."""
    async def main() -> tuple[Any, bool]:
        backend = rl.AsyncRedisBackend.from_url(REDIS, socket_timeout=10, socket_connect_timeout=2)
        try:
            await backend.aping()  # connected
            loop = asyncio.get_running_loop()
            reply = await send_then_stall(
                lambda: backend._pipe.ready().send(PING, give_up=loop.time() + 0.05), 0.15)
            return reply, backend._pipe.ready() is not None
        finally:
            await backend.aclose()

    assert run_on(new_loop, main) == (b"PONG", True)


@pytest.mark.parametrize("new_loop", event_loops())
def test_a_reply_that_came_while_the_loop_was_stalled_past_the_socket_timeout_is_read(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    """The same for the connection's own deadline (`socket_timeout`): the connection is
    kept, not dropped as if Redis had hung."""
    async def main() -> tuple[Any, bool]:
        backend = rl.AsyncRedisBackend.from_url(REDIS, socket_timeout=0.05,
                                                socket_connect_timeout=2)
        try:
            await backend.aping()
            protocol = backend._pipe.ready()
            reply = await send_then_stall(lambda: protocol.send(PING), 0.15)
            return reply, protocol.lost is None
        finally:
            await backend.aclose()

    assert run_on(new_loop, main) == (b"PONG", True)


@pytest.mark.parametrize("new_loop", event_loops())
def test_a_call_written_after_its_deadline_by_a_busy_loop_has_its_answer(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    """A call sent while another is in flight leaves with the next iteration's batch. Here
    the loop is busy past the call's deadline before that write, and again right after it:
    the answer comes during the second stall, after the loop's last poll, so only the
    timer's one look reads it. That is asyncio's order; under uvloop the first answer is
    read before `send_late` runs, so the call leaves at once and this only checks that it
    has its answer (the `*_stalled_*` tests above are uvloop's)."""
    async def main() -> list[Any]:
        backend = rl.AsyncRedisBackend.from_url(REDIS, socket_timeout=10, socket_connect_timeout=2)
        try:
            await backend.aping()
            loop = asyncio.get_running_loop()
            first = backend._pipe.ready().send(PING, give_up=loop.time() + 10)  # written at once
            sent: list[asyncio.Future[Any]] = []

            def send_late() -> None:
                sent.append(backend._pipe.ready().send(PING, give_up=loop.time() + 0.02))
                loop.call_soon(time.sleep, 0.05)  # busy again right after the batch's write
                time.sleep(0.03)  # busy past its deadline before that write

            loop.call_soon(send_late)
            time.sleep(0.005)  # the first answer is in when send_late runs, not yet read
            return [await first, *(await asyncio.gather(*sent, return_exceptions=True))]
        finally:
            await backend.aclose()

    assert run_on(new_loop, main) == [b"PONG", b"PONG"]


def trickling_server(replies: int) -> tuple[int, threading.Thread]:
    """A server that sends `replies` answers one per millisecond whatever it is asked, then
    nothing: the calls after them are never answered while bytes keep arriving."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()
            # The client hangs up once it has what it waits for, mid-trickle.
            with conn, contextlib.suppress(OSError):
                conn.settimeout(10)
                conn.recv(1 << 16)  # the first call: the others are queued by then
                for _ in range(replies):
                    conn.sendall(b"+OK\r\n")
                    time.sleep(0.001)
                while conn.recv(1 << 16):
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener.getsockname()[1], thread


@pytest.mark.parametrize("new_loop", event_loops())
def test_replies_still_arriving_for_others_buy_an_overdue_call_one_look_only(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    """A call queued behind 300 others on a server answering one per millisecond gives up on
    its own deadline (after its one look), long before the queue ahead of it has drained:
    replies still coming for others do not keep it waiting."""
    queued = 300
    port, server = trickling_server(queued)

    async def main() -> tuple[BaseException | None, int]:
        loop = asyncio.get_running_loop()
        _, protocol = await loop.create_connection(
            lambda: RedisProtocol(loop, None), "127.0.0.1", port)
        ahead = [protocol.send(PING) for _ in range(queued)]
        late = protocol.send(PING, give_up=loop.time() + 0.05)
        await asyncio.wait([late], timeout=30)  # the fence only turns a hang into a failure
        answered = sum(call.done() for call in ahead)
        protocol.close(RedisConnectionError("test over"))
        await asyncio.gather(*ahead, return_exceptions=True)
        return (late.exception() if late.done() else None), answered

    failure, answered = run_on(new_loop, main)
    server.join(10)
    assert isinstance(failure, asyncio.TimeoutError)
    assert answered < queued
