"""The blocking twins of `ratelimit_mw/_async/primitives.py`, which the generated sync code
imports: no deadline (a blocking call cannot be interrupted: the client's timeouts bound
it), ``time.sleep``, and no waiting on another thread's call."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from ratelimit_mw.core.plans import Check

__all__ = ["ASYNC", "Every", "Flights", "bounded", "every", "sleep"]

T = TypeVar("T")
ASYNC = False
sleep = time.sleep


def bounded(value: T, seconds: float | None) -> T:
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
    """`every`'s thread (a daemon: it never keeps a process alive): stop() ends it and
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


def every(seconds: float, action: Callable[[], None]) -> Every:
    """Run `action` every `seconds` in a thread of its own until stopped (a lease's
    renewal)."""
    return Every(seconds, action)
