"""The event loops deployments run, for tests of what the loop's order of work decides."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable, Iterator
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


@contextlib.contextmanager
def io_callback(on_readable: Callable[[], None]) -> Iterator[Callable[[], None]]:
    """Run `on_readable` once as an I/O callback of the running loop (a pipe's read end, so
    it runs in the loop's I/O phase, after a poll); yields what makes the pipe readable."""
    loop = asyncio.get_running_loop()
    read_end, write_end = os.pipe()

    def readable() -> None:
        os.read(read_end, 1)
        loop.remove_reader(read_end)
        on_readable()

    loop.add_reader(read_end, readable)
    try:
        yield lambda: os.write(write_end, b"x") and None
    finally:
        loop.remove_reader(read_end)
        os.close(read_end)
        os.close(write_end)
