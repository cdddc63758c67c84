"""A pipelined Redis connection for the async hot path.

redis.asyncio spends more CPU per awaited call than the rate limit check itself: a pool
checkout and return with their hooks, a Python command packer, and an ``asyncio.wait_for``
(a new Task) around every write. For one EVALSHA per request the physical floor is lower:
one TCP connection per event loop, each call written at once (calls from concurrent requests
pipeline on the wire, which Redis answers in order), replies parsed by hiredis in C and
handed to the waiting futures in the same order.

It is used only where it is exactly equivalent: a plain TCP ``redis.asyncio.Redis`` (RESP2,
no TLS, no credential provider) with hiredis installed. The client's host, port, database,
username, password, name and timeouts apply. Anything else goes through redis-py.

Failure behaviour, which the middleware's failure policy builds on:
- a call waits at most the client's ``socket_timeout``; a timed-out call drops the
  connection (a hung Redis should not collect a queue), and the next call reconnects;
- a connection error reconnects and retries once (as the safe ``from_url`` defaults do),
  so a Redis restart costs at most the calls in flight at that moment;
- a cancelled call (the middleware's own deadline) leaves the connection in order: its reply
  is still read, and dropped.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import hiredis
from redis.asyncio.connection import Connection as _PlainConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ratelimit_mw._scripts import SHA1, SOURCE

_EVALSHA = b"EVALSHA"


def eligible(client: Any) -> bool:
    """Whether `client` is a plain TCP RESP2 redis.asyncio client this connection can mirror."""
    pool = getattr(client, "connection_pool", None)
    if pool is None or getattr(pool, "connection_class", None) is not _PlainConnection:
        return False
    kwargs = pool.connection_kwargs
    return kwargs.get("credential_provider") is None and kwargs.get("protocol") in (None, 2, "2")


class _Protocol(asyncio.Protocol):
    """Replies in, futures out, in order."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.reader = hiredis.Reader()
        self.waiters: collections.deque[asyncio.Future[Any]] = collections.deque()
        self.lost: BaseException | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        waiters = self.waiters
        while True:
            reply = self.reader.gets()
            if reply is False:
                return
            if not waiters:  # a reply nobody asked for: the stream cannot be trusted
                self.close(RedisConnectionError("unexpected reply from Redis"))
                return
            waiter = waiters.popleft()
            if not waiter.done():  # a cancelled or timed-out call's reply is dropped
                waiter.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = RedisConnectionError(f"connection to Redis lost: {exc or 'closed'}")
        self._fail_all(self.lost)

    def close(self, reason: BaseException) -> None:
        self.lost = reason
        if self.transport is not None:
            self.transport.close()
        self._fail_all(reason)

    def _fail_all(self, reason: BaseException) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_exception(reason)

    def send(self, packed: bytes, loop: asyncio.AbstractEventLoop) -> asyncio.Future[Any]:
        if self.lost is not None or self.transport is None:
            raise self.lost or RedisConnectionError("not connected to Redis")
        waiter = loop.create_future()
        self.waiters.append(waiter)
        self.transport.write(packed)
        return waiter


def _expire(waiter: asyncio.Future[Any]) -> None:
    if not waiter.done():
        waiter.set_exception(RedisTimeoutError("Timeout reading from Redis"))


