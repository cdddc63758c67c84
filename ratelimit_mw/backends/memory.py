"""MemoryBackend: the script's algorithms in Python, in this process.

It runs the very same wire protocol as lua/main.lua — same arguments, same integer
arithmetic, same reply — so one core serves both and a differential test
(tests/test_differential.py) holds the two to identical answers. State is per process:
gunicorn or uvicorn with several workers needs Redis.

Every call that decides (hit, peek, booking) takes one path, main.lua's: phase 1 asks each
tier's algorithm — `_fw_check`, `_sw_check`, `_gc_check`, `_sl_check`, `_cc_check`,
mirrors of lua/<algorithm>.lua with one signature, looked up by code — and writes nothing;
phase 2 stores what the checks computed if every tier admits (a counter or a TAT as main.lua
SETs it, a sliding log through `_sl_commit`, slots through `_cc_take`); a refusal goes on to
the bans, the joint retry of one log's tiers and the deny cache's figures. That path runs on
every request of an app without Redis, so it reads ARGV in place, makes one call per tier
(its check, which returns a plain tuple: the reply's numbers and the exact value phase 2
stores) and keeps the rarer work (bans, refusals, refunds) in functions of its own.

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

import bisect
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ratelimit_mw.core.plans import ScriptCall
from ratelimit_mw.core.wire import calendar_window

_SWEEP_PER_CALL = 64
_SWEEP_PER_MS = 16
_SWEEP_MAX_MS = 4_096  # at most ~65k entries in one call, however long the backend idled

# Reset, refund (an in-flight tier: give its slots back), cancel a booking, renew leases: the
# operations that decide nothing.
_UPKEEP = frozenset(("X", "R", "C", "N"))
# One tier of ARGV: algorithm, limit, period ms, cost, ban key index (1-based in KEYS, 0:
# none), ban end, calendar schedule, then the tier's key.
_Tier = tuple[str, int, int, int, int, str, str, str]
# A check's answer, as the scripts' checks: admitted, remaining before the hit, retry ms (-1:
# never), reset ms now, reset ms after the hit, then the value phase 2 stores and its ms to
# live (a sliding log: the log as read, or None, and 0: `_sl_commit` writes it).
_Result = tuple[bool, int, int, int, int, Any, int]


def _read_tiers(keys: Sequence[str], argv: Sequence[Any], n: int) -> list[_Tier]:
    """Each tier's seven arguments and its key (for a refusal and the upkeep operations)."""
    tiers: list[_Tier] = []
    for i in range(n):
        algo, limit, period, cost, ban, ban_end, cal = argv[5 + 7 * i : 12 + 7 * i]
        tiers.append((algo, limit, period, cost, ban, ban_end, cal, keys[i]))
    return tiers


def _from_text(argv: Sequence[Any]) -> list[Any]:
    """A raw ARGV, all text as a Redis client sends it, with the numbers the core sends as
    ints (the clock and the booking time are read where they are used)."""
    out = list(argv)
    out[4] = n = int(argv[4])
    for b in range(5, 5 + 7 * n, 7):
        out[b + 1 : b + 5] = map(int, argv[b + 1 : b + 5])
    return out


