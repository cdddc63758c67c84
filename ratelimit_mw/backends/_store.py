"""The memory backend's storage: values with an expiry, and the sweep that forgets them.

Expiry is garbage collection only (as in the scripts, every value carries what makes it stale),
so idle identities are forgotten: each written key is scheduled once, at its expiry, in a
schedule of buckets (the keys due in one ms), and every call — admitted or refused, any
operation — looks at due keys: at most 64, plus 16 for every millisecond since the previous
call, dropping the expired ones and scheduling again those written since. Reclaiming thus
keeps pace with time rather than with traffic: a backend that is called seldom (in front of
it a cache answers most refusals) still frees, on its next call, what expired meanwhile (up
to 16,000 keys per idle second, a pause of a few ms), and a busy one spreads the work over
its calls.
"""

from __future__ import annotations

import heapq
import threading
import time
from typing import Any

_SWEEP_PER_CALL = 64
_SWEEP_PER_MS = 16
_SWEEP_MAX_MS = 4_096  # at most ~65k entries in one call, however long the backend idled
# The schedule's last time, never due: the heap is never empty, so a call asks only whether
# its first time has come.
NEVER = 1 << 62


class _Store:
    """The state of a `MemoryBackend` and its lock (every call holds it)."""

    def __init__(self) -> None:
        self._data: dict[str, Any] = {}
        self._expires: dict[str, int] = {}
        # The sweep's schedule, when to look at which key: a bucket of keys per ms
        # (`_due`), a heap of the ms that have one (`_due_times`), and every key in a bucket,
        # once (`_scheduled`). Keys due in the same ms share a bucket (every fixed-window
        # key of one window, a crowd's keys written in one ms), so scheduling a key is
        # mostly an append and the heap is paid per ms, not per key that expired and came
        # back (a returning identity's gcra key lives a few ms far from its limit).
        self._due: dict[int, list[str]] = {}
        self._due_times: list[int] = [NEVER]
        self._scheduled: set[str] = set()
        self._called_at = 0  # the `now` (ms) of the last call: a sweep's budget grows with time
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """How many keys are held (expired ones are dropped as calls sweep)."""
        return len(self._data)

    def close(self) -> None:
        with self._lock:
            self._data.clear()
            self._expires.clear()
            self._due.clear()
            self._due_times[:] = [NEVER]
            self._scheduled.clear()

    async def aclose(self) -> None:
        self.close()

    # -- storage with expiry ------------------------------------------------------------------
    def _get(self, key: str, now: int) -> Any:
        """The key's value, None once expired (the checks read it so, inline)."""
        return self._data[key] if self._expires.get(key, 0) > now else None

    def _set(self, key: str, value: Any, now: int, px: int) -> None:
        self._data[key] = value
        self._expires[key] = expires = now + px
        if key not in self._scheduled:
            self._schedule(key, expires)

    def _schedule(self, key: str, at: int) -> None:
        """Have the sweep look at `key` at `at` (ms). For a key not in the schedule (the
        callers ask `_scheduled` first: a key written again keeps its place, and the sweep,
        finding it written since, files it again at its new expiry)."""
        self._scheduled.add(key)
        self._file(key, at)

    def _file(self, key: str, at: int) -> None:
        """Put `key` in the bucket of `at`, opening it if none."""
        bucket = self._due.get(at)
        if bucket is None:
            self._due[at] = [key]
            heapq.heappush(self._due_times, at)
        else:
            bucket.append(key)

    def _delete(self, key: str) -> None:
        self._data.pop(key, None)
        self._expires.pop(key, None)

    def _tick(self, now_us: int | None) -> int:
        """The clock of a call (µs; None: this process's, as Redis's TIME), after the sweep
        every call makes before it reads anything (the lock held). O(1) when nothing is
        due."""
        if now_us is None:
            now_us = time.time_ns() // 1000
        now = now_us // 1000
        due_times = self._due_times
        if due_times[0] <= now:
            self._sweep(now, now - self._called_at)
        self._called_at = now
        return now_us

    def _sweep(self, now: int, idle: int) -> None:
        """Look at due keys, 64, plus 16 per ms the backend sat `idle` since its last call:
        drop each one expired, schedule again each one written since (at its new expiry)."""
        budget = _SWEEP_PER_CALL + _SWEEP_PER_MS * min(max(0, idle), _SWEEP_MAX_MS)
        due_times, due, expiry_of = self._due_times, self._due, self._expires
        scheduled = self._scheduled
        while (at := due_times[0]) <= now:
            bucket = due[at]
            while bucket:
                if not budget:
                    return
                budget -= 1
                key = bucket.pop()
                expiry = expiry_of.get(key)
                if expiry is None:  # deleted since (a reset, a log refunded empty)
                    scheduled.discard(key)
                elif expiry <= now:
                    self._delete(key)
                    scheduled.discard(key)
                else:  # written again since: due later (expiry > now >= at: another bucket)
                    self._file(key, expiry)
            heapq.heappop(due_times)
            del due[at]
