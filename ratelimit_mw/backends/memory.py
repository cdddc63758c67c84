"""MemoryBackend: the script's algorithms in Python, in this process.

It runs the very same wire protocol as lua/main.lua — same arguments, same integer
arithmetic, same reply — so one core serves both and a differential test can hold the two to
identical answers. State is per process: gunicorn or uvicorn with several workers needs Redis.

Expiry is garbage collection only (as in the scripts, every value carries what makes it stale),
so idle identities are forgotten: each written key is scheduled once in a heap by its expiry,
and every call pops a bounded number of due entries.
"""

from __future__ import annotations

import bisect
import heapq
import threading
import time
from collections.abc import Sequence
from typing import Any

from ratelimit_mw.core import ScriptCall

_SWEEP_PER_CALL = 64
# Sorts after every member at the same score (members are ASCII tokens).
_TOP = "\U0010ffff"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _gc_ms(us: int) -> int:
    return 0 if us <= 0 else _ceil_div(us, 1000)


class _Log:
    """A sorted set scored by time: (score, member) pairs kept in order, members indexed."""

    __slots__ = ("entries", "members")

    def __init__(self) -> None:
        self.entries: list[tuple[int, str]] = []
        self.members: dict[str, int] = {}

    def count_above(self, floor: int) -> int:
        """ZCOUNT key (floor +inf"""
        return len(self.entries) - bisect.bisect_right(self.entries, (floor, _TOP))

    def times_above(self, floor: int) -> list[int]:
        start = bisect.bisect_right(self.entries, (floor, _TOP))
        return [score for score, _ in self.entries[start:]]

    def add(self, score: int, member: str) -> None:
        self.remove(member)
        self.members[member] = score
        entry = (score, member)
        if not self.entries or self.entries[-1] < entry:
            self.entries.append(entry)  # the common case: a hit at the newest time
        else:
            bisect.insort(self.entries, entry)

    def remove(self, member: str) -> None:
        score = self.members.pop(member, None)
        if score is not None:
            entry = (score, member)
            del self.entries[bisect.bisect_left(self.entries, entry)]

    def remove_entries(self, start: int, stop: int) -> None:
        for _, member in self.entries[start:stop]:
            del self.members[member]
        del self.entries[start:stop]

    def trim(self, upto: int) -> None:
        """ZREMRANGEBYSCORE key -inf upto"""
        self.remove_entries(0, bisect.bisect_right(self.entries, (upto, _TOP)))


def _sl_peak(ts: Sequence[int], period: int, at: int) -> int:
    """As sl_peak: the windows ending at `at` and at each entry in (at, at + period)."""
    n = len(ts)
    best, lo, hi = 0, 0, -1
    stop = at
    while True:
        while hi < n - 1 and ts[hi + 1] <= stop:
            hi += 1
        while lo <= hi and ts[lo] <= stop - period:
            lo += 1
        best = max(best, hi - lo + 1)
        if hi >= n - 1 or ts[hi + 1] >= at + period:
            return best
        stop = ts[hi + 1]


def _sl_blocked(
    ts: Sequence[int], limit: int, period: int, cost: int, out: list[tuple[int, int]]
) -> list[tuple[int, int]]:
    """As sl_blocked: the booking times at which `cost` more would not fit this tier."""
    full = limit - cost + 1
    n = len(ts)
    i = j = count = 0
    start: int | None = None
    while j < n:
        x = ts[j] + 1
        if i < n and ts[i] - period + 1 < x:
            x = ts[i] - period + 1
        while i < n and ts[i] - period + 1 == x:
            count += 1
            i += 1
        while j < n and ts[j] + 1 == x:
            count -= 1
            j += 1
        if start is None and count >= full:
            start = x
        elif start is not None and count < full:
            out.append((start, x + period - 2))
            start = None
    return out


def _sl_first_free(blocked: list[tuple[int, int]], at: int) -> int:
    """As sl_first_free: the earliest time from `at` on that no blocked interval covers."""
    for first, last in sorted(blocked, key=lambda b: b[0]):
        if first > at:
            break
        if last >= at:
            at = last + 1
    return at


