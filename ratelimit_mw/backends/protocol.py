"""The asyncio protocol of one pipelined Redis connection: commands out, replies in, in order.

``RedisProtocol`` writes the packed commands (at once, or batched per loop iteration while
others are in flight), hiredis parses the replies in C and hands them to the waiting futures
in order, and its timers keep the connection's deadline and each caller's give-up time.
Opening, retrying and following Sentinel are the connection's job (pipeline.py).
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
from typing import Any

import hiredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ratelimit_mw.backends.base import Later, look


class RedisProtocol(asyncio.Protocol):
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

    def ready(self) -> bool:
        """Whether a command can be sent now: the connection is open and belongs to the
        running loop (a new loop gets a connection of its own: see pipeline.py)."""
        return self.lost is None and self.loop is asyncio.get_running_loop()

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