class PipelinedConnection:
    """One pipelined connection per event loop, built from a redis.asyncio client's settings."""

    def __init__(self, client: Any) -> None:
        kwargs = client.connection_pool.connection_kwargs
        self._host: str = kwargs.get("host", "localhost")
        self._port: int = int(kwargs.get("port", 6379))
        self._db: int = int(kwargs.get("db", 0) or 0)
        self._username: str | None = kwargs.get("username")
        self._password: str | None = kwargs.get("password")
        self._name: str | None = kwargs.get("client_name")
        self._timeout: float | None = kwargs.get("socket_timeout")
        self._connect_timeout: float | None = kwargs.get("socket_connect_timeout") or self._timeout
        self._protocol: _Protocol | None = None
        # The event loop the connection belongs to, and the lock that serialises connecting.
        self._bound: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None

    async def evalsha(self, keys: list[str], args: list[Any]) -> Any:
        """Run the script; NOSCRIPT loads it and runs it again."""
        packed = hiredis.pack_command((_EVALSHA, SHA1, len(keys), *keys, *args))
        reply = await self._call(packed)
        if isinstance(reply, hiredis.ReplyError):
            if str(reply).startswith("NOSCRIPT"):
                loaded = await self._call(hiredis.pack_command(("SCRIPT", "LOAD", SOURCE)))  # type: ignore[arg-type]
                if isinstance(loaded, hiredis.ReplyError):
                    raise ResponseError(str(loaded))
                reply = await self._call(packed)
            if isinstance(reply, hiredis.ReplyError):
                message = str(reply)
                if message.startswith("NOSCRIPT"):
                    raise NoScriptError(message)
                raise ResponseError(message)
        return reply

    async def _call(self, packed: bytes) -> Any:
        try:
            return await self._once(packed)
        except (RedisConnectionError, OSError):
            # One immediate retry on a dropped connection: a restarted Redis is reachable
            # again at once, and the first call after it should not fail.
            return await self._once(packed)

    async def _once(self, packed: bytes) -> Any:
        loop = asyncio.get_running_loop()
        protocol = self._protocol
        bound = self._bound
        if protocol is None or protocol.lost is not None or bound is None or bound[0] is not loop:
            protocol = await self._connect(loop)
        waiter = protocol.send(packed, loop)
        if self._timeout is None:
            return await waiter
        timer = loop.call_later(self._timeout, _expire, waiter)
        try:
            return await waiter
        except RedisTimeoutError:
            # Whatever is queued behind a timed-out call waits on a Redis that is not
            # answering: start afresh.
            protocol.close(RedisTimeoutError("Timeout reading from Redis"))
            raise
        finally:
            timer.cancel()

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> _Protocol:
        bound = self._bound
        if bound is None or bound[0] is not loop:
            # A client belongs to one event loop; a new loop (a test runner's, a worker's)
            # gets its own connection instead of failing.
            self._drop()
            bound = self._bound = (loop, asyncio.Lock())
        async with bound[1]:
            current = self._protocol
            if current is not None and current.lost is None:
                return current  # another call connected while this one waited
            try:
                _, protocol = await asyncio.wait_for(
                    loop.create_connection(_Protocol, self._host, self._port),
                    self._connect_timeout,
                )
                await self._handshake(protocol, loop)
            except asyncio.TimeoutError as exc:
                raise RedisTimeoutError(f"Timeout connecting to {self._host}:{self._port}") from exc
            except OSError as exc:
                raise RedisConnectionError(
                    f"Error connecting to {self._host}:{self._port}: {exc}"
                ) from exc
            self._protocol = protocol
            return protocol

    async def _handshake(self, protocol: _Protocol, loop: asyncio.AbstractEventLoop) -> None:
        commands: list[tuple[Any, ...]] = []
        if self._password is not None:
            if self._username:
                commands.append(("AUTH", self._username, self._password))
            else:
                commands.append(("AUTH", self._password))
        if self._db:
            commands.append(("SELECT", self._db))
        if self._name:
            commands.append(("CLIENT", "SETNAME", self._name))
        for command in commands:
            reply = await asyncio.wait_for(
                protocol.send(hiredis.pack_command(command), loop), self._connect_timeout
            )
            if isinstance(reply, hiredis.ReplyError):
                protocol.close(RedisConnectionError(str(reply)))
                raise RedisConnectionError(f"{command[0]} failed: {reply}")

    def _drop(self) -> None:
        protocol, self._protocol = self._protocol, None
        if protocol is None:
            return
        if self._bound is not None and self._bound[0].is_closed():
            # Its loop is gone (asyncio.run returned): the transport can no longer be closed
            # through it, and nothing can be waiting on it any more.
            return
        protocol.close(RedisConnectionError("connection closed"))

    async def aclose(self) -> None:
        self._drop()
