"""What a backend is: one call per side, and the one capability the limiters read.

A backend runs one `ScriptCall` (the keys and arguments of the joined Lua script) and returns
its integer reply: ``run(call, deadline=None)`` on the sync side, ``await arun(call,
deadline=None)`` on the async side. ``deadline`` is how many seconds the call may take (the
middleware's ``backend_timeout``; None: the client's own timeouts): the backend keeps it, cold
or warm, and raises TimeoutError past it; a backend that answers in process, or a blocking one
that cannot be interrupted, may ignore it. Any other failure is a BackendError. The
capability is an attribute, so that no caller needs an ``isinstance`` check: ``is_cluster``,
keys are spread over hash slots and calls are split by slot; and, optional (False when
absent), ``in_process``: the store answers in this process, with no round trip for the
middleware to share (the ASGI responses that end in one turn of the loop then give their
slots back each in place, not batched).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from ratelimit_mw.core.codec import ScriptCall

T = TypeVar("T")


class SyncBackend(Protocol):
    is_cluster: bool

    def run(self, call: ScriptCall, deadline: float | None = None) -> list[int]: ...


class AsyncBackend(Protocol):
    is_cluster: bool

    async def arun(self, call: ScriptCall, deadline: float | None = None) -> list[int]: ...


# A deadline fails a call only once the event loop has looked for its answer: LOOK seconds
# after it found the call overdue, when the loop has polled for I/O at least once (under
# libuv a timer due at once may run before the poll) and has woken what the poll answered.
# A loop busy past a deadline (a burst of incoming requests, a GC pause, a starved CPU, an
# app's blocking call) would otherwise fail calls whose replies had come, or that it had
# itself written late, and the middleware would open its breaker over a stall of its own
# process. 1 ms also lets a command written just now be answered; a server that has not
# answered by then fails its calls 1 ms after the deadline.
LOOK = 0.001


def look(late: float) -> float:
    """How long the look lasts for a timer that ran `late` seconds after it was due.

    A timer that runs late tells of a loop that was busy (uvloop even stamps the calls it
    sends after a stall with the time from before it, so they look overdue as they leave):
    the server then gets as long again as the stall took from its deadline, not 1 ms, to
    answer what the loop sent or could not read meanwhile. A server that is really hung
    still fails its calls, one stall later."""
    return late if late > LOOK else LOOK


# A deadline acts only after the loop has turned twice more (two call_soon hops): one turn
# polls for I/O and hands what it read to the protocols, the next one runs the wake-ups
# that handed. A loop saturated with ready work (hundreds of requests arriving at once)
# runs timers on time but takes longer per turn than a look lasts: it writes a call one
# turn after making it and reads the reply a turn later, and a healthy server looked hung.
TURNS = 2


class Later:
    """`callback(*args)` at loop time `when`, then `turns` (TURNS) turns of the loop later;
    cancellable at every step."""

    __slots__ = ("args", "callback", "handle", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop, when: float,
                 callback: Callable[..., None], *args: Any, turns: int = TURNS) -> None:
        self.loop = loop
        self.callback = callback
        self.args = args
        self.handle: asyncio.Handle = loop.call_at(when, self._turn, turns)

    def _turn(self, left: int) -> None:
        if left:
            self.handle = self.loop.call_soon(self._turn, left - 1)
        else:
            self.callback(*self.args)

    def cancel(self) -> None:
        self.handle.cancel()


class _Rescheduling(Protocol):
    """What `_Deadline` uses of an ``asyncio.Timeout`` (Python 3.11+)."""

    def reschedule(self, when: float | None) -> None: ...


class _Deadline:
    """The two timers of `bounded` (each acting turns late: see `Later`): at the deadline,
    `turns` turns later, one look (see `look`); then the cancellation, queued behind the
    wake-ups that are due already (call_soon order), so a task whose answer has come resumes
    with it instead of being cancelled."""

    __slots__ = ("handle", "loop", "scope", "when")

    def __init__(self, loop: asyncio.AbstractEventLoop, scope: _Rescheduling,
                 when: float, turns: int) -> None:
        self.loop = loop
        self.scope = scope
        self.when = when
        self.handle = Later(loop, when, self._look, turns=turns)

    def _look(self) -> None:
        now = self.loop.time()
        self.handle = Later(self.loop, now + look(now - self.when), self._expire)

    def _expire(self) -> None:
        self.scope.reschedule(self.loop.time())  # a time past: cancels via call_soon

    def cancel(self) -> None:
        self.handle.cancel()


if sys.version_info >= (3, 11):

    async def bounded(awaitable: Awaitable[T], seconds: float | None,
                      turns: int = TURNS) -> T:
        """`awaitable`, cancelled with TimeoutError after `seconds` (None: no deadline),
        `turns` turns of the loop and its one look (see LOOK): `seconds` <= 0 still lets it
        run until the look. An exchange of several round trips (a connection's set-up)
        passes the turns it takes."""
        if seconds is None:
            return await awaitable
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(None) as scope:
            deadline = _Deadline(loop, scope, loop.time() + seconds, turns)
            try:
                return await awaitable
            finally:
                deadline.cancel()

else:  # pragma: no cover - exercised on Python 3.10 only (end of life): no look there

    async def bounded(awaitable: Awaitable[T], seconds: float | None,
                      turns: int = TURNS) -> T:
        return await (awaitable if seconds is None else asyncio.wait_for(awaitable, seconds))
