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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ratelimit_mw.core.compiled import Compiled
    from ratelimit_mw.core.policy import Policy
    from ratelimit_mw.core.rates import Rate

from ratelimit_mw.backends._log import _Log, _sl_blocked, _sl_first_free, _sl_member, _sl_peak
from ratelimit_mw.core.decision import Decision, TierState
from ratelimit_mw.core.identity import CACHED_LENGTH, encode_identity, encode_short
from ratelimit_mw.core.plans import ScriptCall, admitted_decision, new_token
from ratelimit_mw.core.rates import COUNT_CAP, GCRA_SPAN_US, MAX_COST
from ratelimit_mw.core.wire import calendar_window

_SWEEP_PER_CALL = 64
_SWEEP_PER_MS = 16
_SWEEP_MAX_MS = 4_096  # at most ~65k entries in one call, however long the backend idled

# As the scripts saturate what a settle in debt leaves (core/rates.py): how far a GCRA TAT runs
# ahead, in µs, and what a sliding log's costs add above one unit per hit.
_GCRA_AHEAD_MAX = 2 * GCRA_SPAN_US
_SL_EXTRA_MAX = MAX_COST

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
# A compiled hit on this store: (identities, now µs or None, token or None) -> the Decision
# of an admitted hit, or a refusal's reply (main.lua's).
Hitter = Callable[[Sequence[str], "int | None", "str | None"], "Decision | list[int]"]
_new = tuple.__new__


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
    """A holder's in-flight slots, or a hit in a log written before costs were kept (one
    member per unit): "<token>:1" .. "<token>:<cost>"."""
    return [f"{token}:{j}" for j in range(1, cost + 1)]