def _members(token: str, cost: int) -> list[str]:
    """The log's members for one call: "<token>:1" .. "<token>:<cost>"."""
    return [f"{token}:{j}" for j in range(1, cost + 1)]


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
    bisecting plain ints is twice as fast. Within one score the names are sorted, so a
    block of one score is found by bisecting the scores."""

    __slots__ = ("members", "names", "scores")

    def __init__(self) -> None:
        self.scores: list[int] = []
        self.names: list[str] = []
        self.members: dict[str, int] = {}

    @property
    def entries(self) -> list[tuple[int, str]]:
        """ZRANGE key 0 -1 WITHSCORES, as (score, member) pairs (for inspection)."""
        return list(zip(self.scores, self.names, strict=True))

    def times_above(self, floor: int) -> list[int]:
        return self.scores[bisect.bisect_right(self.scores, floor) :]

    def add(self, score: int, members: list[str]) -> None:
        """ZADD of `members` at one score: appended after everything logged (the usual hit),
        else sorted and merged into that score's block, in O(k log k + n) rather than k
        inserts (Redis orders one score's members by name: a refund without a token takes
        the last ones)."""
        known = self.members
        scores, names = self.scores, self.names
        if len(members) == 1:
            member = members[0]
            if member in known:  # a token used twice: ZADD moves it
                self.remove(members)
            known[member] = score
            if not scores or scores[-1] < score or (scores[-1] == score and names[-1] < member):
                scores.append(score)
                names.append(member)
                return
        else:
            members = sorted(members)
            if not known.keys().isdisjoint(members):
                self.remove(members)
            known.update(dict.fromkeys(members, score))
        lo = bisect.bisect_left(scores, score)
        hi = bisect.bisect_right(scores, score, lo)
        block = names[lo:hi] + members
        block.sort()  # two sorted runs: one linear merge
        names[lo:hi] = block
        scores[lo:hi] = [score] * len(block)

    def remove(self, members: list[str]) -> None:
        """ZREM of `members` in one pass over the span of their scores."""
        known = self.members
        gone = {member: known.pop(member) for member in members if member in known}
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


def _fw_window(period: int, cal: str, now: int) -> tuple[int, int]:
    if cal:
        return calendar_window(cal, period, now)
    start = now - now % period
    return start, start + period


class MemoryBackend:
    """In-process state; thread-safe, usable from sync and async code alike."""

    is_cluster = False

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
        self._due_times: list[int] = []
        self._scheduled: set[str] = set()
        self._called_at = 0  # the `now` (ms) of the last call: a sweep's budget grows with time
        self._lock = threading.Lock()
        # Phase 1 by algorithm code: a lookup, not a chain of tests.
        self._checks: dict[str, Callable[[str, int, int, int, str, int, int, int], _Result]] = {
            "fw": self._fw_check, "sw": self._sw_check, "gc": self._gc_check,
            "sl": self._sl_check, "cc": self._cc_check}

    def __repr__(self) -> str:
        return f"MemoryBackend(keys={len(self._data)})"

    def __len__(self) -> int:
        """How many keys are held (expired ones are dropped as calls sweep)."""
        return len(self._data)

    # -- the I/O surface the limiters use -----------------------------------------------------
    def run(self, call: ScriptCall, deadline: float | None = None) -> list[int]:
        """One call, as lua/main.lua answers it. Hit (H), peek (P) or book (B): phase 1 asks
        every tier's check, writing nothing; phase 2 stores what the checks computed if every
        tier admits (a log once, by the first of its tiers, for the longest period reading
        it). A refusal goes on to `_refused`."""
        keys: Sequence[str] = call.keys
        argv: Sequence[Any] = call.args  # ints from the core, text from a raw caller
        if type(argv[4]) is not int:
            argv = _from_text(argv)
        op = argv[0]
        now_us = argv[1]
        # Not `with`: its __enter__/__exit__ lookups cost more than the lock itself.
        lock = self._lock
        lock.acquire()
        try:
            # The call's clock ("" for this process's, as Redis's TIME), and the sweep every
            # call makes before it reads anything.
            if type(now_us) is not int:
                now_us = time.time_ns() // 1000 if now_us == "" else int(now_us)
            now = now_us // 1000
            due_times = self._due_times
            if due_times and due_times[0] <= now:  # O(1) when nothing is due
                self._sweep(now, now - self._called_at)
            self._called_at = now
            n = argv[4]
            if op in _UPKEEP:
                self._upkeep(op, keys, _read_tiers(keys, argv, n), argv[2], now, now_us)
                return [1]
            if op == "Z":
                return [1, self._pause(keys[n:], now + int(argv[3]), now)]
            # Anything else decides, as main.lua. A booking in the past is a booking now.
            at = max(int(argv[3]), now) if op == "B" else now
            checks = self._checks
            record = op != "P"
            reply = [1]  # as if admitted: after the hit if it is recorded
            results: list[_Result] = []
            logs: dict[str, int] | None = None  # per log: the longest period reading it
            bans: dict[int, int] | None = None  # per ban index: ms left (0: none)
            admitted = True
            b = 5
            for key in keys[:n]:
                algo = argv[b]
                cost = argv[b + 3]
                ok, before, retry, reset_now, reset_hit, _, _ = result = checks[algo](
                    key, argv[b + 1], argv[b + 2], cost, argv[b + 6], at, now, now_us)
                results.append(result)
                if ban := argv[b + 4]:  # a penalty: under its ban a tier refuses (checked anyway)
                    if bans is None:
                        bans = {}
                    if self._ban_left(bans, keys, ban, now):
                        ok = False
                if not ok:
                    admitted = False
                elif record:
                    reply += (1, before - cost, retry, reset_hit, 0)
                else:
                    reply += (1, before, retry, reset_now, 0)
                if algo == "sl":
                    period = argv[b + 2]
                    if logs is None:
                        logs = {key: period}
                    elif logs.get(key, 0) < period:
                        logs[key] = period
                b += 7
            if not admitted and op != "F":  # F: charged whether or not admitted
                return self._refused(op, keys, _read_tiers(keys, argv, n), results, bans, at,
                                     now, now_us)
            if not record:
                return reply
            data, expires, scheduled = self._data, self._expires, self._scheduled
            for i, result in enumerate(results):
                key = keys[i]
                if px := result[6]:  # _set, inline: SET value PX px
                    data[key] = result[5]
                    expires[key] = until = now + px
                    if key not in scheduled:
                        self._schedule(key, until)
                elif argv[5 + 7 * i] == "cc":
                    self._cc_take(key, argv[7 + 7 * i], argv[8 + 7 * i], argv[2], now)
                elif logs is not None and (longest := logs.pop(key, 0)):  # a sliding log
                    self._sl_commit(key, result[5], at, argv[8 + 7 * i], argv[2], longest, now)
            return [1] if op == "F" else reply
        finally:
            lock.release()

    async def arun(self, call: ScriptCall, deadline: float | None = None) -> list[int]:
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

    # -- the start-up check (``Limiter.ping``), the same answer as the Redis backends' --------
    def ping(self) -> dict[str, Any]:
        """Always reachable: this process. No script is loaded, so ``script_sha`` is empty."""
        return {"backend": "memory", "server": None, "version": None, "cluster": False,
                "nodes": 1, "rtt_ms": 0.0, "script_sha": ""}

    async def aping(self) -> dict[str, Any]:
        return self.ping()

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
                if expiry is None:  # deleted since (a reset, a log refunded empty)
                    scheduled.discard(key)
                elif expiry <= now:
                    self._delete(key)
                    scheduled.discard(key)
                else:  # written again since: due later (expiry > now >= at: another bucket)
                    self._file(key, expiry)
            heapq.heappop(due_times)
            del due[at]

    # -- bans and refusals, as lua/main.lua ---------------------------------------------------
    def _ban_left(self, bans: dict[int, int], keys: Sequence[str], ban: int, now: int) -> int:
        """Ms left of the ban in KEYS[ban] (0: none), read once per call per ban key."""
        left = bans.get(ban)
        if left is None:
            end = self._get(keys[ban - 1], now)
            left = bans[ban] = end - now if end is not None and end > now else 0
        return left

    def _pause(self, ban_keys: Sequence[str], stop: int, now: int) -> int:
        """Start each ban until `stop` (ms), unless it ends later already (main.lua's Z):
        the latest end of them now."""
        latest = stop
        for key in ban_keys:
            current = int(self._get(key, now) or 0)
            if stop > current:
                self._set(key, stop, now, stop - now)
            elif current > latest:
                latest = current
        return latest

    def _refused(self, op: str, keys: Sequence[str], tiers: list[_Tier],
                 results: list[_Result], bans: dict[int, int] | None, at: int, now: int,
                 now_us: int) -> list[int]:
        """As main.lua after a refusal: a refused hit starts the ban of each refusing policy
        that has a penalty; every tier of a banned policy refuses with nothing left, its
        retry the later of the ban's end and its own wait (a cost above the limit stays
        "never"), its reset likewise; bookings ahead tie one log's retries together, a
        banned tier's search starting at its ban's end. The reply describes the state as it
        stands; a refused hit appends the deny cache's figures (`_stability`)."""
        banned = [0] * len(tiers)
        starts = [at] * len(tiers)
        if bans:
            for i, (_, _, _, _, ban, ban_end, _, _) in enumerate(tiers):
                if op == "H" and ban and bans[ban] == 0 and ban_end and not results[i][0]:
                    amount = int(ban_end[1:])
                    stop = now + amount if ban_end[0] == "d" else amount
                    if stop > now:
                        self._set(keys[ban - 1], stop, now, stop - now)
                        bans[ban] = stop - now
            for i, tier in enumerate(tiers):
                if tier[4] and (left := bans[tier[4]]) > 0:
                    banned[i] = 1
                    _, _, retry, reset_now, reset_hit, value, px = results[i]
                    if retry != -1 and retry < left:
                        retry = left
                    results[i] = (False, 0, retry, max(reset_now, left), reset_hit, value, px)
                    starts[i] = max(at, now + left)
        if bans or len(tiers) > 1:  # (else a tier's own retry stands)
            self._sl_joint_retry(tiers, results, starts, at, now)
        reply = [0]
        for i, (ok, before, retry, reset_now, _, _, _) in enumerate(results):
            reply += (1 if ok else 0, before, retry, reset_now, banned[i])
        if op == "H":
            self._stability(tiers, banned, bans or {}, reply, now, now_us)
        return reply

    def _stability(self, tiers: list[_Tier], banned: list[int], bans: dict[int, int],
                   reply: list[int], now: int, now_us: int) -> None:
        """As main.lua for a refused hit: append, per tier, how long (µs) its numbers hold,
        and its exact retry and reset in µs, for the client's deny cache. `banned`: the tiers
        under a ban (`bans`: ms left per ban index)."""
        phase = now_us - now * 1000

        def us(ms: int) -> int:
            return ms * 1000 - phase if ms > 0 else ms

        tied = False  # as the script's: a sliding-log tier whose log has entries ahead
        for algo, *_, key in tiers:
            if algo == "sl" and (log := self._get(key, now)) is not None:
                tied = tied or log.scores[-1] > now
        extra: list[int] = []
        for i, (algo, limit, period, cost, ban, _, cal, key) in enumerate(tiers):
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
            elif reply[5 * i + 1] == 0 and ban > 0:
                stable = 0  # refused under a penalty that started no ban: a later hit may
            elif algo == "cc":
                stable = 0  # a slot frees whenever a response ends
            elif algo == "sl":
                stable = 0 if tied else us(self._sl_stable(key, period, now))
            elif algo == "fw":
                stable = us(_fw_window(period, cal, now)[1] - now)
            elif algo == "gc":
                stable, retry, reset = self._gc_stable(key, limit, period, cost, now, now_us)
            else:
                stable = us(self._sw_stable(key, period, now))
            if retry is None:
                retry, reset = us(reply[5 * i + 3]), us(reply[5 * i + 4])
            extra += (stable, retry, reset)
        reply += extra

    def _upkeep(self, op: str, keys: Sequence[str], tiers: list[_Tier], token: str,
                now: int, now_us: int) -> None:
        """Reset (X), refund (R), renew (N) or cancel a booking (C): once per key and hit,
        as main.lua (a batch of R or N names each tier's token, separated by spaces)."""
        if op == "X":
            for key in keys:
                self._delete(key)
            return
        spans = _sl_spans(tiers)
        tokens = (token.split() if op != "C" and " " in token
                  else itertools.repeat(token, len(tiers)))
        done: set[tuple[str, str]] = set()
        for (algo, limit, period, cost, _, _, cal, key), token in zip(tiers, tokens,
                                                                       strict=True):
            if (key, token) in done:
                continue
            done.add((key, token))
            if op == "C":
                if algo == "sl":
                    self._sl_refund(key, _members(token, cost), cost, spans[key], now)
            elif algo == "cc":
                self._cc_upkeep(op, key, period, cost, token, now)
            elif op == "N":  # leases are in-flight tiers' only
                continue
            elif algo == "fw":
                self._fw_refund(key, period, cost, cal, now)
            elif algo == "sw":
                self._sw_refund(key, period, cost, now)
            elif algo == "gc":
                self._gc_refund(key, limit, period, cost, now, now_us)
            else:
                self._sl_refund(key, _members(token, cost) if token else None, cost,
                                spans[key], now)

    # -- concurrency (lua/concurrency.lua): the value is {member: lease end ms} -------------
    def _cc_check(self, key: str, limit: int, period: int, cost: int, cal: str, at: int,
                  now: int, now_us: int) -> _Result:
        slots: dict[str, int] | None = self._get(key, now)
        ends = [end for end in slots.values() if end > now] if slots else []
        ok = len(ends) + cost <= limit
        retry = -1 if cost > limit else 0 if ok else min(min(ends) - now, 1000)
        return (ok, max(0, limit - len(ends)), retry, max(ends) - now if ends else 0, period,
                slots, 0)

    def _cc_take(self, key: str, lease: int, cost: int, token: str, now: int) -> None:
        # Read again, as the script's ZADD writes to the key as it is: two tiers of one call
        # may take slots in the same set.
        slots: dict[str, int] | None = self._get(key, now)
        live = {m: end for m, end in slots.items() if end > now} if slots else {}
        for member in _members(token, cost):
            live[member] = now + lease
        self._set(key, live, now, lease)

    def _cc_upkeep(self, op: str, key: str, lease: int, cost: int, token: str,
                   now: int) -> None:
        """Give a holder's slots back (R), or renew its leases that have not ended (N)."""
        slots: dict[str, int] | None = self._get(key, now)
        if slots is None or not token:
            return
        renewed = False
        for member in _members(token, cost):
            if op == "R":
                slots.pop(member, None)
            elif slots.get(member, 0) > now:
                slots[member] = now + lease
                renewed = True
        if not slots:
            self._delete(key)  # Redis drops an empty sorted set
        elif renewed:
            self._set(key, slots, now, lease)

    # -- fixed-window (lua/fixed_window.lua): the value is (window start, count) --------------
    def _fw_check(self, key: str, limit: int, period: int, cost: int, cal: str, at: int,
                  now: int, now_us: int) -> _Result:
        if cal:
            start, stop = calendar_window(cal, period, now)
        else:  # _fw_window's epoch-aligned case, without the call
            start = now - now % period
            stop = start + period
        v = self._data[key] if self._expires.get(key, 0) > now else None
        count = v[1] if v is not None and v[0] == start else 0
        ok = count + cost <= limit
        left = stop - now
        return (ok, limit - count if count < limit else 0,
                -1 if cost > limit else 0 if ok else left, left if count else 0, left,
                (start, count + cost), left)

    def _fw_refund(self, key: str, period: int, cost: int, cal: str, now: int) -> None:
        start, _ = _fw_window(period, cal, now)
        v = self._get(key, now)
        if v is not None and v[0] == start:
            self._data[key] = (start, max(0, v[1] - cost))  # KEEPTTL, as the script

    # -- sliding-window (lua/sliding_window.lua): the value is (start, curr, prev) ------------
    def _sw_state(self, key: str, period: int, now: int) -> tuple[int, int, int, int]:
        """The window's start, ms elapsed in it, and its and the previous window's counts:
        what a check of nothing reads (a cost of 0 against a limit of 1, whose retry then
        divides by no zero count)."""
        _, _, _, _, reset, (start, curr, prev), _ = self._sw_check(key, 1, period, 0, "", now,
                                                                   now, 0)
        return start, 2 * period - reset, curr, prev

    def _sw_check(self, key: str, limit: int, period: int, cost: int, cal: str, at: int,
                  now: int, now_us: int) -> _Result:
        start = now - now % period
        elapsed = now - start
        curr = prev = 0
        v = self._data[key] if self._expires.get(key, 0) > now else None
        if v is not None and v[0] == start:
            curr, prev = v[1], v[2]
        elif v is not None and v[0] == start - period:
            prev = v[1]
        budget = limit * period - prev * (period - elapsed)
        before = budget // period - curr
        ok = (curr + cost) * period <= budget
        retry = 0
        if cost > limit:
            retry = -1
        elif ok:
            pass
        elif curr + cost <= limit:  # only the previous window's weight is in the way
            retry = period - (limit - curr - cost) * period // prev - elapsed
        else:  # this window is full: wait for the next one, where its count is the weight
            retry = period - elapsed + max(0, period - (limit - cost) * period // curr)
        reset = 2 * period - elapsed
        return (ok, before if before > 0 else 0, retry,
                reset if curr else period - elapsed if prev else 0, reset,
                (start, curr + cost, prev), reset)

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
        back = max(0, cost - curr)
        curr = max(0, curr - cost)
        self._set(key, (start, curr, max(0, prev - back)), now, 2 * period - elapsed)

    # -- gcra (lua/gcra.lua): the value is the TAT in µs --------------------------------------
    def _gc_check(self, key: str, limit: int, period: int, cost: int, cal: str, at: int,
                  now: int, now_us: int) -> _Result:
        interval = -(-period * 1000 // limit)  # ceil
        tolerance = limit * interval
        # How far the TAT is ahead of now, never negative, before the hit and after it.
        tat = self._data[key] if self._expires.get(key, 0) > now else 0
        ahead = tat - now_us if tat > now_us else 0
        after = ahead + cost * interval
        ok = after <= tolerance
        reset_hit = -(-after // 1000)
        before = (tolerance - ahead) // interval
        return (ok, before if before > 0 else 0,
                -1 if cost > limit else 0 if ok else -(-(after - tolerance) // 1000),
                -(-ahead // 1000), reset_hit, now_us + after, reset_hit + 1)

    def _gc_ahead(self, key: str, now: int, now_us: int) -> int:
        tat = self._get(key, now)
        return tat - now_us if tat is not None and tat > now_us else 0

    def _gc_stable(self, key: str, limit: int, period: int, cost: int, now: int,
                   now_us: int) -> tuple[int, int, int]:
        """As gcra stable: µs to the next emission step (-1: none), exact retry and reset."""
        interval = -(-period * 1000 // limit)
        tolerance = limit * interval
        ahead = self._gc_ahead(key, now, now_us)
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
        ahead = self._gc_ahead(key, now, now_us) - cost * -(-period * 1000 // limit)
        if ahead <= 0:
            self._delete(key)
        else:
            self._set(key, now_us + ahead, now, -(-ahead // 1000) + 1)

    # -- sliding-log (lua/sliding_log.lua): the value is a _Log -------------------------------
    def _sl_check(self, key: str, limit: int, period: int, cost: int, cal: str, at: int,
                  now: int, now_us: int) -> _Result:
        log: _Log | None = self._data[key] if self._expires.get(key, 0) > now else None
        floor = at - period
        if log is None or log.scores[-1] <= floor:  # an empty window: the whole quota
            return cost <= limit, limit, -1 if cost > limit else 0, 0, at + period - now, log, 0
        scores = log.scores
        newest = scores[-1]
        if newest <= at:  # nothing ahead of `at`: the window ending there is the fullest
            # (mostly the whole log: it is trimmed to its longest window)
            first = 0 if scores[0] > floor else bisect.bisect_right(scores, floor)
            peak = len(scores) - first
            ok = peak + cost <= limit
            # Else the (peak + cost - limit)-th oldest hit in the window must leave it.
            retry = 0 if ok or cost > limit else (
                scores[first + peak + cost - limit - 1] + period - at)
            reset_hit = at + period - now
        else:  # bookings ahead: the fullest window holding `at`, the first time all fit
            ts = log.times_above(floor)
            peak = _sl_peak(ts, period, at)
            ok = peak + cost <= limit
            retry = 0 if ok or cost > limit else (
                _sl_first_free(_sl_blocked(ts, limit, period, cost, []), at) - at)
            reset_hit = newest + period - now
        return (ok, limit - peak if peak < limit else 0, -1 if cost > limit else retry,
                newest + period - now, reset_hit, log, 0)

    def _sl_commit(self, key: str, log: _Log | None, at: int, cost: int, token: str,
                   longest: int, now: int) -> None:
        """Log `cost` entries at `at`, trim what the longest window no longer sees, and keep
        the log until its newest entry has left that window (_set, inline)."""
        if log is None:
            log = _Log()
        log.add(at, [token + ":1"] if cost == 1 else _members(token, cost))
        scores = log.scores
        if scores[0] <= now - longest:  # ZREMRANGEBYSCORE -inf (now - longest)
            log.remove_entries(0, bisect.bisect_right(scores, now - longest))
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
        """After entries leave the log, keep it only as long as its newest entry needs."""
        if log.scores:
            self._set(key, log, now, log.scores[-1] + longest - now)
        else:
            self._delete(key)  # Redis drops an empty sorted set

    def _sl_refund(self, key: str, members: list[str] | None, cost: int, longest: int,
                   now: int) -> None:
        """Remove `members` (a hit whose token is known, a booking), or with None the newest
        `cost` entries already in the past (never a booking ahead)."""
        log: _Log | None = self._get(key, now)
        if log is None:
            return
        if members is not None:
            log.remove(members)
        else:
            upto = bisect.bisect_right(log.scores, now)
            log.remove_entries(max(0, upto - cost), upto)
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
            if ((len(group) < 2 and starts[group[0]] <= at) or all(results[i][0] for i in group)
                    or any(results[i][2] < 0 for i in group)):
                continue
            log: _Log | None = self._get(key, now)
            if log is None or log.scores[-1] <= at:
                continue
            ts = log.times_above(at - max(tiers[i][2] for i in group))
            blocked: list[tuple[int, int]] = []
            for i in group:
                _, limit, period, cost, *_ = tiers[i]
                _sl_blocked(ts, limit, period, cost, blocked)
            for i in group:
                ok, before, _, reset_now, reset_hit, value, px = results[i]
                if not ok:
                    retry = _sl_first_free(blocked, starts[i]) - at
                    results[i] = (ok, before, retry, reset_now, reset_hit, value, px)
