"""The one async connection design: pipelined, one per event loop and Redis node.

Every async Redis call goes through it, whatever the transport: TCP, TLS, a unix socket,
the primary that Redis Sentinel names, and each node of a cluster (cluster.py).

Why not redis.asyncio: its pool checkout, Python packer and ``wait_for`` per call cost more
CPU than the check itself. Here each call is written at once on the one connection
(concurrent calls pipeline on the wire, which Redis answers in order), and hiredis parses
the replies in C for the waiting futures, in order. No pool means no pool ceiling (a burst
of any size is one queue on one socket, never MaxConnectionsError), and one TLS handshake
per connection, not one per concurrent call of a burst.

The connection mirrors the client it is given (settings.py); the wire, its batching and its
timers are the protocol's (protocol.py). Under Sentinel every connect asks the sentinels for
the primary, and a READONLY reply (the server was demoted under us) drops the connection, so
the one retry asks them again.

Failure behaviour, which the middleware's failure policy builds on:
- a call with a deadline that finds no open connection waits for one at most a few of its
  deadlines (``CONNECT_DEADLINES``), whatever the client's connect timeout;
- a call waits at most the client's ``socket_timeout``; a timed-out call drops the
  connection (a hung Redis should not collect a queue), and the next call reconnects;
- a connection error reconnects and retries once (as the safe ``from_url`` defaults do),
  so a Redis restart costs at most the calls in flight at that moment;
- a cancelled call (the middleware's own deadline) leaves the connection in order: its reply
  is still read, and dropped.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import hiredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ratelimit_mw.backends import sentinel as _sentinel
from ratelimit_mw.backends.base import bounded
from ratelimit_mw.backends.protocol import RedisProtocol
from ratelimit_mw.backends.settings import Settings
from ratelimit_mw.core import scripts

_EVALSHA = b"EVALSHA"


@functools.cache
def script_load() -> bytes:
    """SCRIPT LOAD of the joined script, packed once at first use (the Lua is read lazily)."""
    return hiredis.pack_command(("SCRIPT", "LOAD", scripts.source()))  # type: ignore[no-any-return,arg-type]


ASKING = hiredis.pack_command(("ASKING",))


def pack_evalsha(keys: list[str], args: list[Any]) -> bytes:
    return hiredis.pack_command((_EVALSHA, scripts.sha1(), len(keys), *keys, *args))  # type: ignore[no-any-return]


def raise_for_error(reply: Any) -> Any:
    """The reply, or the redis-py exception an error reply stands for."""
    if isinstance(reply, hiredis.ReplyError):
        message = str(reply)
        if message.startswith("NOSCRIPT"):
            raise NoScriptError(message)
        raise ResponseError(message)
    return reply


# How long an announced primary is where connects go before the sentinels are asked again
# (they all name it within a second or two of the announcement).
ANNOUNCED_FOR = 10.0

# How many of its deadlines a call that finds no open connection waits for one: a cold
# worker meeting a burst makes the set-up's loop turns long, which is not Redis answering
# late; a hung Redis still costs a few deadlines, never the client's connect timeout.
CONNECT_DEADLINES = 3
# The loop turns a set-up takes (TCP connect, TLS, the handshake), with margin: a connect is
# blamed on the server only once the loop has turned that often past its deadline, so a
# cold worker on a busy loop waits for a healthy server.
SETUP_TURNS = 12


def consume(task: asyncio.Task[Any]) -> None:
    """Retrieve a shared task's outcome, so that a failure nobody awaited is not logged."""
    if not task.cancelled():
        task.exception()