def _sl_spans(tiers: list[_Tier]) -> dict[str, int]:
    """The longest period of the tiers reading each log: what keeps the log alive."""
    spans: dict[str, int] = {}
    for algo, _, period, _, _, _, _, key in tiers:
        if algo == "sl" and spans.get(key, 0) < period:
            spans[key] = period
    return spans


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
                return [self._upkeep(op, keys, _read_tiers(keys, argv, n), argv[2], now,
                                     now_us, argv[3])]
            # Anything else decides, as main.lua. A booking in the past is a booking now.
            at = max(int(argv[3]), now) if op == "B" else now
            tiers = _read_tiers(keys, argv, n)
            admitted, results, logs, bans = self._check_all(keys, tiers, at, now, now_us)
            if not admitted and op != "F":  # F: charged whether or not admitted
                return self._refused(op, keys, tiers, results, bans, at, now, now_us)
            if op == "P":
                reply = [1]
                for ok, before, retry, reset_now, _, _, _ in results:
                    reply += (1 if ok else 0, before, retry, reset_now, 0)
                reply.append(now_us)
                return reply
            self._commit(keys, tiers, results, logs, argv[2], at, now)
            if op == "F":
                return [1]
            reply = [1]
            for (_, before, retry, _, reset_hit, _, _), tier in zip(results, tiers, strict=True):
                reply += (1, before - tier[3], retry, reset_hit, 0)
            reply.append(now_us)  # admitted: the store's clock, as main.lua
            return reply
        finally:
            lock.release()

    def _check_all(self, keys: Sequence[str], tiers: Sequence[_Tier], at: int, now: int,
                   now_us: int) -> tuple[bool, list[_Result], dict[str, int] | None,
                                         dict[int, int] | None]:
        """Phase 1 of main.lua: every tier's check, writing nothing (a tier under its ban
        refuses, checked anyway). Whether all admit, the checks' results, the longest
        period reading each log, and the bans read (ms left per ban index)."""
        checks = self._checks
        results: list[_Result] = []
        logs: dict[str, int] | None = None
        bans: dict[int, int] | None = None
        admitted = True
        for algo, limit, period, cost, ban, _, cal, key in tiers:
            result = checks[algo](key, limit, period, cost, cal, at, now, now_us)
            results.append(result)
            if not result[0]:
                admitted = False
            if ban:
                if bans is None:
                    bans = {}
                if self._ban_left(bans, keys, ban, now):
                    admitted = False
            if algo == "sl":
                if logs is None:
                    logs = {key: period}
                elif logs.get(key, 0) < period:
                    logs[key] = period
        return admitted, results, logs, bans

    def _commit(self, keys: Sequence[str], tiers: Sequence[_Tier], results: list[_Result],
                logs: dict[str, int] | None, token: str, at: int, now: int) -> None:
        """Phase 2 of main.lua, every tier having admitted: store what each check computed
        (a counter or a TAT as main.lua SETs it, slots through `_cc_take`, a log once, by the
        first of its tiers, for the longest period reading it)."""
        data, expires, scheduled = self._data, self._expires, self._scheduled
        for result, tier in zip(results, tiers, strict=True):
            key = tier[7]
            if px := result[6]:  # _set, inline: SET value PX px
                data[key] = result[5]
                expires[key] = until = now + px
                if key not in scheduled:
                    self._schedule(key, until)
            elif tier[0] == "cc":
                self._cc_take(key, tier[2], tier[3], token, now)
            elif logs is not None and (longest := logs.pop(key, 0)):  # a sliding log
                self._sl_commit(key, result[5], at, tier[3], token, longest, now)

    # -- the typed hit: a Compiled's tiers read once, each hit straight to its Decision ------
    def hitter(self, compiled: Compiled) -> Hitter | None:
        """The hit of `compiled` on this store, for the limiter to cache per (Compiled,
        backend): the same checks and writes as `run` (`_check_all`, `_commit`), its tiers
        typed once here, its answer the `Decision` of an admitted hit, or a refusal's reply
        as main.lua's (the deny cache keeps that). None where the arguments vary per
        request (a penalty's end, a calendar's schedule) or a policy is named twice: then
        the limiter builds the call and `run` answers it, as it does for a subclass with a
        `run` or `arun` of its own."""
        cls = type(self)
        if (not compiled.static or cls.run is not MemoryBackend.run
                or cls.arun is not MemoryBackend.arun):  # a subclass watching its calls
            return None
        tail = compiled.tail
        prefix = compiled.prefix
        suffixes = compiled.key_suffixes
        n = int(tail[0])
        tiers: list[tuple[str, int, int, int, int, str, str]] = [
            tuple(tail[1 + 7 * i: 8 + 7 * i]) for i in range(n)]  # type: ignore[misc]
        # Per tier: which identity it reads, its policy and rate (the Decision's layout).
        owners = [(i, policy, rate) for i, policy in enumerate(compiled.policies)
                  for rate in policy.rates]
        if n == 1:
            return self._one_tier(compiled, tiers[0], owners[0][1], owners[0][2])
        lock = self._lock
        due_times = self._due_times
        log = compiled.log

        def hit(identities: Sequence[str], now_us: int | None,
                token: str | None) -> Decision | list[int]:
            if len(identities) == 1:
                identity = identities[0]
                # encode_identity, its cache asked here: the same clients come back.
                encoded = (encode_short(identity) if len(identity) <= CACHED_LENGTH
                           else encode_identity(identity))
                head = f"{prefix}:{{{encoded}}}:"
                keys = [head + suffix for suffix in suffixes[0]]
            else:
                keys = [f"{prefix}:{{{encode_identity(identity)}}}:{suffix}"
                        for identity, each in zip(identities, suffixes, strict=True)
                        for suffix in each]
            typed = [(*tier, key) for tier, key in zip(tiers, keys, strict=True)]
            if log and not token:
                token = new_token()
            lock.acquire()
            try:
                if now_us is None:
                    now_us = time.time_ns() // 1000
                now = now_us // 1000
                if due_times and due_times[0] <= now:
                    self._sweep(now, now - self._called_at)
                self._called_at = now
                admitted, results, logs, _ = self._check_all(keys, typed, now, now, now_us)
                if not admitted:
                    return self._refused("H", keys, typed, results, None, now, now, now_us)
                self._commit(keys, typed, results, logs, token or "", now, now)
            finally:
                lock.release()
            states = []
            for (_, before, _, _, reset_hit, _, _), tier, (i, policy, rate) in zip(
                    results, tiers, owners, strict=True):
                left = before - tier[3]
                states.append(_new(TierState, (policy, rate, identities[i], True,
                                               left if left > 0 else 0, 0.0, reset_hit / 1000,
                                               False)))
            return admitted_decision(states, now_us)

        return hit

    def _one_tier(self, compiled: Compiled, tier: tuple[str, int, int, int, int, str, str],
                  policy: Policy, rate: Rate) -> Hitter:
        """`hitter` for one policy of one rate (most routes): the same check and writes, the
        loops over tiers unrolled."""
        prefix = compiled.prefix
        suffix = compiled.key_suffixes[0][0]
        algo, limit, period, cost, _, _, cal = tier
        check = self._checks[algo]
        lock = self._lock
        due_times = self._due_times
        data, expires, scheduled = self._data, self._expires, self._scheduled
        log = compiled.log
        rate_limit = rate.limit

        def hit(identities: Sequence[str], now_us: int | None,
                token: str | None) -> Decision | list[int]:
            identity = identities[0]
            key = (f"{prefix}:{{{encode_short(identity)}}}:{suffix}"
                   if len(identity) <= CACHED_LENGTH
                   else f"{prefix}:{{{encode_identity(identity)}}}:{suffix}")
            if log and not token:
                token = new_token()
            lock.acquire()
            try:
                if now_us is None:
                    now_us = time.time_ns() // 1000
                now = now_us // 1000
                if due_times and due_times[0] <= now:
                    self._sweep(now, now - self._called_at)
                self._called_at = now
                result = check(key, limit, period, cost, cal, now, now, now_us)
                if not result[0]:
                    return self._refused("H", [key], [(*tier, key)], [result], None, now, now,
                                         now_us)
                if px := result[6]:  # as `_commit`, for a value with a time to live
                    data[key] = result[5]
                    expires[key] = until = now + px
                    if key not in scheduled:
                        self._schedule(key, until)
                else:  # a log or slots
                    self._commit([key], [(*tier, key)], [result],
                                 {key: period} if algo == "sl" else None, token or "", now, now)
            finally:
                lock.release()
            left = result[1] - cost
            if left < 0:
                left = 0
            reset = result[4] / 1000
            return _new(Decision, (True, rate_limit, left, 0.0, reset, policy, rate, identity,
                                   False, (_new(TierState, (policy, rate, identity, True, left,
                                                            0.0, reset, False)),),
                                   None, now_us))

        return hit

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
                now: int, now_us: int, charge: Any = "") -> int:
        """Reset (X), refund (R), renew (N) or cancel a booking (C): once per key and hit,
        as main.lua (a batch of R or N names each tier's token, separated by spaces). A
        settle's give-back (R) names its charge, "<µs>:<estimate>" (`charge`): each tier gives
        back only within the window it was charged in. The reply's one value: 1, or 0 for a
        renewal that found a slot gone to someone else."""
        if op == "X":
            for key in keys:
                self._delete(key)
            return 1
        held = 1
        charged_us = estimate = None
        if op == "R" and charge != "":
            when, _, cost_text = str(charge).partition(":")
            charged_us, estimate = int(when), int(cost_text)
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
                    self._sl_refund(key, token, cost, spans[key], now)
            elif algo == "cc":
                if not self._cc_upkeep(op, key, limit, period, cost, token, now):
                    held = 0
            elif op == "N":  # leases are in-flight tiers' only
                continue
            elif algo == "fw":
                self._fw_refund(key, period, cost, cal, now, charged_us)
            elif algo == "sw":
                self._sw_refund(key, period, cost, now, charged_us)
            elif algo == "gc":
                self._gc_refund(key, limit, period, cost, now, now_us, charged_us, estimate)
            else:
                self._sl_refund(key, token, cost, spans[key], now, estimate)
        return held

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

    def _cc_upkeep(self, op: str, key: str, limit: int, lease: int, cost: int, token: str,
                   now: int) -> bool:
        """Give a holder's slots back (R), or renew its leases (N): those that have ended are
        taken again if the tier has room for them all; False when it has not (lost)."""
        slots: dict[str, int] | None = self._get(key, now)
        if not token:
            return True
        if slots is None:
            slots = {}
        renewed = False
        ended: list[str] = []
        for member in _members(token, cost):
            if op == "R":
                slots.pop(member, None)
            elif slots.get(member, 0) > now:
                slots[member] = now + lease
                renewed = True
            else:
                ended.append(member)
        held = not ended
        if ended:
            for member in [m for m, end in slots.items() if end <= now]:
                del slots[member]
            if len(slots) + len(ended) <= limit:
                for member in ended:
                    slots[member] = now + lease
                renewed = held = True
        if not slots:
            self._delete(key)  # Redis drops an empty sorted set
        elif renewed:
            self._set(key, slots, now, lease)
        return held

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
                (start, count + cost if ok or count + cost <= COUNT_CAP else COUNT_CAP), left)

    def _fw_refund(self, key: str, period: int, cost: int, cal: str, now: int,
                   charged_us: int | None = None) -> None:
        start, _ = _fw_window(period, cal, now)
        if charged_us is not None and _fw_window(period, cal, charged_us // 1000)[0] != start:
            return  # charged in a window that has ended: nothing to give back
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
        total = curr + cost
        if total > limit:  # saturates as sliding_window.lua
            total = min(total, max(limit, MAX_COST // period))
        return (ok, before if before > 0 else 0, retry,
                reset if curr else period - elapsed if prev else 0, reset,
                (start, total, prev), reset)

    def _sw_stable(self, key: str, period: int, now: int) -> int:
        """As sw stable: ms until the window ends or the previous window's weight drops."""
        _, elapsed, _, prev = self._sw_state(key, period, now)
        weight = -(-prev * (period - elapsed) // period)
        if weight < 1:
            return period - elapsed
        return period - (weight - 1) * period // prev - elapsed

    def _sw_refund(self, key: str, period: int, cost: int, now: int,
                   charged_us: int | None = None) -> None:
        start, elapsed, curr, prev = self._sw_state(key, period, now)
        if curr == 0 and prev == 0:
            return
        if charged_us is not None:  # out of the count of the window it was charged in
            charged = charged_us // 1000
            origin = charged - charged % period
            if origin == start:
                curr = max(0, curr - cost)
            elif origin == start - period:
                prev = max(0, prev - cost)
            else:
                return
            cost = 0
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
        # What is stored runs at most _GCRA_AHEAD_MAX ahead (a settle in debt), as gcra.lua.
        kept = after if after <= _GCRA_AHEAD_MAX else _GCRA_AHEAD_MAX
        return (ok, before if before > 0 else 0,
                -1 if cost > limit else 0 if ok else -(-(after - tolerance) // 1000),
                -(-ahead // 1000), reset_hit, now_us + kept,
                reset_hit + 1 if kept == after else -(-kept // 1000) + 1)

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
                   now_us: int, charged_us: int | None = None,
                   estimate: int | None = None) -> None:
        interval = -(-period * 1000 // limit)
        back = cost * interval
        if charged_us is not None and estimate is not None:
            # No more than what of the charge's own emission is still ahead (gcra.lua).
            back = min(back, charged_us + estimate * interval - now_us)
            if back <= 0:
                return
        ahead = self._gc_ahead(key, now, now_us) - back
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
            peak = log.units(first) if log.extra else len(scores) - first
            ok = peak + cost <= limit
            # Else the (peak + cost - limit)-th oldest unit in the window must leave it.
            retry = 0 if ok or cost > limit else (
                self._sl_leaving(log, first, peak + cost - limit) + period - at)
            reset_hit = at + period - now
        else:  # bookings ahead: the fullest window holding `at`, the first time all fit
            ts, ws = log.times_above(floor)
            peak = _sl_peak(ts, ws, period, at)
            ok = peak + cost <= limit
            retry = 0 if ok or cost > limit else (
                _sl_first_free(_sl_blocked(ts, ws, limit, period, cost, []), at) - at)
            reset_hit = newest + period - now
        return (ok, limit - peak if peak < limit else 0, -1 if cost > limit else retry,
                newest + period - now, reset_hit, log, 0)

    @staticmethod
    def _sl_leaving(log: _Log, first: int, need: int) -> int:
        """The time of the entry holding the `need`-th oldest unit from index `first`."""
        weights = log.weights
        if not weights:
            return log.scores[first + need - 1]
        for i in range(first, len(log.names)):
            need -= weights.get(log.names[i], 1)
            if need <= 0:
                break
        return log.scores[i]

    def _sl_commit(self, key: str, log: _Log | None, at: int, cost: int, token: str,
                   longest: int, now: int) -> None:
        """Log the hit, one entry of `cost` at `at`, trim what the longest window no longer
        sees, and keep the log until its newest entry has left that window (_set, inline)."""
        if log is None:
            log = _Log()
        if cost > 1 and log.extra + cost - 1 > _SL_EXTRA_MAX:  # saturates as the script
            cost = _SL_EXTRA_MAX - log.extra + 1
        log.add(at, [token if cost == 1 else f"{token}#{cost}"], cost)  # _sl_member, inline
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

    def _sl_refund(self, key: str, token: str, amount: int, longest: int, now: int,
                   recorded: int | None = None) -> None:
        """Give back `amount` units: of the hit (or booking) named `token`, which recorded
        `recorded` (default `amount`), from its own entry (a log written before costs were
        kept: its members "<token>:1" ..), or without a token from the newest entries already
        in the past (never a booking ahead)."""
        log: _Log | None = self._get(key, now)
        if log is None:
            return
        member = _sl_member(token, amount if recorded is None else recorded)
        if not token:
            upto = bisect.bisect_right(log.scores, now)
            log.take(range(upto - 1, -1, -1), amount)
        elif member in log.members:
            log.take([bisect.bisect_left(log.names, member,
                                         *self._block(log, log.members[member]))], amount)
        else:  # ZCARD bounds it in the script, "+" included while the log has costs
            log.remove(_members(token, min(amount, len(log.names) + (1 if log.extra else 0))))
        self._sl_expire(key, log, longest, now)

    @staticmethod
    def _block(log: _Log, score: int) -> tuple[int, int]:
        """The index span of the entries at `score` (names sorted within it)."""
        lo = bisect.bisect_left(log.scores, score)
        return lo, bisect.bisect_right(log.scores, score, lo)

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
            ts, ws = log.times_above(at - max(tiers[i][2] for i in group))
            blocked: list[tuple[int, int]] = []
            for i in group:
                _, limit, period, cost, *_ = tiers[i]
                _sl_blocked(ts, ws, limit, period, cost, blocked)
            for i in group:
                ok, before, _, reset_now, reset_hit, value, px = results[i]
                if not ok:
                    retry = _sl_first_free(blocked, starts[i]) - at
                    results[i] = (ok, before, retry, reset_now, reset_hit, value, px)
