"""Helpers for an app's own tests: isolated limits and a clock the test moves.

A pytest plugin, loaded automatically where ratelimit_mw is installed; its fixture
``ratelimit`` isolates every limiter of the process for one test::

    def test_login_is_limited(client, ratelimit):
        for _ in range(5):
            assert client.post("/login").status_code == 200
        assert client.post("/login").status_code == 429
        ratelimit.clock.advance(60)                 # a minute later, without sleeping
        assert client.post("/login").status_code == 200

While a test runs, each `Limiter` and `AsyncLimiter` alive when it started counts in a fresh
in-process `MemoryBackend` (one for all of them, so limiters that share a store still share
counts), on ``ratelimit.clock``, with an empty deny cache; ``acquire`` waits by moving the
clock instead of sleeping. Afterwards each gets its store, clock and cache back: counts never
leak from one test to the next, and the app's Redis is not written. A limiter made during the
test (an app factory called in it) is isolated with ``ratelimit.isolate(limiter)``.
Outside pytest, ``with isolated() as isolation:`` does the same.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from ratelimit_mw.backends.memory import MemoryBackend
from ratelimit_mw.core.deny_cache import DenyCache
from ratelimit_mw.limiter import AsyncLimiter, Limiter, live_limiters

__all__ = ["Clock", "Isolation", "isolated"]


class Clock:
    """A clock that stands still until the test moves it: seconds since the epoch."""

    def __init__(self, start: float | None = None) -> None:
        self.now = time.time() if start is None else float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock forward (a window passes, a ban ends)."""
        if seconds < 0:
            raise ValueError(f"a clock moves forward only, got {seconds!r} seconds")
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        """What ``acquire`` does instead of sleeping."""
        self.advance(max(0.0, seconds))

    async def asleep(self, seconds: float) -> None:
        self.advance(max(0.0, seconds))


class Isolation:
    """The limiters isolated for one test, and the clock they read."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock = clock if clock is not None else Clock()
        self.backend = MemoryBackend()
        self._saved: list[tuple[Limiter | AsyncLimiter, tuple[Any, ...]]] = []

    def isolate(self, limiter: Limiter | AsyncLimiter) -> None:
        """Count `limiter` in this test's memory, on its clock, until the test ends."""
        if any(saved is limiter for saved, _ in self._saved):
            return
        deny = limiter._deny
        self._saved.append((limiter, (limiter.backend, limiter.clock, deny,
                                      limiter._sleep)))
        limiter._attach(self.backend)
        limiter.clock = self.clock
        if deny is not None:
            limiter._deny = DenyCache(deny.size, deny.max_age_us / 1e6)
        limiter._sleep = self.clock.asleep if isinstance(limiter, AsyncLimiter) else (
            self.clock.sleep)

    def restore(self) -> None:
        """Give every isolated limiter its store, clock and deny cache back."""
        while self._saved:
            limiter, (backend, clock, deny, sleep) = self._saved.pop()
            limiter._attach(backend)
            limiter.clock, limiter._deny, limiter._sleep = clock, deny, sleep


@contextlib.contextmanager
def isolated(*limiters: Limiter | AsyncLimiter, clock: Clock | None = None
             ) -> Iterator[Isolation]:
    """Isolate `limiters` (default: every limiter alive now) for the block."""
    isolation = Isolation(clock)
    try:
        for limiter in limiters or tuple(live_limiters()):
            isolation.isolate(limiter)
        yield isolation
    finally:
        isolation.restore()


try:
    import pytest
except ImportError:  # pragma: no cover - the plugin part needs pytest; the helpers do not
    pass
else:

    @pytest.fixture
    def ratelimit() -> Iterator[Isolation]:
        """Every limiter of the process isolated for this test (see the module docstring)."""
        with isolated() as isolation:
            yield isolation