class PipelinedConnection:
    """One pipelined connection per event loop to one Redis node."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # The open connection, once there is one: a caller on its loop whose `ready()` it is
        # may send on it at once (AsyncRedisBackend.arun does).
        self.protocol: RedisProtocol | None = None
        # The event loop the connection belongs to, and the task connecting it (shared).
        self._bound: tuple[asyncio.AbstractEventLoop,
                           asyncio.Task[RedisProtocol] | None] | None = None
        self._script_loading: asyncio.Task[Any] | None = None
        # Under Sentinel: a listener per sentinel on the bound loop, and the primary the last
        # announcement named, where the next connect goes (the sentinels asked instead may
        # not all know of the switch yet).
        self._listeners: list[asyncio.Task[None]] = []
        self._announced: tuple[str, int] | None = None
        self._announced_until = 0.0  # loop time: then the sentinels are asked again
        self._dialled = settings.where()  # the address of the last connect, for messages

    @classmethod
    def for_client(cls, client: Any) -> PipelinedConnection:
        """Mirroring a redis.asyncio.Redis: its pool's connection class and kwargs."""
        pool = client.connection_pool
        return cls(Settings.from_kwargs({**pool.connection_kwargs,
                                         "connection_class": pool.connection_class}))

    async def evalsha(self, keys: list[str], args: list[Any]) -> Any:
        """Run the script; NOSCRIPT loads it and runs it again."""
        return raise_for_error(await self.run_script(pack_evalsha(keys, args)))

    async def run_script(self, packed: bytes, skipped: int = 0) -> Any:
        """Send a packed EVALSHA (after `skipped` unread commands such as ASKING); NOSCRIPT
        loads the script and sends it again. An error reply is returned, not raised: a
        cluster reads MOVED and ASK from it."""
        reply = await self._call(packed, skipped)
        if self.recovers(reply):
            if str(reply).startswith("NOSCRIPT"):
                await self._load_script()
            reply = await self._call(packed, skipped)
        return reply

    def recovers(self, reply: Any) -> bool:
        """Whether `reply` is an error that sending the call again mends: NOSCRIPT (after
        loading the script), or READONLY under Sentinel: the server was demoted under us,
        so the connection is dropped here (calls in flight on it fail and are retried) and
        the next connect asks the sentinels where the primary is now."""
        if not isinstance(reply, hiredis.ReplyError):
            return False
        message = str(reply)
        if message.startswith("NOSCRIPT"):
            return True
        if not message.startswith("READONLY") or self.settings.locate is None:
            return False
        protocol = self.protocol
        if protocol is not None and protocol.lost is None:
            protocol.close(RedisConnectionError("the primary was demoted to a replica"))
        return True

    async def _load_script(self) -> None:
        """SCRIPT LOAD, once for all the calls that met NOSCRIPT together (a restarted or
        flushed server answers a whole burst so); shielded: a cancelled caller leaves it
        running for the others."""
        loop = asyncio.get_running_loop()
        loading = self._script_loading
        if loading is None or loading.done() or loading.get_loop() is not loop:
            loading = self._script_loading = loop.create_task(self._call(script_load()))
            loading.add_done_callback(consume)
        raise_for_error(await asyncio.shield(loading))

    async def command(self, *args: Any) -> Any:
        """Any other command (PING, INFO, CLUSTER SLOTS...); an error reply raises."""
        return raise_for_error(await self._call(hiredis.pack_command(args)))

    async def _call(self, packed: bytes, skipped: int = 0) -> Any:
        try:
            return await self._once(packed, skipped)
        except (RedisConnectionError, OSError):
            # One immediate retry on a dropped connection: a restarted Redis is reachable
            # again at once, and the first call after it should not fail.
            return await self._once(packed, skipped)

    def ready(self) -> RedisProtocol | None:
        """The connection's protocol if it is open on the running loop, else None (a call
        would connect first: see `_once`)."""
        protocol = self.protocol
        return protocol if protocol is not None and protocol.ready() else None

    async def evalsha_within(self, keys: list[str], args: list[Any], seconds: float) -> Any:
        """`evalsha`, failing with TimeoutError after `seconds`: on an open connection by the
        protocol's give-up timer, otherwise (a reconnect, an error that `recovers`) by a
        deadline around the whole call for the time that is left. With no open connection
        (a cold worker) the call first waits for one (`_opened_within`), and its time starts
        once it is open."""
        loop = asyncio.get_running_loop()
        protocol = self.ready()
        if protocol is None and self.protocol is None:
            protocol = await self._opened_within(loop, seconds * CONNECT_DEADLINES)
        give_up = loop.time() + seconds
        if protocol is not None:
            packed = pack_evalsha(keys, args)
            try:
                reply = await protocol.send(packed, give_up=give_up)
            except TimeoutError:
                raise  # given up (an OSError too, but never to be sent again)
            except (RedisConnectionError, OSError):
                reply = None  # dropped meanwhile: the plain path below reconnects and retries
            if reply is not None and not self.recovers(reply):
                return raise_for_error(reply)
        left = give_up - loop.time()
        if left <= 0:
            raise asyncio.TimeoutError()
        return await bounded(self.evalsha(keys, args), left)

    async def _opened_within(self, loop: asyncio.AbstractEventLoop,
                             seconds: float) -> RedisProtocol:
        """The connection, opened by this call or one before it, within `seconds` as well as
        the connect timeout (the opening's own, which a client may leave at redis-py's 5 s):
        past them, a timeout that names the server. The opening goes on for the calls
        after it."""
        try:
            return await bounded(self._connect(loop), seconds, SETUP_TURNS)
        except asyncio.TimeoutError as exc:  # `_open` turns its own timeout into Redis's
            raise RedisTimeoutError(f"Timeout connecting to {self._dialled}") from exc

    async def _once(self, packed: bytes, skipped: int) -> Any:
        protocol = self.protocol
        if protocol is None or not protocol.ready():
            protocol = await self._connect(asyncio.get_running_loop())
        # The protocol's deadline timer bounds the wait (see RedisProtocol).
        return await protocol.send(packed, skipped)

    async def _connect(self, loop: asyncio.AbstractEventLoop,
                       rejoin: bool = True) -> RedisProtocol:
        """The connection, opened by one task that every caller meanwhile awaits, so a
        burst wakes at once when it is done (a lock would wake one waiter per iteration);
        shielded: a cancelled caller leaves the connect running for the others.

        A caller that joined an opening begun before it, which then timed out, dials once
        more itself: that opening met the server as it was then (frozen, failing over), and
        the first call after it answers again should not fail on its behalf."""
        bound = self._bound
        if bound is None or bound[0] is not loop:
            # A client belongs to one event loop; a new loop (a test runner's, a worker's)
            # gets its own connection instead of failing.
            self.close()
            bound = None
        task = None if bound is None else bound[1]
        joined = task is not None and not task.done()
        if task is None or not joined:
            task = loop.create_task(self._open(loop))
            task.add_done_callback(consume)
            self._bound = (loop, task)
            if not self._listeners and self.settings.sentinels:
                self._listeners = [
                    loop.create_task(_sentinel.listen(sentinel, self.settings.service,
                                                      self._switched))
                    for sentinel in self.settings.sentinels]
        try:
            return await asyncio.shield(task)
        except RedisTimeoutError:
            if not (joined and rejoin):
                raise
        return await self._connect(loop, rejoin=False)

    def _switched(self, host: str, port: int) -> None:
        """A sentinel announced a new primary: the next connect goes there, and the
        connection to another server is dropped now (its calls in flight fail and are
        retried once), not when that server is demoted seconds later: every count written
        to it meanwhile would be lost with it."""
        self._announced = (host, port)
        if self._bound is not None:
            self._announced_until = self._bound[0].time() + ANNOUNCED_FOR
        protocol = self.protocol
        if protocol is not None and protocol.lost is None and protocol.address != (host, port):
            protocol.close(RedisConnectionError(
                f"Sentinel announced a new primary at {host}:{port}"))

    async def _open(self, loop: asyncio.AbstractEventLoop) -> RedisProtocol:
        """Connect (TCP, TLS or unix; to the primary the sentinels name now, under
        Sentinel) and set the connection up within the connect timeout. Asking the
        sentinels comes first, outside it: each sentinel connection has the client's own
        timeouts, so a hung sentinel listed first leaves the others time to answer."""
        settings = self.settings
        address = None if settings.path is not None else await self._address(loop)
        self._dialled = settings.where() if address is None else f"{address[0]}:{address[1]}"
        try:
            # `bounded`: a loop busy past the connect timeout does not make a healthy server
            # look unreachable.
            protocol = await bounded(self._establish(loop, address), settings.connect_timeout,
                                     SETUP_TURNS)
        except asyncio.TimeoutError as exc:
            raise RedisTimeoutError(f"Timeout connecting to {self._dialled}") from exc
        except OSError as exc:
            raise RedisConnectionError(
                f"Error connecting to {self._dialled}: {exc}") from exc
        self.protocol = protocol
        return protocol

    async def _address(self, loop: asyncio.AbstractEventLoop) -> tuple[str, int]:
        """Where a TCP or TLS connect goes: the primary a sentinel announced lately, the
        one the sentinels name, or the configured address."""
        settings = self.settings
        announced = self._announced
        if announced is not None and loop.time() >= self._announced_until:
            announced = self._announced = None  # long past: the sentinels know by now
        if announced is not None:
            return announced
        if settings.locate is not None:
            # A connect timeout per sentinel, all told (bounds a client built without any);
            # `bounded`: a stalled loop is not the sentinels answering late.
            bound = (None if settings.connect_timeout is None
                     else settings.connect_timeout * max(1, len(settings.sentinels)))
            try:
                return await bounded(settings.locate(), bound, SETUP_TURNS)
            except asyncio.TimeoutError as exc:
                raise RedisTimeoutError(
                    f"Timeout asking the sentinels for {settings.service!r}") from exc
        return settings.host, settings.port

    async def _establish(self, loop: asyncio.AbstractEventLoop,
                         address: tuple[str, int] | None) -> RedisProtocol:
        settings = self.settings
        timeout = settings.timeout
        if address is None:
            _, protocol = await loop.create_unix_connection(
                lambda: RedisProtocol(loop, timeout), settings.path)
        else:
            _, protocol = await loop.create_connection(
                lambda: RedisProtocol(loop, timeout), *address, ssl=settings.tls)
            protocol.address = address
        try:
            await self._handshake(protocol)
        except BaseException:
            # Timed out, refused or cancelled half-way: never keep it half set up.
            protocol.close(RedisConnectionError("connection set-up failed"))
            raise
        announced = self._announced
        if announced is not None:
            if announced != protocol.address:
                # A switch was announced while this connection was being made: the retry
                # that this error starts goes to the announced primary.
                protocol.close(RedisConnectionError("Sentinel announced a new primary"))
                raise RedisConnectionError(
                    f"Sentinel announced a new primary at {announced[0]}:{announced[1]} "
                    "while connecting")
            self._announced = None  # reached: later connects ask the sentinels again
        return protocol

    async def _handshake(self, protocol: RedisProtocol) -> None:
        """AUTH, SELECT, CLIENT SETNAME as configured, and SCRIPT LOAD, in one round trip.

        Loading the script on every connect saves the NOSCRIPT round trip on a cold start or
        after a restart, when a burst's first calls are closest to the middleware's deadline.
        """
        settings = self.settings
        commands: list[tuple[Any, ...]] = []
        username, password = settings.username, settings.password
        if settings.credentials is not None:
            *user, password = await settings.credentials.get_credentials_async()
            username = user[0] if user else None
        if password is not None:
            commands.append(("AUTH", username, password) if username else ("AUTH", password))
        if settings.db:
            commands.append(("SELECT", settings.db))
        if settings.client_name:
            commands.append(("CLIENT", "SETNAME", settings.client_name))
        waiters = [protocol.send(hiredis.pack_command(command)) for command in commands]
        waiters.append(protocol.send(script_load()))
        replies = await asyncio.gather(*waiters)
        for name, reply in zip([c[0] for c in commands] + ["SCRIPT LOAD"], replies,
                               strict=True):
            if isinstance(reply, hiredis.ReplyError):
                protocol.close(RedisConnectionError(str(reply)))
                raise RedisConnectionError(f"{name} failed: {reply}")

    def close(self) -> None:
        listeners, self._listeners = self._listeners, []
        protocol, self.protocol = self.protocol, None
        if self._bound is not None and self._bound[0].is_closed():
            # Its loop is gone (asyncio.run returned): its transport and tasks can no longer
            # be closed through it, and nothing can be waiting on them any more.
            return
        for listener in listeners:
            listener.cancel()
        if protocol is not None:
            protocol.close(RedisConnectionError("connection closed"))

    async def aclose(self) -> None:
        bound = self._bound
        # Listeners can be awaited on their own loop only (another may have closed).
        listeners = self._listeners if bound is not None and (
            bound[0] is asyncio.get_running_loop()) else []
        self.close()
        await asyncio.gather(*listeners, return_exceptions=True)
