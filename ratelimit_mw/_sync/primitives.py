"""The blocking twins of `ratelimit_mw/_async/primitives.py`, which the generated sync code
imports: no deadline (a blocking call cannot be interrupted: the client's timeouts bound
it), ``time.sleep``, and no waiting on another thread's call."""

from __future__ import annotations

import time
from typing import TypeVar

from ratelimit_mw.core.plans import Check

__all__ = ["ASYNC", "Flights", "bounded", "sleep"]

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
