"""MemoryBackend: the script's algorithms in Python, in this process.

It runs the very same wire protocol as lua/main.lua — same arguments, same integer
arithmetic, same reply — so one core serves both and a differential test can hold the two to
identical answers. State is per process: gunicorn or uvicorn with several workers needs Redis.

Expiry is garbage collection only (as in the scripts, every value carries what makes it stale),
so idle identities are forgotten: each written key is scheduled once, at its expiry, in a
schedule of buckets (the keys due in one ms), and every call — admitted or refused, any
operation — looks at due keys: at most 64, plus 16 for every millisecond since the previous
call, dropping the expired ones and scheduling again those written since. Reclaiming thus
keeps pace with time rather than with traffic: a backend that is called seldom (in front of
it a cache answers most refusals) still frees, on its next call, what expired meanwhile (up
to 16,000 keys per idle second, a pause of a few ms), and a busy one spreads the work over
its calls.

It sits on the request path of every app run without Redis, so the common call — a hit or a
peek of one to three tiers, no ban, no calendar — is kept lean: the tiers are read into plain
tuples once (the core passes ints, so conversions happen only for the string forms), each
algorithm's check returns the exact value its commit stores, and the rare work (bans, bookings
ahead, refunds) stays out of the way in functions of its own.
"""

from __future__ import annotations

import bisect
import heapq
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ratelimit_mw.core.plans import ScriptCall
from ratelimit_mw.core.wire import calendar_window

_SWEEP_PER_CALL = 64
_SWEEP_PER_MS = 16
_SWEEP_MAX_MS = 4_096  # at most ~65k entries in one call, however long the backend idled

# One tier of ARGV, read once per call:
#   algorithm, limit, period ms, cost, ban key index (1-based in KEYS, 0: none), ban end,
#   calendar boundaries, the tier's key.
_Tier = tuple[str, int, int, int, int, str, str, str]
# One tier's phase-1 answer: admitted, remaining before the hit, retry ms (-1: never),
# reset ms now, reset ms after the hit, and the value phase 2 stores if every tier admits.
_Result = tuple[bool, int, int, int, int, Any]


