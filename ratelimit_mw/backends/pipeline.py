"""The one async connection design: pipelined, one per event loop and Redis node.

Every async Redis call goes through it, whatever the transport: TCP, TLS, a unix socket,
the primary that Redis Sentinel names, and each node of a cluster (cluster.py).

Why not redis.asyncio: its pool checkout, Python packer and ``wait_for`` per call cost more
CPU than the check itself. Here each call is written at once on the one connection
(concurrent calls pipeline on the wire, which Redis answers in order), and hiredis parses
the replies in C for the waiting futures, in order. No pool means no pool ceiling (a burst
of any size is one queue on one socket, never MaxConnectionsError), and one TLS handshake
per connection, not one per concurrent call of a burst.

The connection mirrors the redis-py client it is given (``Settings.from_kwargs``): its
connection class says the transport (TLS through redis-py's own SSL context), and its host,
port, unix path, database, username and password or credential provider, client name and
timeouts apply. It always speaks RESP2: the replies are the script's integers either way.
Under Sentinel every connect asks the sentinels for the primary, and a READONLY reply (the
server was demoted under us) drops the connection, so the one retry asks them again.

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
import collections
import functools
import heapq
import itertools
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import hiredis
from redis.asyncio.connection import Connection as _PlainConnection
from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection
from redis.asyncio.sentinel import SentinelManagedConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ratelimit_mw.backends import sentinel as _sentinel
from ratelimit_mw.backends.base import Later, bounded, look
from ratelimit_mw.core import scripts
from ratelimit_mw.core.errors import ConfigurationError

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


@dataclass(frozen=True)
class Settings:
    """Where and how to connect: one node's address, its transport, and the client's
    credentials and timeouts."""

    host: str = "localhost"
    port: int = 6379
    path: str | None = None  # a unix socket, instead of host and port
    tls: ssl.SSLContext | None = None
    # Sentinel: asks the sentinels for the primary's address on every connect; the
    # sentinels (redis.asyncio clients) whose announcements of `service` it follows.
    locate: Callable[[], Awaitable[tuple[str, int]]] | None = None
    sentinels: tuple[Any, ...] = ()
    service: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None
    credentials: Any = None  # a redis-py CredentialProvider, asked on every connect
    client_name: str | None = None
    timeout: float | None = None
    connect_timeout: float | None = None

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any], **where: Any) -> Settings:
        """From a redis-py connection class and its kwargs (`where` gives a cluster node's
        host and port): the class says the transport, the kwargs the rest. TLS uses
        redis-py's own SSL context from the ``ssl_*`` options, so they mean what they mean
        there."""
        kwargs = {**kwargs, **where}
        connection_class = kwargs.get("connection_class", _PlainConnection)
        tls = path = locate = None
        sentinels: tuple[Any, ...] = ()
        service = ""
        if issubclass(connection_class, UnixDomainSocketConnection):
            path = kwargs.get("path") or ""
        elif issubclass(connection_class, SSLConnection):
            options = {k: v for k, v in kwargs.items() if k.startswith("ssl_")}
            tls = SSLConnection(**options).ssl_context.get()
        elif not issubclass(connection_class, _PlainConnection):
            raise ConfigurationError(
                f"connection_class={connection_class.__name__} is not one ratelimit_mw can "
                "mirror; use redis-py's Connection, SSLConnection or "
                "UnixDomainSocketConnection (or a subclass), e.g. redis.asyncio.from_url("
                "\"rediss://...\")"
            )
        if issubclass(connection_class, SentinelManagedConnection):
            pool = kwargs.get("connection_pool")
            if pool is None or not pool.is_master:
                raise ConfigurationError(
                    "a rate limiter writes: give it the primary, sentinel.master_for(...), "
                    "not a replica (slave_for)"
                )
            sentinels, service = tuple(pool.sentinel_manager.sentinels), pool.service_name
            # Asked on the running loop's own connections: redis-py's sentinel clients
            # belong to the loop they first ran on.
            locate = functools.partial(_sentinel.primary_of, pool.sentinel_manager, service)
        timeout = kwargs.get("socket_timeout")
        return cls(
            host=kwargs.get("host") or "localhost",
            port=int(kwargs.get("port") or 6379),
            path=path,
            tls=tls,
            locate=locate,
            sentinels=sentinels,
            service=service,
            db=int(kwargs.get("db", 0) or 0),
            username=kwargs.get("username"),
            password=kwargs.get("password"),
            credentials=kwargs.get("credential_provider"),
            client_name=kwargs.get("client_name"),
            timeout=timeout,
            connect_timeout=kwargs.get("socket_connect_timeout") or timeout,
        )

    def at(self, host: str, port: int) -> Settings:
        """The same transport, credentials and timeouts, another node."""
        return replace(self, host=host, port=port)

    def where(self) -> str:
        """The address, for messages."""
        return f"unix:{self.path}" if self.path is not None else f"{self.host}:{self.port}"


class _Protocol(asyncio.Protocol):
    """Commands out at once or batched; replies in, futures out, in order.

    Auto-pipelining: a command sent while nothing of this connection's is in flight is
    written at once, so Redis starts on it while the loop runs the rest of its iteration;
    commands sent while one is in flight are buffered and written together in ONE
    ``transport.write`` at the next iteration (two send calls per burst, not one per check).

    Deadlines: replies come in order, so one timer per connection watches the oldest
    unanswered command: when it has waited ``timeout``, the connection is given up and every
    call on it fails with a timeout (a hung Redis should not collect a queue); the next call
    reconnects.

    Give-ups: a caller may also say how long it waits (the middleware's deadline). Past that
    its call fails with TimeoutError while the connection stays: its reply is still read in
    its turn, and dropped. One timer (a heap of give-up times) serves every caller.

    One look before failing (``base.look``, ``base.Later``): neither timer fails a call
    before the loop has polled for I/O again, so a loop busy past a deadline does not fail
    calls whose replies arrived meanwhile (uvloop runs timers due during its I/O callbacks
    before it polls again). A timer that finds a call overdue comes back once, a look later;
    the calls still unanswered then fail, so a slow or hung server still fails them on time.
    (Not covered: under uvloop, a reply arriving during the look's own poll is read after it.)

    A waiter of None stands for a reply that nobody reads (ASKING's, sent just before the
    command it prefixes): it is consumed in its turn and dropped.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float | None) -> None:
        self.loop = loop
        self.timeout = timeout
        self.transport: asyncio.Transport | None = None
        self.address: tuple[str, int] | None = None  # where it connected, over TCP or TLS
        self.reader = hiredis.Reader()
        self.waiters: collections.deque[asyncio.Future[Any] | None] = collections.deque()
        self.deadlines: collections.deque[float] = collections.deque()  # one per waiter
        self.pending: list[bytes] = []  # written at the next iteration of the loop
        # What the pending commands wait with, counted from their write (see `_flush`): how
        # many entries of `deadlines` are theirs, and each give-up's budget and waiter.
        self.pending_deadlines = 0
        self.pending_give_ups: list[tuple[float, asyncio.Future[Any]]] = []
        self.timer: Later | None = None
        self.lost: BaseException | None = None
        # (give-up time, sequence, waiter): a heap; the timer that serves it and its time.
        self.give_ups: list[tuple[float, int, asyncio.Future[Any]]] = []
        self.give_up_timer: Later | None = None
        self.give_up_at = 0.0
        # When the give-up timer last found a call overdue with no look yet: every call due
        # by then has had its look once the loop time reaches look_until.
        self.looked_at = float("-inf")
        self.look_until = float("-inf")
        self.sequence = itertools.count()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        waiters, deadlines = self.waiters, self.deadlines
        while True:
            reply = self.reader.gets()
            if reply is False:
                return
            if not waiters:  # a reply nobody asked for: the stream cannot be trusted
                self.close(RedisConnectionError("unexpected reply from Redis"))
                return
            waiter = waiters.popleft()
            deadlines.popleft()
            if waiter is not None and not waiter.done():  # a cancelled call's reply is dropped
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
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.give_up_timer is not None:
            self.give_up_timer.cancel()
            self.give_up_timer = None
        self.give_ups.clear()
        self.pending.clear()
        self.pending_deadlines = 0
        self.pending_give_ups.clear()
        self.deadlines.clear()
        while self.waiters:
            waiter = self.waiters.popleft()
            if waiter is not None and not waiter.done():
                waiter.set_exception(reason)

    def send(self, packed: bytes, skipped: int = 0,
             give_up: float | None = None) -> asyncio.Future[Any]:
        """Queue `packed` (`skipped` unread replies, then the one returned) for this
        iteration's write; `give_up`: the loop time at which the returned future fails with
        TimeoutError if no reply has come, counted from the write (a command batched for the
        next iteration gets as long from its write as it had from now)."""
        if self.lost is not None or self.transport is None:
            raise self.lost or RedisConnectionError("not connected to Redis")
        loop = self.loop
        waiter = loop.create_future()
        now = loop.time()
        deadline = 0.0
        if self.timeout is not None:
            deadline = now + self.timeout
            if self.timer is None:
                self.timer = Later(loop, deadline, self._watch)
        # Nothing in flight, so nothing pending either (every pending command has its
        # waiter): Redis is idle as far as this connection knows, and order is kept.
        idle = not self.waiters
        for _ in range(skipped):
            self.waiters.append(None)
            self.deadlines.append(deadline)
        self.waiters.append(waiter)
        self.deadlines.append(deadline)
        if idle:
            self._write(packed)
            if give_up is not None:
                self._give_up_at(give_up, waiter)
        else:
            if not self.pending:
                loop.call_soon(self._flush)
            self.pending.append(packed)
            self.pending_deadlines += skipped + 1
            if give_up is not None:
                self.pending_give_ups.append((give_up - now, waiter))
        return waiter

    def _give_up_at(self, when: float, waiter: asyncio.Future[Any]) -> None:
        heapq.heappush(self.give_ups, (when, next(self.sequence), waiter))
        if self.give_up_timer is None or when < self.give_up_at:
            self._arm_give_up(when)

    def _arm_give_up(self, when: float) -> None:
        if self.give_up_timer is not None:
            self.give_up_timer.cancel()
        self.give_up_at = when
        self.give_up_timer = Later(self.loop, when, self._give_up)

    def _give_up(self) -> None:
        """The give-up timer: fail the calls whose time is up and whose look is over, drop
        those answered. A call found overdue with no look yet starts one (for every call due
        by now); one whose look is under way (the timer came early: `send` re-armed it for
        an earlier give-up) waits for its end."""
        self.give_up_timer = None
        heap = self.give_ups
        now = self.loop.time()
        while heap:
            when, _, waiter = heap[0]
            if waiter.done():
                heapq.heappop(heap)
            elif when > now:
                self._arm_give_up(when)
                return
            elif when > self.looked_at:
                self.looked_at = now
                self.look_until = now + look(now - when)
                self._arm_give_up(self.look_until)
                return
            elif now < self.look_until:
                self._arm_give_up(self.look_until)
                return
            else:
                heapq.heappop(heap)
                waiter.set_exception(asyncio.TimeoutError())

    def _flush(self) -> None:
        """Write the pending commands and start their time now: a saturated loop runs this
        long after they were made, and that time is the loop's, not Redis's."""
        pending = self.pending
        if not pending or self.transport is None or self.lost is not None:
            return
        data = pending[0] if len(pending) == 1 else b"".join(pending)
        pending.clear()
        self._write(data)
        now = self.loop.time()
        count, self.pending_deadlines = self.pending_deadlines, 0
        if self.timeout is not None:
            deadlines = self.deadlines
            for _ in range(count):
                deadlines.pop()
            deadlines.extend(itertools.repeat(now + self.timeout, count))
        give_ups, self.pending_give_ups = self.pending_give_ups, []
        for budget, waiter in give_ups:
            if not waiter.done():
                self._give_up_at(now + budget, waiter)

    def _write(self, data: bytes) -> None:
        """Every byte this connection sends goes out here (tests interpose on it)."""
        if self.transport is not None:  # always, once connection_made has run
            self.transport.write(data)

    def _watch(self, looked_at: float = float("-inf")) -> None:
        """The deadline timer: give up on a server whose oldest reply is overdue, after one
        look (`looked_at`: when this timer found a reply overdue and came back a look later;
        nothing else arms it while it is set, so it never comes early)."""
        self.timer = None
        if not self.deadlines:
            return
        oldest = self.deadlines[0]
        now = self.loop.time()
        if now < oldest:
            self.timer = Later(self.loop, oldest, self._watch)
        elif oldest > looked_at:
            self.timer = Later(self.loop, now + look(now - oldest), self._watch, now)
        else:
            self.close(RedisTimeoutError("Timeout reading from Redis"))


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
        self._protocol: _Protocol | None = None
        # The event loop the connection belongs to, and the task connecting it (shared).
        self._bound: tuple[asyncio.AbstractEventLoop, asyncio.Task[_Protocol] | None] | None = None
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
        protocol = self._protocol
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

    def ready(self) -> _Protocol | None:
        """The connection's protocol if it is open on the running loop, else None (a call
        would connect first: see `_once`)."""
        protocol = self._protocol
        bound = self._bound
        if protocol is None or protocol.lost is not None or bound is None or (
                bound[0] is not asyncio.get_running_loop()):
            return None
        return protocol

    async def evalsha_within(self, keys: list[str], args: list[Any], seconds: float) -> Any:
        """`evalsha`, failing with TimeoutError after `seconds`: on an open connection by the
        protocol's give-up timer, otherwise (a reconnect, an error that `recovers`) by a
        deadline around the whole call for the time that is left. With no open connection
        (a cold worker) the call first waits for one (`_opened_within`), and its time starts
        once it is open."""
        loop = asyncio.get_running_loop()
        protocol = self.ready()
        if protocol is None and self._protocol is None:
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

    async def _opened_within(self, loop: asyncio.AbstractEventLoop, seconds: float) -> _Protocol:
        """The connection, opened by this call or one before it, within `seconds` as well as
        the connect timeout (the opening's own, which a client may leave at redis-py's 5 s):
        past them, a timeout that names the server. The opening goes on for the calls
        after it."""
        try:
            return await bounded(self._connect(loop), seconds, SETUP_TURNS)
        except asyncio.TimeoutError as exc:  # `_open` turns its own timeout into Redis's
            raise RedisTimeoutError(f"Timeout connecting to {self._dialled}") from exc

    async def _once(self, packed: bytes, skipped: int) -> Any:
        protocol = self._protocol
        bound = self._bound
        if protocol is None or protocol.lost is not None or bound is None or (
                bound[0] is not asyncio.get_running_loop()):
            protocol = await self._connect(asyncio.get_running_loop())
        # The protocol's deadline timer bounds the wait (see _Protocol).
        return await protocol.send(packed, skipped)

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> _Protocol:
        """The connection, opened by one task that every caller meanwhile awaits, so a
        burst wakes at once when it is done (a lock would wake one waiter per iteration);
        shielded: a cancelled caller leaves the connect running for the others."""
        bound = self._bound
        if bound is None or bound[0] is not loop:
            # A client belongs to one event loop; a new loop (a test runner's, a worker's)
            # gets its own connection instead of failing.
            self.close()
            bound = None
        task = None if bound is None else bound[1]
        if task is None or task.done():
            task = loop.create_task(self._open(loop))
            task.add_done_callback(consume)
            self._bound = (loop, task)
            if not self._listeners and self.settings.sentinels:
                self._listeners = [
                    loop.create_task(_sentinel.listen(sentinel, self.settings.service,
                                                      self._switched))
                    for sentinel in self.settings.sentinels]
        return await asyncio.shield(task)

    def _switched(self, host: str, port: int) -> None:
        """A sentinel announced a new primary: the next connect goes there, and the
        connection to another server is dropped now (its calls in flight fail and are
        retried once), not when that server is demoted seconds later: every count written
        to it meanwhile would be lost with it."""
        self._announced = (host, port)
        if self._bound is not None:
            self._announced_until = self._bound[0].time() + ANNOUNCED_FOR
        protocol = self._protocol
        if protocol is not None and protocol.lost is None and protocol.address != (host, port):
            protocol.close(RedisConnectionError(
                f"Sentinel announced a new primary at {host}:{port}"))

    async def _open(self, loop: asyncio.AbstractEventLoop) -> _Protocol:
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
        self._protocol = protocol
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
                         address: tuple[str, int] | None) -> _Protocol:
        settings = self.settings
        timeout = settings.timeout
        if address is None:
            _, protocol = await loop.create_unix_connection(
                lambda: _Protocol(loop, timeout), settings.path)
        else:
            _, protocol = await loop.create_connection(
                lambda: _Protocol(loop, timeout), *address, ssl=settings.tls)
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

    async def _handshake(self, protocol: _Protocol) -> None:
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
        protocol, self._protocol = self._protocol, None
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
