"""What a backend is: the two protocols the limiters drive, and the capabilities they read.

A backend runs one `ScriptCall` (the keys and arguments of the joined Lua script) and returns
its integer reply. Capabilities are declared as attributes so that callers never need an
``isinstance`` check on a concrete backend:

- ``is_cluster``: keys are spread over hash slots; calls are split by slot.
- ``in_process``: the call is answered in this process without I/O (the memory backend), so
  a deadline around it protects nothing and only costs time.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import Protocol, TypeVar

from ratelimit_mw.core.plans import ScriptCall

T = TypeVar("T")


class SyncBackend(Protocol):
    is_cluster: bool
    in_process: bool

    def run(self, call: ScriptCall) -> list[int]: ...


class AsyncBackend(Protocol):
    is_cluster: bool
    in_process: bool

    async def arun(self, call: ScriptCall) -> list[int]: ...


if sys.version_info >= (3, 11):

    async def bounded(awaitable: Awaitable[T], seconds: float | None) -> T:
        """`awaitable`, cancelled with TimeoutError after `seconds` (None: no deadline)."""
        if seconds is None:
            return await awaitable
        async with asyncio.timeout(seconds):
            return await awaitable

else:  # pragma: no cover - exercised on Python 3.10 only

    async def bounded(awaitable: Awaitable[T], seconds: float | None) -> T:
        return await (awaitable if seconds is None else asyncio.wait_for(awaitable, seconds))
