"""What the async limiter awaits: the deadline, the sleep, and the calls in flight for a
lapsed refusal. `ratelimit_mw/_sync/primitives.py` holds their blocking twins
(written by hand, as httpcore keeps its synchronization primitives): the generated sync
code imports those instead."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from ratelimit_mw.backends.base import bounded
from ratelimit_mw.core.plans import Check

__all__ = ["ASYNC", "Every", "Flights", "bounded", "every", "sleep"]

#: Which side this is: an async limiter's routes may have async hooks.
ASYNC = True
sleep = asyncio.sleep


class Flights(dict[tuple[Check, ...], "asyncio.Future[bool]"]):
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


class Every:
    """`every`'s task: stop() cancels it and waits until it has stopped."""

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


def every(seconds: float, action: Callable[[], Awaitable[None]]) -> Every:
    """Run `action` every `seconds` on this event loop until stopped (a lease's renewal)."""
    return Every(seconds, action)
