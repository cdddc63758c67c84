"""Helpers for an app's own tests: isolated limits, a clock the test moves, an off switch.

A pytest plugin, loaded automatically where ratelimit_mw is installed; its fixture
``ratelimit`` isolates every limiter of the process for one test::

    def test_login_is_limited(client, ratelimit):
        for _ in range(5):
            assert client.post("/login").status_code == 200
        assert client.post("/login").status_code == 429
        ratelimit.clock.advance(60)                 # a minute later, without sleeping
        assert client.post("/login").status_code == 200

While a test runs, every `Limiter` and `AsyncLimiter` of the process — those alive when it
starts and those made during it (an app factory, Django's middleware built on the first
request) — counts in a fresh in-process `MemoryBackend` (one for all of them, so limiters
that share a store still share counts), on ``ratelimit.clock``, with an empty deny cache;
``acquire`` waits by moving the clock instead of sleeping. Afterwards each gets its store,
clock, deny cache and sleep back: counts never leak from one test to the next, and the app's
store is not written. The plugin sets ``ratelimit`` up before every other fixture of the
test, whatever the order of the arguments, so a fixture that pings the store already talks
to memory.

``with ratelimit.disabled():`` (or ``disable()`` until ``enable()``) turns limiting off for
every middleware, extension, dependency and decorated route of the process: requests pass
untouched, with no headers, and nothing is counted; direct calls (``limiter.hit``) still
count. The switch is back as it was when the test ends. ``ratelimit.isolate(limiter)`` still
works, and is no longer needed.

Before each test the plugin also empties the deny cache of every limiter
(`clear_deny_caches`), so that a test which deletes keys in the store between tests is not
answered by a refusal remembered from the one before. Outside pytest,
``with isolated() as isolation:`` and ``clear_deny_caches()`` do the same.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from ratelimit_mw.backends.memory import MemoryBackend
from ratelimit_mw.core.deny_cache import DenyCache
from ratelimit_mw.engine import _ON_NEW, SWITCH, _Shared, live_limiters
from ratelimit_mw.limiter import AsyncLimiter

__all__ = ["Clock", "Isolation", "clear_deny_caches", "isolated"]


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


def _emptied(deny: DenyCache) -> DenyCache:
    return DenyCache(deny.size, deny.max_age_us / 1e6, deny.max_bytes)


def clear_deny_caches() -> None:
    """Forget the refusals every limiter of the process remembers in its deny cache (for up
    to its ``deny_cache_max_age``): the store answers their next hits. For a test that
    deletes keys in the store; the pytest plugin does it before each test."""
    for limiter in live_limiters():
        deny = limiter._deny
        if deny is not None and len(deny):
            limiter._deny = _emptied(deny)


class Isolation:
    """The limiters isolated for one test, the clock they read, and the off switch."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock = clock if clock is not None else Clock()
        self.backend = MemoryBackend()
        # Each isolated limiter (hashed by identity) -> what it had: given back last first.
        self._saved: dict[_Shared, tuple[Any, ...]] = {}
        self._switched_off = SWITCH.off  # as found: put back by `restore`
        self._ended = False
        # A limiter may be built on another thread (a server's) while the test ends.
        self._lock = threading.Lock()

    def isolate(self, limiter: _Shared) -> None:
        """Count `limiter` in this test's memory, on its clock, until the test ends."""
        with self._lock:
            if self._ended or limiter in self._saved:
                return
            deny = limiter._deny
            self._saved[limiter] = (limiter.backend, limiter.clock, deny, limiter._sleep)
            limiter.backend = self.backend
            limiter.clock = self.clock
            if deny is not None:
                limiter._deny = _emptied(deny)
            limiter._sleep = self.clock.asleep if isinstance(limiter, AsyncLimiter) else (
                self.clock.sleep)

    def disable(self) -> None:
        """Turn limiting off for every middleware, decorator and dependency of the process
        until `enable` or the end of the test: requests pass untouched (no headers, nothing
        counted). Direct calls (``limiter.hit``) still count."""
        SWITCH.off = True

    def enable(self) -> None:
        """Turn limiting back on."""
        SWITCH.off = False

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Limiting off for the block (`disable`), then as it was."""
        was = SWITCH.off
        SWITCH.off = True
        try:
            yield
        finally:
            SWITCH.off = was

    def restore(self) -> None:
        """Give every isolated limiter its store, clock and deny cache back, stop isolating
        new ones, and put the off switch back as it was."""
        with contextlib.suppress(ValueError):
            _ON_NEW.remove(self.isolate)
        with self._lock:
            self._ended = True
            while self._saved:
                limiter, (backend, clock, deny, sleep) = self._saved.popitem()
                limiter.backend = backend
                limiter.clock, limiter._deny, limiter._sleep = clock, deny, sleep
        SWITCH.off = self._switched_off


@contextlib.contextmanager
def isolated(*limiters: _Shared, clock: Clock | None = None
             ) -> Iterator[Isolation]:
    """Isolate `limiters` for the block; none given: every limiter alive now or made during
    the block."""
    isolation = Isolation(clock)
    try:
        if not limiters:  # and every limiter made in the block, as its construction ends
            _ON_NEW.append(isolation.isolate)
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

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
        """``ratelimit`` first: pytest sets a test's fixtures up in the order of
        ``item.fixturenames``, and a fixture set up before it (a client entering the app's
        lifespan) would meet the app's real store."""
        for item in items:
            names = getattr(item, "fixturenames", None)
            if isinstance(names, list) and "ratelimit" in names:
                names.remove("ratelimit")
                names.insert(0, "ratelimit")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(item: pytest.Item) -> None:
        """No refusal remembered from the test before (its keys may be gone)."""
        clear_deny_caches()