class MemoryBackend:
    """In-process state; thread-safe, usable from sync and async code alike."""

    is_cluster = False

    def __init__(self) -> None:
        self._data: dict[str, Any] = {}
        self._expires: dict[str, int] = {}
        self._heap: list[tuple[int, str]] = []
        self._scheduled: set[str] = set()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"MemoryBackend(keys={len(self._data)})"

    def __len__(self) -> int:
        """How many keys are held (expired ones are dropped as calls sweep)."""
        return len(self._data)

    # -- the I/O surface the limiters use -------------------------------------------------
    def run(self, call: ScriptCall) -> list[int]:
        with self._lock:
            return self._run(call.keys, call.args)

    async def arun(self, call: ScriptCall) -> list[int]:
        # Pure CPU for a few microseconds under a lock held only by such calls: no await needed.
        return self.run(call)

    def close(self) -> None:
        with self._lock:
            self._data.clear()
            self._expires.clear()
            self._heap.clear()
            self._scheduled.clear()

    async def aclose(self) -> None:
        self.close()

    # -- storage with expiry ---------------------------------------------------------------
    def _get(self, key: str, now: int) -> Any:
        expires = self._expires.get(key)
        if expires is None:
            return None
        if expires <= now:
            self._delete(key)
            return None
        return self._data[key]

    def _set(self, key: str, value: Any, now: int, px: int | None) -> None:
        self._data[key] = value
        if px is not None:
            expires = now + px
            self._expires[key] = expires
            if key not in self._scheduled:
                self._scheduled.add(key)
                heapq.heappush(self._heap, (expires, key))

    def _delete(self, key: str) -> None:
        self._data.pop(key, None)
        self._expires.pop(key, None)

    def _sweep(self, now: int) -> None:
        heap = self._heap
        for _ in range(_SWEEP_PER_CALL):
            if not heap or heap[0][0] > now:
                return
            _, key = heapq.heappop(heap)
            expires = self._expires.get(key)
            if expires is None:
                self._scheduled.discard(key)
            elif expires <= now:
                self._delete(key)
                self._scheduled.discard(key)
            else:
                heapq.heappush(heap, (expires, key))

    # -- fixed-window ----------------------------------------------------------------------
    @staticmethod
    def _fw_window(period: int, cal: str, now: int) -> tuple[int, int]:
        if cal:
            prev = None
            for part in cal.split(","):
                b = int(part)
                if prev is not None and prev <= now < b:
                    return prev, b
                prev = b
        start = now - now % period
        return start, start + period

    def _fw_check(self, key: str, limit: int, period: int, cost: int, cal: str, now: int) -> tuple:  # type: ignore[type-arg]
        start, stop = self._fw_window(period, cal, now)
        count = 0
        v = self._get(key, now)
        if v is not None and v[0] == start:
            count = v[1]
        before = max(0, limit - count)
        reset_now = stop - now if count > 0 else 0
        ok = count + cost <= limit
        retry = -1 if cost > limit else (0 if ok else stop - now)
        return ok, before, retry, reset_now, stop - now, (start, count + cost, stop)

    def _fw_refund(self, key: str, period: int, cost: int, cal: str, now: int) -> None:
        start, _ = self._fw_window(period, cal, now)
        v = self._get(key, now)
        if v is not None and v[0] == start:
            self._data[key] = (start, max(0, v[1] - cost))

    # -- sliding-window --------------------------------------------------------------------
    def _sw_state(self, key: str, period: int, now: int) -> tuple[int, int, int, int]:
        start = now - now % period
        curr = prev = 0
        v = self._get(key, now)
        if v is not None:
            if v[0] == start:
                curr, prev = v[1], v[2]
            elif v[0] == start - period:
                prev = v[1]
        return start, now - start, curr, prev

    def _sw_check(self, key: str, limit: int, period: int, cost: int, now: int) -> tuple:  # type: ignore[type-arg]
        start, elapsed, curr, prev = self._sw_state(key, period, now)
        budget = limit * period - prev * (period - elapsed)
        before = max(0, budget // period - curr)
        ok = (curr + cost) * period <= budget
        if curr > 0:
            reset_now = 2 * period - elapsed
        elif prev > 0:
            reset_now = period - elapsed
        else:
            reset_now = 0
        retry = 0
        if cost > limit:
            retry = -1
        elif not ok:
            if curr + cost <= limit:
                retry = period - (limit - curr - cost) * period // prev - elapsed
            else:
                later = max(0, period - (limit - cost) * period // curr)
                retry = period - elapsed + later
        return ok, before, retry, reset_now, 2 * period - elapsed, (start, curr + cost, prev)

    def _sw_refund(self, key: str, period: int, cost: int, now: int) -> None:
        start, elapsed, curr, prev = self._sw_state(key, period, now)
        if curr == 0 and prev == 0:
            return
        back = cost
        if curr >= back:
            curr, back = curr - back, 0
        else:
            back, curr = back - curr, 0
        if back > 0:
            prev = max(0, prev - back)
        self._set(key, (start, curr, prev), now, 2 * period - elapsed)

    # -- gcra ------------------------------------------------------------------------------
    def _gc_tat(self, key: str, now: int, now_us: int) -> int:
        v = self._get(key, now)
        return v if v is not None and v > now_us else now_us

    def _gc_check(
        self, key: str, limit: int, period: int, cost: int, now: int, now_us: int
    ) -> tuple:  # type: ignore[type-arg]
        interval = _ceil_div(period * 1000, limit)
        tolerance = limit * interval
        tat = self._gc_tat(key, now, now_us)
        new_tat = tat + cost * interval
        ok = new_tat - now_us <= tolerance
        before = max(0, (tolerance - (tat - now_us)) // interval)
        retry = -1 if cost > limit else (0 if ok else _gc_ms(new_tat - now_us - tolerance))
        return ok, before, retry, _gc_ms(tat - now_us), _gc_ms(new_tat - now_us), new_tat

    def _gc_refund(
        self, key: str, limit: int, period: int, cost: int, now: int, now_us: int
    ) -> None:
        interval = _ceil_div(period * 1000, limit)
        tat = self._gc_tat(key, now, now_us) - cost * interval
        if tat <= now_us:
            self._delete(key)
        else:
            self._set(key, tat, now, _gc_ms(tat - now_us) + 1)

    # -- sliding-log -----------------------------------------------------------------------
    def _sl_check(self, key: str, limit: int, period: int, cost: int, at: int, now: int) -> tuple:  # type: ignore[type-arg]
        log: _Log | None = self._get(key, now)
        entries = log.entries if log is not None else []
        floor = at - period
        later = log.count_above(at) if log is not None else 0
        ts: list[int] = []
        if later == 0:
            peak = log.count_above(floor) if log is not None else 0
        else:
            ts = log.times_above(floor)  # type: ignore[union-attr]
            peak = _sl_peak(ts, period, at)
        before = max(0, limit - peak)
        ok = peak + cost <= limit
        reset_now, last = 0, at
        if entries and entries[-1][0] > floor:
            last = entries[-1][0]
            reset_now = last + period - now
            last = max(last, at)
        retry = 0
        if cost > limit:
            retry = -1
        elif not ok:
            if later == 0:
                k = peak + cost - limit - 1
                first = bisect.bisect_right(entries, (floor, _TOP))
                retry = entries[first + k][0] + period - at
            else:
                retry = _sl_first_free(_sl_blocked(ts, limit, period, cost, []), at) - at
        return ok, before, retry, reset_now, last + period - now, None

    def _sl_commit(self, key: str, at: int, cost: int, token: str, longest: int, now: int) -> None:
        log: _Log | None = self._get(key, now)
        if log is None:
            log = _Log()
        for j in range(1, cost + 1):
            log.add(at, f"{token}:{j}")
        log.trim(now - longest)
        self._set(key, log, now, log.entries[-1][0] + longest - now)

    def _sl_expire(self, key: str, log: _Log, longest: int, now: int) -> None:
        if log.entries:
            self._set(key, log, now, log.entries[-1][0] + longest - now)
        else:
            self._delete(key)  # Redis drops an empty sorted set

    def _sl_refund(self, key: str, cost: int, token: str, longest: int, now: int) -> None:
        log: _Log | None = self._get(key, now)
        if log is None:
            return
        if token:
            for j in range(1, cost + 1):
                log.remove(f"{token}:{j}")
        else:
            upto = bisect.bisect_right(log.entries, (now, _TOP))
            log.remove_entries(max(0, upto - cost), upto)
        self._sl_expire(key, log, longest, now)

    def _sl_cancel(self, key: str, token: str, cost: int, longest: int, now: int) -> None:
        log: _Log | None = self._get(key, now)
        if log is None:
            return
        for j in range(1, cost + 1):
            log.remove(f"{token}:{j}")
        self._sl_expire(key, log, longest, now)

    def _sl_joint_retry(self, tiers: list[dict[str, Any]], at: int, now: int) -> None:
        """As sl_joint_retry: one log's refusing tiers wait for the first time fitting all."""
        groups: dict[str, list[dict[str, Any]]] = {}
        for t in tiers:
            if t["algo"] == "sl" and t["banned"] == 0:
                groups.setdefault(t["key"], []).append(t)
        for key, group in groups.items():
            if len(group) < 2 or all(t["ok"] for t in group):
                continue
            if any(t["retry"] < 0 for t in group):
                continue
            log: _Log | None = self._get(key, now)
            if log is None or log.count_above(at) == 0:
                continue
            ts = log.times_above(at - max(t["period"] for t in group))
            blocked: list[tuple[int, int]] = []
            for t in group:
                _sl_blocked(ts, t["limit"], t["period"], t["cost"], blocked)
            retry = _sl_first_free(blocked, at) - at
            for t in group:
                if not t["ok"]:
                    t["retry"] = retry

    # -- the entry point, as lua/main.lua ---------------------------------------------------
    def _run(self, keys: Sequence[str], argv: Sequence[Any]) -> list[int]:
        op = argv[0]
        now_us = int(argv[1]) if argv[1] != "" else time.time_ns() // 1000
        now = now_us // 1000
        self._sweep(now)
        token = str(argv[2])
        n = int(argv[4])
        tiers = []
        for i in range(n):
            b = 5 + i * 7
            tiers.append(
                {
                    "algo": argv[b], "limit": int(argv[b + 1]), "period": int(argv[b + 2]),
                    "cost": int(argv[b + 3]), "ban": int(argv[b + 4]), "ban_end": str(argv[b + 5]),
                    "cal": str(argv[b + 6]), "key": keys[i],
                }
            )

        if op == "X":
            for key in keys:
                self._delete(key)
            return [1]

        if op in ("R", "C"):
            spans: dict[str, int] = {}
            for t in tiers:
                if t["algo"] == "sl" and spans.get(t["key"], 0) < t["period"]:
                    spans[t["key"]] = t["period"]
            done: set[str] = set()
            for t in tiers:
                key = t["key"]
                if key in done:
                    continue
                done.add(key)
                if op == "C":
                    if t["algo"] == "sl":
                        self._sl_cancel(key, token, t["cost"], spans[key], now)
                elif t["algo"] == "fw":
                    self._fw_refund(key, t["period"], t["cost"], t["cal"], now)
                elif t["algo"] == "sw":
                    self._sw_refund(key, t["period"], t["cost"], now)
                elif t["algo"] == "gc":
                    self._gc_refund(key, t["limit"], t["period"], t["cost"], now, now_us)
                else:
                    self._sl_refund(key, t["cost"], token, spans[key], now)
            return [1]

        at = now
        if op == "B":
            at = max(int(argv[3]), now)

        bans: dict[int, int] = {}
        all_ok = True
        for t in tiers:
            ban = t["ban"]
            banned = 0
            if ban > 0:
                if ban not in bans:
                    v = self._get(keys[ban - 1], now)
                    bans[ban] = v - now if v is not None and v > now else 0
                if bans[ban] > 0:
                    banned = 1
            if banned:
                left = bans[ban]
                wait = -1 if t["cost"] > t["limit"] else left  # as main.lua: "never" stays
                result: tuple = (False, 0, wait, left, left, None)  # type: ignore[type-arg]
            elif t["algo"] == "fw":
                result = self._fw_check(t["key"], t["limit"], t["period"], t["cost"], t["cal"], now)
            elif t["algo"] == "sw":
                result = self._sw_check(t["key"], t["limit"], t["period"], t["cost"], now)
            elif t["algo"] == "gc":
                result = self._gc_check(t["key"], t["limit"], t["period"], t["cost"], now, now_us)
            else:
                result = self._sl_check(t["key"], t["limit"], t["period"], t["cost"], at, now)
            t["ok"], t["before"], t["retry"], t["reset_now"], t["reset_hit"], t["state"] = result
            t["banned"] = banned
            if not t["ok"]:
                all_ok = False
        if not all_ok:
            self._sl_joint_retry(tiers, at, now)

        reply = [0]
        for t in tiers:
            remaining, reset = t["before"], t["reset_now"]
            if all_ok and op != "P":
                remaining = t["before"] - t["cost"]
                reset = t["reset_hit"]
            reply += (1 if t["ok"] else 0, remaining, t["retry"], reset, t["banned"])

        if op == "P":
            if all_ok:
                reply[0] = 1
            return reply

        if all_ok:
            longest: dict[str, int] = {}
            for t in tiers:
                if t["algo"] == "sl" and longest.get(t["key"], 0) < t["period"]:
                    longest[t["key"]] = t["period"]
            logged: set[str] = set()
            for t in tiers:
                algo, key, state = t["algo"], t["key"], t["state"]
                if algo == "fw":
                    start, count, stop = state
                    self._set(key, (start, count), now, stop - now)
                elif algo == "sw":
                    start, curr, prev = state
                    self._set(key, (start, curr, prev), now, 2 * t["period"] - (now - start))
                elif algo == "gc":
                    self._set(key, state, now, _gc_ms(state - now_us) + 1)
                elif key not in logged:
                    logged.add(key)
                    self._sl_commit(key, at, t["cost"], token, longest[key], now)
            reply[0] = 1
            return reply

        if op == "H":
            for t in tiers:
                ban = t["ban"]
                if not t["ok"] and ban > 0 and bans[ban] == 0 and t["ban_end"]:
                    amount = int(t["ban_end"][1:])
                    stop = now + amount if t["ban_end"][0] == "d" else amount
                    if stop > now:
                        self._set(keys[ban - 1], stop, now, stop - now)
                        bans[ban] = stop - now
            for i, t in enumerate(tiers):
                ban = t["ban"]
                if ban > 0 and bans[ban] > 0:
                    base = 1 + i * 5
                    # A cost above the limit stays "never": waiting out the ban would not admit it.
                    retry = t["retry"] if t["retry"] == -1 else bans[ban]
                    reply[base : base + 5] = [0, 0, retry, bans[ban], 1]
        return reply