def _gc_ms(us: int) -> int:
    return 0 if us <= 0 else -(-us // 1000)


def _read_tier(argv: Sequence[Any], b: int, key: str) -> _Tier:
    """The tier whose seven arguments start at argv[b], numbers as ints."""
    algo, limit, period, cost, ban, ban_end, cal = argv[b : b + 7]
    if (type(limit) is not int or type(period) is not int or type(cost) is not int
            or type(ban) is not int):  # the string forms (a raw ARGV); the core sends ints
        limit, period, cost, ban = int(limit), int(period), int(cost), int(ban)
    return algo, limit, period, cost, ban, ban_end, cal, key


def _read_tiers(keys: Sequence[str], argv: Sequence[Any], n: int) -> list[_Tier]:
    # A loop, not a comprehension: before Python 3.12 a comprehension costs one more function
    # call, a large share of this function's time for a call of a few tiers.
    tiers: list[_Tier] = []
    for i in range(n):
        tiers.append(_read_tier(argv, 5 + 7 * i, keys[i]))  # noqa: PERF401
    return tiers


def _sl_spans(tiers: list[_Tier]) -> dict[str, int]:
    """The longest period of the tiers reading each log: what keeps the log alive."""
    spans: dict[str, int] = {}
    for algo, _, period, _, _, _, _, key in tiers:
        if algo == "sl" and spans.get(key, 0) < period:
            spans[key] = period
    return spans


class _Log:
    """A sorted set scored by time: parallel lists of scores and member names, kept in Redis's
    order (by score, then by member), and the members indexed by name.

    Two flat lists rather than (score, member) pairs: the window counts bisect the scores, and
    bisecting plain ints is twice as fast; a hit of a large cost adds its members without
    building a tuple per member. Within one score the names are sorted, so a member is found
    by bisecting its score's block."""

    __slots__ = ("members", "names", "scores")

    def __init__(self) -> None:
        self.scores: list[int] = []
        self.names: list[str] = []
        self.members: dict[str, int] = {}

    @property
    def entries(self) -> list[tuple[int, str]]:
        """ZRANGE key 0 -1 WITHSCORES, as (score, member) pairs (for inspection)."""
        return list(zip(self.scores, self.names, strict=True))

    def count_above(self, floor: int) -> int:
        """ZCOUNT key (floor +inf"""
        scores = self.scores
        if not scores or scores[-1] <= floor:  # O(1): nothing ahead
            return 0
        if scores[0] > floor:  # O(1): everything (the log is trimmed to the longest window)
            return len(scores)
        return len(scores) - bisect.bisect_right(scores, floor)

    def times_above(self, floor: int) -> list[int]:
        return self.scores[bisect.bisect_right(self.scores, floor) :]

    def _position(self, score: int, member: str) -> int:
        """Where (score, member) is or would go."""
        scores = self.scores
        lo = bisect.bisect_left(scores, score)
        hi = bisect.bisect_right(scores, score, lo)
        return bisect.bisect_left(self.names, member, lo, hi)

    def add(self, score: int, member: str) -> None:
        if member in self.members:
            self.remove(member)
        self.members[member] = score
        scores, names = self.scores, self.names
        if not scores or scores[-1] < score or (scores[-1] == score and names[-1] < member):
            scores.append(score)  # the common case: a hit at the newest time
            names.append(member)
        else:
            i = self._position(score, member)
            scores.insert(i, score)
            names.insert(i, member)

    def add_many(self, score: int, members: list[str]) -> None:
        """ZADD of many members at one score, in O(k log k + n) rather than k inserts.

        Like Redis, entries of equal score are ordered by member (a refund without a token
        takes the last ones), so the new members are sorted and merged into that block."""
        known = self.members
        again = [member for member in members if member in known]
        if again:  # a token used twice (never in practice): ZADD moves those members
            self.remove_many(again)
        new = sorted(members)
        known.update(dict.fromkeys(members, score))
        scores, names = self.scores, self.names
        if not scores or scores[-1] < score or (scores[-1] == score and names[-1] < new[0]):
            scores += [score] * len(new)  # the common case: after everything logged
            names += new
            return
        lo = bisect.bisect_left(scores, score)
        hi = bisect.bisect_right(scores, score, lo)
        block = names[lo:hi]
        block += new
        block.sort()  # two sorted runs: one linear merge
        names[lo:hi] = block
        scores[lo:hi] = [score] * len(block)

    def remove(self, member: str) -> None:
        score = self.members.pop(member, None)
        if score is not None:
            i = self._position(score, member)
            del self.scores[i]
            del self.names[i]

    def remove_many(self, members: list[str]) -> None:
        """ZREM of many members in one pass over the span of their scores."""
        known = self.members
        gone: dict[str, int] = {}
        for member in members:
            score = known.pop(member, None)
            if score is not None:
                gone[member] = score
        if not gone:
            return
        scores, names = self.scores, self.names
        lo = bisect.bisect_left(scores, min(gone.values()))
        hi = bisect.bisect_right(scores, max(gone.values()), lo)
        kept = [i for i in range(lo, hi) if names[i] not in gone]
        names[lo:hi] = [names[i] for i in kept]
        scores[lo:hi] = [scores[i] for i in kept]

    def remove_entries(self, start: int, stop: int) -> None:
        members = self.members
        for member in self.names[start:stop]:
            del members[member]
        del self.names[start:stop]
        del self.scores[start:stop]

    def trim(self, upto: int) -> None:
        """ZREMRANGEBYSCORE key -inf upto"""
        scores = self.scores
        if scores and scores[0] > upto:  # O(1) when nothing has left the window
            return
        self.remove_entries(0, bisect.bisect_right(scores, upto))


def _longest_periods(writes: list[tuple[str, Any, int, int]]) -> dict[str, int]:
    """The longest period of each sliding log among `_hit`'s writes (minus the period as
    their ms to live)."""
    longest: dict[str, int] = {}
    for key, _, px, _ in writes:
        if px < 0 and longest.get(key, 0) < -px:
            longest[key] = -px
    return longest


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


_CheckFn = Callable[[str, int, int, int, str, int, int, int], _Result]


class _Checks(dict[str, _CheckFn]):
    """Phase 1 by algorithm code; as main.lua, a code it does not know reads a sliding log."""

    def __missing__(self, code: str) -> _CheckFn:
        return self["sl"]


class MemoryBackend:
    """In-process state; thread-safe, usable from sync and async code alike."""

    is_cluster = False
    in_process = True

    def __init__(self) -> None:
        self._data: dict[str, Any] = {}
        self._expires: dict[str, int] = {}
        # The sweep's schedule, when to look at which key: a bucket of keys per ms
        # (`_due`), a heap of the ms that have one (`_due_times`), and every key in a bucket,
        # once (`_scheduled`). Keys due in the same ms share a bucket (every fixed-window
        # key of one window, a crowd's keys written in one ms), so scheduling a key is
        # mostly an append and the heap is paid per ms with int comparisons, where a heap
        # of (ms, key) pairs costs a push and a pop per key that expired and came back:
        # most of a returning identity's hit where its keys live a few ms (gcra far from
        # its limit).
        self._due: dict[int, list[str]] = {}
        self._due_times: list[int] = []
        self._scheduled: set[str] = set()
        self._called_at = 0  # the `now` (ms) of the last call: a sweep's budget grows with time
        self._lock = threading.Lock()
        # Phase 1 of each algorithm (as main.lua, any other code reads a sliding log), one
        # signature for all: a lookup, not a chain of tests in a frame of its own.
        self._checks = _Checks(fw=self._fw_check, sw=self._sw_check, gc=self._gc_check,
                               sl=self._sl_check)

    def __repr__(self) -> str:
        return f"MemoryBackend(keys={len(self._data)})"

    def __len__(self) -> int:
        """How many keys are held (expired ones are dropped as calls sweep)."""
        return len(self._data)

    # -- the I/O surface the limiters use -------------------------------------------------
    def run(self, call: ScriptCall) -> list[int]:
        """One call, as lua/main.lua answers it."""
        keys: Sequence[str] = call.keys
        argv: Sequence[Any] = call.args  # ints from the core, text from a raw caller
        with self._lock:
            op = argv[0]
            # The call's clock (µs and ms: ARGV[2], "" for this process's clock, as Redis's
            # TIME), and the sweep every call makes before it reads anything.
            now_us = argv[1]
            if type(now_us) is not int:
                now_us = time.time_ns() // 1000 if now_us == "" else int(now_us)
            now = now_us // 1000
            due_times = self._due_times
            if due_times and due_times[0] <= now:  # O(1) when nothing is due
                self._sweep(now, now - self._called_at)
            self._called_at = now
            token = argv[2]
            if op == "H":  # the request's call, first
                return self._hit(keys, argv, token, now, now_us)
            n = argv[4]
            if type(n) is not int:
                n = int(n)
            if op == "X":
                for key in keys:
                    self._delete(key)
                return [1]
            if op == "R" or op == "C":
                self._give_back(op, _read_tiers(keys, argv, n), token, now, now_us)
                return [1]
            # P, B (and, as main.lua, anything else): decide.
            at = max(int(argv[3]), now) if op == "B" else now
            if n == 1:
                # _read_tier inlined for the call the core sends most (ints, no penalty: nothing
                # but this tier to read or write); any other form takes the general path.
                algo, limit, period, cost, ban, ban_end, cal = argv[5:12]
                if ban == 0 and type(limit) is int and type(period) is int and type(cost) is int:
                    return self._decide_one(op, (algo, limit, period, cost, 0, ban_end, cal,
                                                 keys[0]), token, at, now, now_us)
            return self._decide(op, keys, _read_tiers(keys, argv, n), token, at, now, now_us)

    def _hit(self, keys: Sequence[str], argv: Sequence[Any], token: str, now: int,
             now_us: int) -> list[int]:
        """A hit (H): while every tier admits, each is checked inline (a log's hit of a
        larger cost through `_sl_check`) and nothing is stored until every tier admits,
        without `_decide`'s bookkeeping for bans and refusals; a refusal, a penalty, a
        calendar, a booking ahead in a log or arguments given as text are decided by
        `_decide` from the same state. The differential test holds both to main.lua."""
        data, expires = self._data, self._expires
        reply = [1]
        # What phase 2 stores if every tier admits: (key, value, ms to live, cost); a
        # sliding log's tier gives minus its period instead: the log is stored once, by the
        # first of its tiers, to live for the longest of their periods, as _commit.
        writes: list[tuple[str, Any, int, int]] = []
        logs = 0  # sliding-log tiers among them
        value: Any  # each algorithm's stored state
        b = 5
        for key in keys:  # ban keys follow the tiers: a tier with a ban breaks first
            algo, limit, period, cost, ban, _, cal = argv[b : b + 7]
            b += 7
            if ban or type(cost) is not int or type(limit) is not int:
                break  # a penalty, or a raw ARGV's text: _decide reads it
            # The admitted case of each O(1) algorithm's check, inline: the call cost
            # more than the check. An expired key reads as none, and is overwritten below
            # or, on a refusal, read again (and dropped) by _decide, from the same state.
            # Each branch's arithmetic is its check's where `ok` holds, which makes the
            # check's clamps no-ops: remaining >= 0, retry 0, the cost within the limit.
            if algo == "sl":
                if cost == 1:
                    # The usual hit: one entry at `now`. With nothing booked ahead the
                    # window ending now is the fullest, and the hit's reset one period;
                    # a booking ahead is weighed by _decide, as a refusal is.
                    value = data[key] if expires.get(key, now) > now else None
                    peak = 0
                    if value is not None and (scores := value.scores):
                        if scores[-1] > now:
                            break
                        floor = now - period
                        peak = len(scores) if scores[0] > floor else value.count_above(floor)
                    if peak >= limit:
                        break
                    reply += (1, limit - peak - 1, 0, period, 0)
                else:
                    ok, before, retry, _, reset, value = self._sl_check(
                        key, limit, period, cost, cal, now, now, now_us)
                    if not ok:
                        break
                    # As _decide's reply for a hit it records: remaining and reset after.
                    reply += (1, before - cost, retry, reset, 0)
                logs += 1
                writes.append((key, value, -period, cost))
            elif algo == "fw" and not cal:
                start = now - now % period
                count = 0
                if expires.get(key, now) > now and (value := data[key])[0] == start:
                    count = value[1]
                if count + cost > limit:
                    break
                reset = start + period - now
                reply += (1, limit - count - cost, 0, reset, 0)
                writes.append((key, (start, count + cost), reset, cost))
            elif algo == "gc":
                interval = -(-period * 1000 // limit)
                tolerance = limit * interval
                ahead = 0  # how far the TAT is ahead of now (µs)
                if expires.get(key, now) > now and (value := data[key]) > now_us:
                    ahead = value - now_us
                after = ahead + cost * interval
                if after > tolerance:
                    break
                reset = -(-after // 1000)
                reply += (1, (tolerance - ahead) // interval - cost, 0, reset, 0)
                writes.append((key, now_us + after, reset + 1, cost))
            elif algo == "sw":
                start = now - now % period
                curr = prev = 0
                if expires.get(key, now) > now:
                    value = data[key]
                    if value[0] == start:
                        curr, prev = value[1], value[2]
                    elif value[0] == start - period:
                        prev = value[1]
                elapsed = now - start
                budget = limit * period - prev * (period - elapsed)
                if (curr + cost) * period > budget:
                    break
                reset = 2 * period - elapsed
                reply += (1, budget // period - curr - cost, 0, reset, 0)
                writes.append((key, (start, curr + cost, prev), reset, cost))
            else:  # a calendar, a code the core never sends: _decide's, as run's
                break
        else:
            # Every tier admits: phase 2.
            scheduled = self._scheduled
            spans: dict[str, int] | None = None  # several log tiers: each log's longest period
            for key, value, px, cost in writes:
                if px >= 0:
                    # _set, inline (a frame per tier was a tenth of this call).
                    data[key] = value
                    expires[key] = until = now + px
                    if key not in scheduled:
                        self._schedule(key, until)
                elif logs == 1:
                    self._sl_commit(key, value, now, cost, token, -px, now)
                else:
                    if spans is None:
                        spans = _longest_periods(writes)
                    if (longest := spans.pop(key, None)) is not None:
                        self._sl_commit(key, value, now, cost, token, longest, now)
            return reply
        # A tier refuses (or is not one of the shapes above). Nothing was stored:
        # _decide decides again from the same state.
        return self._decide("H", keys, _read_tiers(keys, argv, int(argv[4])), token, now,
                            now, now_us)

    async def arun(self, call: ScriptCall) -> list[int]:
        # Pure CPU for a few microseconds under a lock held only by such calls: no await needed.
        return self.run(call)

    def close(self) -> None:
        with self._lock:
            self._data.clear()
            self._expires.clear()
            self._due.clear()
            self._due_times.clear()
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

    def _set(self, key: str, value: Any, now: int, px: int) -> None:
        self._data[key] = value
        expires = now + px
        self._expires[key] = expires
        if key not in self._scheduled:
            self._schedule(key, expires)

    def _schedule(self, key: str, at: int) -> None:
        """Have the sweep look at `key` at `at` (ms). For a key not in the schedule (the
        callers ask `_scheduled` first, inline: a key written again keeps its place, and the
        sweep, finding it written since, files it again at its new expiry)."""
        self._scheduled.add(key)
        self._file(key, at)

    def _file(self, key: str, at: int) -> None:
        """Put `key` in the bucket of `at`, opening it if none: a key already counted in
        `_scheduled`, taken out of its bucket by the sweep, or just added by `_schedule`."""
        bucket = self._due.get(at)
        if bucket is None:
            self._due[at] = [key]
            heapq.heappush(self._due_times, at)
        else:
            bucket.append(key)

    def _delete(self, key: str) -> None:
        self._data.pop(key, None)
        self._expires.pop(key, None)

    def _sweep(self, now: int, idle: int) -> None:
        """Look at due keys, 64, plus 16 per ms the backend sat `idle` since its last call:
        drop each one expired, schedule again each one written since (at its new expiry)."""
        budget = _SWEEP_PER_CALL + _SWEEP_PER_MS * min(max(0, idle), _SWEEP_MAX_MS)
        due_times, due, expiry_of = self._due_times, self._due, self._expires
        scheduled = self._scheduled
        while due_times and (at := due_times[0]) <= now:
            bucket = due[at]
            while bucket:
                if not budget:
                    return
                budget -= 1
                key = bucket.pop()
                expiry = expiry_of.get(key)
                if expiry is None:  # deleted since (a reset, a log refunded empty, read expired)
                    scheduled.discard(key)
                elif expiry <= now:
                    self._delete(key)
                    scheduled.discard(key)
                else:  # written again since: due later (expiry > now >= at: another bucket)
                    self._file(key, expiry)
            heapq.heappop(due_times)
            del due[at]

    # -- fixed-window: the value is (window start, count) -----------------------------------
    @staticmethod
    def _fw_window(period: int, cal: str, now: int) -> tuple[int, int]:
        if cal:
            return calendar_window(cal, period, now)
        start = now - now % period
        return start, start + period

    def _fw_check(self, key: str, limit: int, period: int, cost: int, cal: str, at: int,
                  now: int, now_us: int) -> _Result:
        if cal:
            start, stop = self._fw_window(period, cal, now)
        else:  # _fw_window's epoch-aligned case, without the call
            start = now - now % period
            stop = start + period
        count = 0
        v = self._get(key, now)
        if v is not None and v[0] == start:
            count = v[1]
        ok = count + cost <= limit
        retry = -1 if cost > limit else (0 if ok else stop - now)
        return (ok, max(0, limit - count), retry, stop - now if count > 0 else 0, stop - now,
                (start, count + cost))

    def _fw_stable(self, period: int, cal: str, now: int) -> int:
        """As fw stable: ms until the window ends."""
        return self._fw_window(period, cal, now)[1] - now

    def _fw_refund(self, key: str, period: int, cost: int, cal: str, now: int) -> None:
        start, _ = self._fw_window(period, cal, now)
        v = self._get(key, now)
        if v is not None and v[0] == start:
            self._data[key] = (start, max(0, v[1] - cost))  # KEEPTTL, as the script

    # -- sliding-window: the value is (current window start, curr, prev) --------------------
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

    def _sw_check(self, key: str, limit: int, period: int, cost: int, cal: str, at: int,
                  now: int, now_us: int) -> _Result:
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

    def _sw_stable(self, key: str, period: int, now: int) -> int:
        """As sw stable: ms until the window ends or the previous window's weight drops."""
        _, elapsed, _, prev = self._sw_state(key, period, now)
        weight = -(-prev * (period - elapsed) // period)
        if weight < 1:
            return period - elapsed
        return period - (weight - 1) * period // prev - elapsed

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

    # -- gcra: the value is the TAT in µs ----------------------------------------------------
    def _gc_tat(self, key: str, now: int, now_us: int) -> int:
        v = self._get(key, now)
        return v if v is not None and v > now_us else now_us

    def _gc_check(self, key: str, limit: int, period: int, cost: int, cal: str, at: int,
                  now: int, now_us: int) -> _Result:
        interval = -(-period * 1000 // limit)  # ceil
        tolerance = limit * interval
        # _gc_tat and _gc_ms inlined: three calls per tier are a large share of a hit.
        # How far the TAT is ahead of now, never negative, before the hit and after it.
        v = self._get(key, now)
        ahead = v - now_us if v is not None and v > now_us else 0
        after = ahead + cost * interval
        ok = after <= tolerance
        before = max(0, (tolerance - ahead) // interval)
        retry = -1 if cost > limit else (0 if ok else _gc_ms(after - tolerance))
        return (ok, before, retry, -(-ahead // 1000), -(-after // 1000) if after > 0 else 0,
                now_us + after)

    def _gc_stable(self, key: str, limit: int, period: int, cost: int, now: int,
                   now_us: int) -> tuple[int, int, int]:
        """As gcra stable: µs to the next emission step (-1: none), exact retry and reset."""
        interval = -(-period * 1000 // limit)
        tolerance = limit * interval
        ahead = self._gc_tat(key, now, now_us) - now_us
        retry = 0
        if cost > limit:
            retry = -1
        elif ahead + cost * interval > tolerance:
            retry = ahead + cost * interval - tolerance
        if ahead == 0:
            return -1, retry, 0
        step = (tolerance - ahead) // interval + 1
        return ahead - tolerance + step * interval, retry, ahead

    def _gc_refund(self, key: str, limit: int, period: int, cost: int, now: int,
                   now_us: int) -> None:
        interval = -(-period * 1000 // limit)
        tat = self._gc_tat(key, now, now_us) - cost * interval
        if tat <= now_us:
            self._delete(key)
        else:
            self._set(key, tat, now, _gc_ms(tat - now_us) + 1)

    # -- sliding-log: the value is a _Log ------------------------------------------------------
    def _sl_check(self, key: str, limit: int, period: int, cost: int, cal: str, at: int,
                  now: int, now_us: int) -> _Result:
        log: _Log | None = self._get(key, now)
        if log is None or not log.scores:  # nothing logged: the whole quota, no wait
            return (cost <= limit, max(0, limit), -1 if cost > limit else 0, 0,
                    at + period - now, None)
        scores = log.scores
        floor = at - period
        newest = scores[-1]
        ahead = newest > at  # bookings ahead of `at`
        ts: list[int] = []
        if not ahead:  # the window ending at `at` is the fullest: count it
            peak = len(scores) if scores[0] > floor else log.count_above(floor)
        else:
            ts = log.times_above(floor)
            peak = _sl_peak(ts, period, at)
        ok = peak + cost <= limit
        reset_now, last = 0, at
        if newest > floor:
            reset_now = newest + period - now
            last = max(newest, at)
        retry = 0
        if cost > limit:
            retry = -1
        elif not ok:
            if not ahead:
                # The (peak + cost - limit)-th oldest hit in the window must leave it.
                k = peak + cost - limit - 1
                retry = scores[bisect.bisect_right(scores, floor) + k] + period - at
            else:
                retry = _sl_first_free(_sl_blocked(ts, limit, period, cost, []), at) - at
        return ok, max(0, limit - peak), retry, reset_now, last + period - now, log

    def _sl_commit(self, key: str, log: _Log | None, at: int, cost: int, token: str,
                   longest: int, now: int) -> None:
        if log is None:
            log = _Log()
        if cost == 1:
            log.add(at, token + ":1")
        else:
            log.add_many(at, [f"{token}:{j}" for j in range(1, cost + 1)])
        scores = log.scores
        if scores[0] <= now - longest:  # something has left the longest window
            log.trim(now - longest)
        # _set, inline: a log is committed on every sliding-log hit.
        self._data[key] = log
        self._expires[key] = until = scores[-1] + longest
        if key not in self._scheduled:
            self._schedule(key, until)

    def _sl_stable(self, key: str, period: int, now: int) -> int:
        """As sl stable: ms until the oldest entry in (now - period, now] leaves (-1: none)."""
        log: _Log | None = self._get(key, now)
        if log is None:
            return -1
        i = bisect.bisect_right(log.scores, now - period)
        return log.scores[i] + period - now if i < len(log.scores) else -1

    def _sl_expire(self, key: str, log: _Log, longest: int, now: int) -> None:
        if log.scores:
            self._set(key, log, now, log.scores[-1] + longest - now)
        else:
            self._delete(key)  # Redis drops an empty sorted set

    def _sl_refund(self, key: str, cost: int, token: str, longest: int, now: int) -> None:
        log: _Log | None = self._get(key, now)
        if log is None:
            return
        if token:
            log.remove_many([f"{token}:{j}" for j in range(1, cost + 1)])
        else:
            upto = bisect.bisect_right(log.scores, now)
            log.remove_entries(max(0, upto - cost), upto)
        self._sl_expire(key, log, longest, now)

    def _sl_cancel(self, key: str, token: str, cost: int, longest: int, now: int) -> None:
        log: _Log | None = self._get(key, now)
        if log is None:
            return
        log.remove_many([f"{token}:{j}" for j in range(1, cost + 1)])
        self._sl_expire(key, log, longest, now)

    def _sl_joint_retry(self, tiers: list[_Tier], results: list[_Result],
                        starts: list[int], at: int, now: int) -> None:
        """As sl_joint_retry: one log's refusing tiers wait for the first time fitting all,
        each from its `starts` (`at`, or the end of its ban: then a log of one tier too)."""
        groups: dict[str, list[int]] = {}
        for i, tier in enumerate(tiers):
            if tier[0] == "sl":
                groups.setdefault(tier[7], []).append(i)
        for key, group in groups.items():
            if all(results[i][0] for i in group):
                continue
            if any(results[i][2] < 0 for i in group):
                continue
            if len(group) < 2 and starts[group[0]] <= at:
                continue
            log: _Log | None = self._get(key, now)
            if log is None or log.count_above(at) == 0:
                continue
            ts = log.times_above(at - max(tiers[i][2] for i in group))
            blocked: list[tuple[int, int]] = []
            for i in group:
                _, limit, period, cost, *_ = tiers[i]
                _sl_blocked(ts, limit, period, cost, blocked)
            for i in group:
                ok, before, _, reset_now, reset_hit, state = results[i]
                if not ok:
                    retry = _sl_first_free(blocked, starts[i]) - at
                    results[i] = (ok, before, retry, reset_now, reset_hit, state)

    # -- the entry point, as lua/main.lua ---------------------------------------------------
    def _give_back(self, op: str, tiers: list[_Tier], token: str, now: int,
                   now_us: int) -> None:
        """Refund (R) or cancel a booking (C): once per key, as main.lua."""
        spans = _sl_spans(tiers)
        done: set[str] = set()
        for algo, limit, period, cost, _, _, cal, key in tiers:
            if key in done:
                continue
            done.add(key)
            if op == "C":
                if algo == "sl":
                    self._sl_cancel(key, token, cost, spans[key], now)
            elif algo == "fw":
                self._fw_refund(key, period, cost, cal, now)
            elif algo == "sw":
                self._sw_refund(key, period, cost, now)
            elif algo == "gc":
                self._gc_refund(key, limit, period, cost, now, now_us)
            else:
                self._sl_refund(key, cost, token, spans[key], now)

    def _ban_left(self, bans: dict[int, int], keys: Sequence[str], ban: int, now: int) -> int:
        """Ms left of the ban in KEYS[ban] (0: none), read once per call per ban key."""
        left = bans.get(ban)
        if left is None:
            v = self._get(keys[ban - 1], now)
            left = bans[ban] = v - now if v is not None and v > now else 0
        return left

    def _store(self, tier: _Tier, result: _Result, longest: int, at: int, token: str,
               now: int) -> None:
        """Phase 2 for one tier: store the value its check computed. A counter or a TAT lives
        exactly until its quota is whole again, which is the reply's reset after the hit (a
        TAT one ms more: Redis expires at ms granularity, the TAT is in µs); a log lives until
        its newest entry has left the `longest` window reading it."""
        algo, _, _, cost, _, _, _, key = tier
        if algo == "sl":
            self._sl_commit(key, result[5], at, cost, token, longest, now)
        else:
            self._set(key, result[5], now, result[4] + 1 if algo == "gc" else result[4])

    def _decide_one(self, op: str, tier: _Tier, token: str, at: int, now: int,
                    now_us: int) -> list[int]:
        """_decide for the common call: one tier and no penalty, so no ban to read or start,
        no joint retry, and its own answer is the call's."""
        # _store inlined: a sixth of this call's time went to that frame.
        algo, limit, period, cost, _, _, cal, key = tier
        ok, before, retry, reset_now, reset_hit, state = self._checks[algo](
            key, limit, period, cost, cal, at, now, now_us)
        if not ok:
            reply = [0, 0, before, retry, reset_now, 0]
            if op == "H":
                self._stability([tier], [0], {}, reply, now, now_us)
            return reply
        if op == "P":
            return [1, 1, before, retry, reset_now, 0]
        if algo == "sl":
            self._sl_commit(key, state, at, cost, token, period, now)
        else:
            self._set(key, state, now, reset_hit + 1 if algo == "gc" else reset_hit)
        return [1, 1, before - cost, retry, reset_hit, 0]

    def _decide(self, op: str, keys: Sequence[str], tiers: list[_Tier], token: str, at: int,
                now: int, now_us: int) -> list[int]:
        """Hit (H), peek (P) or book (B): phase 1 decides every tier, phase 2 records."""
        bans: dict[int, int] = {}
        banned: list[int] | None = None  # per tier, 1: banned (built only when one is)
        results: list[_Result] = []
        all_ok = True
        for i, tier in enumerate(tiers):
            algo, limit, period, cost, ban, _, cal, key = tier
            if ban > 0 and self._ban_left(bans, keys, ban, now) > 0:
                if banned is None:
                    banned = [0] * len(tiers)
                banned[i] = 1
            # A banned tier is checked too (reading only), as main.lua: its own wait bounds
            # when a retry is admitted once the ban is over (_banned_answers).
            result = self._checks[algo](key, limit, period, cost, cal, at, now, now_us)
            if not result[0]:
                all_ok = False
            results.append(result)
        if banned is not None:
            all_ok = False
        if all_ok:
            # Remaining and reset describe the state after this call: after the hit if
            # recorded.
            if op == "P":
                reply = [1]
                for _, before, retry, reset_now, _, _ in results:
                    reply += (1, before, retry, reset_now, 0)
                return reply
            reply = [1]
            for i, (_, before, retry, _, reset_hit, _) in enumerate(results):
                reply += (1, before - tiers[i][3], retry, reset_hit, 0)
            self._commit(tiers, results, at, token, now)
            return reply
        if bans:
            if op == "H":
                self._start_bans(keys, tiers, results, bans, now)
            banned = self._banned_answers(tiers, results, bans, at, now)
        elif len(tiers) > 1:
            self._sl_joint_retry(tiers, results, [at] * len(tiers), at, now)
        if banned is None:
            banned = [0] * len(tiers)
        # Refused: the reply describes the state as it stands.
        reply = [0]
        for i, (ok, before, retry, reset_now, _, _) in enumerate(results):
            reply += (1 if ok else 0, before, retry, reset_now, banned[i])
        if op == "H":
            self._stability(tiers, banned, bans, reply, now, now_us)
        return reply

    def _stability(self, tiers: list[_Tier], banned: list[int], bans: dict[int, int],
                   reply: list[int], now: int, now_us: int) -> None:
        """As main.lua for a refused hit: append, per tier, how long (µs) its numbers hold,
        and its exact retry and reset in µs, for the client's deny cache. `banned`: the tiers
        under a ban (`bans`: ms left per ban index)."""
        phase = now_us - now * 1000

        def us(ms: int) -> int:
            return ms * 1000 - phase if ms > 0 else ms

        # As the script's `tied`: a sliding-log tier whose log has entries ahead.
        tied = False
        for algo, *_, key in tiers:
            if algo == "sl":
                log: _Log | None = self._get(key, now)
                if log is not None and log.scores and log.scores[-1] > now:
                    tied = True
        extra: list[int] = []
        for i, (algo, limit, period, cost, ban, _, cal, key) in enumerate(tiers):
            k = 5 * i
            retry: int | None = None
            reset = 0
            if banned[i]:
                # Every number holds until the ban ends; retry and reset, the later of the
                # ban's end and the tier's own, count down.
                stable = left = us(bans[ban])
                if algo == "gc":
                    _, retry, reset = self._gc_stable(key, limit, period, cost, now, now_us)
                    if retry != -1 and retry < left:
                        retry = left
                    reset = max(reset, left)
            elif reply[k + 1] == 0 and ban > 0:
                stable = 0
            elif algo == "sl":
                stable = 0 if tied else us(self._sl_stable(key, period, now))
            elif algo == "fw":
                stable = us(self._fw_stable(period, cal, now))
            elif algo == "gc":
                stable, retry, reset = self._gc_stable(key, limit, period, cost, now, now_us)
            else:
                stable = us(self._sw_stable(key, period, now))
            if retry is None:
                retry, reset = us(reply[k + 3]), us(reply[k + 4])
            extra += (stable, retry, reset)
        reply += extra

    def _commit(self, tiers: list[_Tier], results: list[_Result], at: int, token: str,
                now: int) -> None:
        """Phase 2: every tier admits, so store what each check computed; a log once, by the
        first of its tiers."""
        spans: dict[str, int] | None = None
        for tier, result in zip(tiers, results, strict=True):
            if tier[0] != "sl":
                self._store(tier, result, 0, at, token, now)
                continue
            if spans is None:
                spans = _sl_spans(tiers)
            longest = spans.pop(tier[7], None)
            if longest is not None:
                self._store(tier, result, longest, at, token, now)

    def _start_bans(self, keys: Sequence[str], tiers: list[_Tier], results: list[_Result],
                    bans: dict[int, int], now: int) -> None:
        """A refused hit starts the ban of each refusing policy that has a penalty."""
        for i, (_, _, _, _, ban, ban_end, _, _) in enumerate(tiers):
            if not results[i][0] and ban > 0 and bans[ban] == 0 and ban_end:
                amount = int(ban_end[1:])
                stop = now + amount if ban_end[0] == "d" else amount
                if stop > now:
                    self._set(keys[ban - 1], stop, now, stop - now)
                    bans[ban] = stop - now

    def _banned_answers(self, tiers: list[_Tier], results: list[_Result],
                        bans: dict[int, int], at: int, now: int) -> list[int]:
        """As main.lua: every tier of a banned policy refuses with nothing left; its retry is
        the later of the ban's end and its own wait (a cost above the limit stays "never"),
        its reset the later of the ban's end and its own; then one log's tiers are tied by
        bookings ahead, a banned tier's search starting at its ban's end. Returns, per tier,
        1 if banned."""
        banned = [0] * len(tiers)
        starts = [at] * len(tiers)
        for i, tier in enumerate(tiers):
            ban = tier[4]
            if ban > 0 and (left := bans[ban]) > 0:
                banned[i] = 1
                _, _, retry, reset_now, reset_hit, state = results[i]
                if retry != -1 and retry < left:
                    retry = left
                results[i] = (False, 0, retry, max(reset_now, left), reset_hit, state)
                if now + left > at:
                    starts[i] = now + left
        self._sl_joint_retry(tiers, results, starts, at, now)
        return banned

    # -- the start-up check (``Limiter.ping``), the same answer as the Redis backends' -----
    def ping(self) -> dict[str, Any]:
        """Always reachable: this process. No script is loaded, so ``script_sha`` is empty."""
        return {"backend": "memory", "version": None, "cluster": False, "nodes": 1,
                "rtt_ms": 0.0, "script_sha": ""}

    async def aping(self) -> dict[str, Any]:
        return self.ping()
