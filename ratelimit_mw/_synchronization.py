"""The primitives each side of the generated code stands on, written by hand (as httpcore
keeps its `_synchronization.py`): the deadline, the sleep, the calls in flight for a lapsed
refusal, a renewal's timer. The async names end in ``_async`` or start with ``Async``, and
scripts/unasync.py maps them onto their blocking twins here (``bounded_async`` ->
``bounded_sync``, ``AsyncFlights`` -> ``Flights``), which wait on nothing: a blocking call
cannot be cut short (the client's timeouts bound it), and threads do not wait for each
other's calls."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ratelimit_mw.backends.base import bounded as bounded_async
from ratelimit_mw.core.codec import Check

__all__ = ["AsyncEvery", "AsyncFlights", "Every", "Flights", "bounded_async", "bounded_sync",
           "every_async", "every_sync", "side_async", "side_sync", "sleep_async", "sleep_sync"]

T = TypeVar("T")
#: Which side a limiter is: an async limiter's routes may have async hooks.
side_async = True
side_sync = False
sleep_async = asyncio.sleep
sleep_sync = time.sleep


class AsyncFlights(dict[tuple[Check, ...], "asyncio.Future[bool]"]):
    """The calls out now that ask the store again about a refusal that has just lapsed, by
    its checks: every request of the same hit that comes meanwhile waits for that call
    instead of sending its own (a flood from one refused client, spread over many
    connections, would otherwise send one call per connection each time the refusal
    lapses)."""

    def lead(self, checks: tuple[Check, ...]) -> asyncio.Future[bool]:
        """Announce a call for `checks`; its future says, once it lands, whether it got no
        answer."""
        future = self[checks] = asyncio.get_running_loop().create_future()
        return future

    def land(self, checks: tuple[Check, ...], future: asyncio.Future[bool],
             answered: bool) -> None:
        del self[checks]
        future.set_result(not answered)

    @staticmethod
    async def follow(future: asyncio.Future[bool]) -> bool:
        """Wait for another request's call; True if it got no answer. Shielded: a
        follower's deadline must not cancel the leader's future."""
        return await asyncio.shield(future)


class AsyncEvery:
    """`every_async`'s task: stop() cancels it and waits until it has stopped."""

    __slots__ = ("_task",)

    def __init__(self, seconds: float, action: Callable[[], Awaitable[None]]) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(seconds, action))

    @staticmethod
    async def _run(seconds: float, action: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(seconds)
            with contextlib.suppress(Exception):  # a failed renewal is tried again next time
                await action()

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


def every_async(seconds: float, action: Callable[[], Awaitable[None]]) -> AsyncEvery:
    """Run `action` every `seconds` on this event loop until stopped (a lease's renewal)."""
    return AsyncEvery(seconds, action)


# -- the blocking twins ---------------------------------------------------------------------
def bounded_sync(value: T, seconds: float | None) -> T:
    """The value, computed already: a blocking call cannot be cut short."""
    return value


class Flights(dict[tuple[Check, ...], object]):
    """Threads do not wait for each other's calls: each asks the store itself when a
    refusal lapses (one call per thread and lapse, where the async side sends one per
    hit)."""

    def lead(self, checks: tuple[Check, ...]) -> object:
        return None

    def land(self, checks: tuple[Check, ...], future: object, answered: bool) -> None:
        return None

    @staticmethod
    def follow(future: object) -> bool:
        return True


class Every:
    """`every_sync`'s thread (a daemon: it never keeps a process alive): stop() ends it and
    waits until it has."""

    __slots__ = ("_stopped", "_thread")

    def __init__(self, seconds: float, action: Callable[[], None]) -> None:
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(seconds, action),
                                        name="ratelimit_mw-renewal", daemon=True)
        self._thread.start()

    def _run(self, seconds: float, action: Callable[[], None]) -> None:
        while not self._stopped.wait(seconds):
            with contextlib.suppress(Exception):  # a failed renewal is tried again next time
                action()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


def every_sync(seconds: float, action: Callable[[], None]) -> Every:
    """Run `action` every `seconds` in a thread of its own until stopped (a lease's
    renewal)."""
    return Every(seconds, action)
