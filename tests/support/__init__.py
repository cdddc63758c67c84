"""What every HTTP test shares: one counting backend, one failing backend, one clock, ports.

- `CountingBackend` wraps a backend (memory by default) for sync and async callers, counts
  the calls that reach it, and fails on demand: ``failure`` is an exception to raise, or
  ``"hang"`` to wait (async) until the caller's deadline cancels the call.
- `failing_backend(error)` is a CountingBackend whose every call raises `error`.
- `MonotonicClock` is the clock a test moves for the middleware's breaker.
- `free_port()` is a loopback port free right now.
- `HOUSEKEEPER` records the prefixes the run writes under, for the sweep at its end.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import Any

from housekeeping import Housekeeper

import ratelimit_mw as rl
from ratelimit_mw.backends.base import bounded
from ratelimit_mw.core.codec import ScriptCall

REDIS_URL = os.environ.get("RATELIMIT_REDIS_URL", "redis://127.0.0.1:6379/0")
#: The run's record of what its keys are named after, swept at the end (tests/conftest.py).
HOUSEKEEPER = Housekeeper(REDIS_URL)


def free_port() -> int:
    """A loopback port nobody listens on right now (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class CountingBackend:
    """Wraps a backend; counts the calls that reach it and fails (or hangs) on demand."""

    def __init__(self, inner: Any | None = None,
                 failure: BaseException | str | None = None, delay: float = 0.0) -> None:
        self.inner = inner if inner is not None else rl.MemoryBackend()
        self.is_cluster = getattr(self.inner, "is_cluster", False)
        self.failure = failure
        self.delay = delay  # seconds each call takes before it answers or fails
        self.calls = 0
        self.ops: list[str] = []

    def _count(self, call: ScriptCall) -> None:
        self.calls += 1
        self.ops.append(call.op)

    def run(self, call: ScriptCall, deadline: float | None = None) -> list[int]:
        self._count(call)
        if self.delay:
            time.sleep(self.delay)
        if isinstance(self.failure, BaseException):
            raise self.failure
        return self.inner.run(call, deadline)  # type: ignore[no-any-return]

    async def arun(self, call: ScriptCall, deadline: float | None = None) -> list[int]:
        """The call, kept to `deadline` as a backend keeps it (`bounded`: the Redis
        backends' rule)."""
        return await bounded(self._arun(call), deadline)

    async def _arun(self, call: ScriptCall) -> list[int]:
        self._count(call)
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.failure == "hang":
            await asyncio.sleep(3600)
        elif isinstance(self.failure, BaseException):
            raise self.failure
        return await self.inner.arun(call)  # type: ignore[no-any-return]


def failing_backend(error: BaseException | str = "hang", delay: float = 0.0) -> CountingBackend:
    """A backend whose every call fails: raises `error`, or hangs (async) for "hang"."""
    if isinstance(error, str) and error != "hang":
        error = rl.BackendError(error)
    return CountingBackend(failure=error, delay=delay)


class MonotonicClock:
    """A monotonic clock moved by the test (the breaker's clock)."""

    __test__ = False

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Recorder:
    """A metrics hook that records every event: (event, policy name, seconds)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, float]] = []

    def observe(self, event: str, policy: str, seconds: float) -> None:
        self.events.append((event, policy, seconds))

    def names(self, event: str) -> list[str]:
        return [name for kind, name, _ in self.events if kind == event]
