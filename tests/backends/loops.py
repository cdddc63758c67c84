"""The event loops deployments run, for tests of what the loop's order of work decides."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest


def event_loops() -> list[Any]:
    """The loops deployments run: asyncio's, and uvloop's (uvicorn's default where it is
    installed), whose libuv runs the timers that fell due during its I/O callbacks before it
    polls again."""
    loops: list[Any] = [pytest.param(asyncio.new_event_loop, id="asyncio")]
    try:
        import uvloop
    except ImportError:  # Windows: uvicorn runs asyncio's loop there
        return loops
    return [*loops, pytest.param(uvloop.new_event_loop, id="uvloop")]


def run_on(new_loop: Callable[[], asyncio.AbstractEventLoop],
           main: Callable[[], Awaitable[Any]]) -> Any:
    loop = new_loop()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()
