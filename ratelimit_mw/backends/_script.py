"""The memory backend's main.lua: the two phases of a deciding call, refusals, upkeep.

Phase 1 (`_check_all`) asks each tier's check, writing nothing; phase 2 (`_commit`) stores
what the checks computed if every tier admits (a counter or a TAT as main.lua SETs it, a
sliding log through `_sl_commit`, slots through `_cc_take`); a refusal goes on to the bans,
the joint retry of one log's tiers and the deny cache's figures (`_refused`). Reset, refund,
renew and cancel are `_upkeep`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from ratelimit_mw.backends._algorithms import _Algorithms, _fw_window, _Result, _Tier

# Reset, refund (an in-flight tier: give its slots back), cancel a booking, renew leases: the
# operations that decide nothing.
_UPKEEP = frozenset(("X", "R", "C", "N"))


# One tier's charge of a give-back in main.lua's ARGV[4]: "<µs>:<estimate>" or "<µs>".
_CHARGE = re.compile(r"(\d+):?(\d*)", re.ASCII)

# When a give-back's hit was charged (µs, None: not known) and what it charged (None: the
# tier's cost), for each tier or one for all.
Charges = Sequence[tuple[int | None, int | None]]


def charges_of(text: Any) -> Charges:
    """main.lua's ARGV[4] of a give-back (R) read as it reads it: for every tier or one per
    tier, "<µs>:<estimate>", "<µs>" (it charged the tier's cost) or "-" (not known)."""
    read: list[tuple[int | None, int | None]] = []
    for entry in str(text).split():
        found = _CHARGE.fullmatch(entry)
        if found is None:
            read.append((None, None))
        else:
            when, estimate = found.groups()
            read.append((int(when), int(estimate) if estimate else None))
    return read


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


def _sl_spans(tiers: list[_Tier]) -> dict[str, int]:
    """The longest period of the tiers reading each log: what keeps the log alive."""
    spans: dict[str, int] = {}
    for algo, _, period, _, _, _, _, key in tiers:
        if algo == "sl" and spans.get(key, 0) < period:
            spans[key] = period
    return spans


class _Script(_Algorithms):
    """main.lua's flow over the algorithms: phases 1 and 2, refusals, upkeep."""

    def __init__(self) -> None:
        super().__init__()
        # Phase 1 by algorithm code: a lookup, not a chain of tests.
        self._checks: dict[str, Callable[[str, int, int, int, str, int, int, int], _Result]] = {
            "fw": self._fw_check, "sw": self._sw_check, "gc": self._gc_check,
            "sl": self._sl_check, "cc": self._cc_check}

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
        for result, tier in zip(results, tiers):  # noqa: B905
            key = tier[7]
            if px := result[6]:  # _set, inline: SET value PX px
                data[key] = result[5]
                expires[key] = until = now + px
                if key not in scheduled:
                    self._schedule(key, until)
            elif tier[0] == "cc":
                # Read again: two tiers of one call may take slots in the same set.
                self._cc_take(key, self._cc_live(key, now), tier[2], tier[3], token, now)
            elif logs is not None and (longest := logs.pop(key, 0)):  # a sliding log
                self._sl_commit(key, result[5], at, tier[3], token, longest, now)

    def _cc_resets(self, tiers: Sequence[_Tier], results: list[_Result], now: int) -> None:
        """The reset now each admitting slots check left to its reader (-1), asked now (the
        script's cc_reset), for a reply that reports it: a peek's, a refusal's."""
        for i, result in enumerate(results):
            if result[3] < 0 and tiers[i][0] == "cc":
                results[i] = (*result[:3], self._cc_reset(tiers[i][7], now), *result[4:])

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
        self._cc_resets(tiers, results, now)
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
                now: int, now_us: int, charges: Charges = ()) -> int:
        """Reset (X), refund (R), renew (N) or cancel a booking (C): once per key and hit,
        as main.lua (a batch of R or N names each tier's token, separated by spaces). A
        give-back (R) may name when its hit was charged (`charges`: main.lua's ARGV[4] as
        `charges_of` reads it): each tier gives back only within the window it was charged
        in. The reply's one value: 1, or 0 for a renewal that found a slot gone to someone
        else."""
        if op == "X":
            for key in keys:
                self._delete(key)
            return 1
        held = 1
        charged_us = estimate = None
        spans = _sl_spans(tiers)
        tokens = token.split() if op != "C" and " " in token else [token] * len(tiers)
        # A set two in-flight limits of one name share holds the larger cost's members:
        # given back (or renewed) whole, with that cost; a renewal takes them again where
        # every one of those limits has room for its own cost beside the others' members.
        most: dict[tuple[str, str], int] = {}
        room: dict[tuple[str, str], int] = {}
        for tier, each in zip(tiers, tokens, strict=True):
            if tier[0] == "cc":
                mark = (tier[7], each)
                most[mark] = max(most.get(mark, 0), tier[3])
                room[mark] = min(room.get(mark, tier[1]), tier[1] - tier[3])
        done: set[tuple[str, str]] = set()
        for i, ((algo, limit, period, cost, _, _, cal, key), token) in enumerate(
                zip(tiers, tokens, strict=True)):
            if (key, token) in done:
                continue
            done.add((key, token))
            if charges:
                charged_us, estimate = charges[i] if i < len(charges) else charges[0]
                if estimate is None:
                    estimate = cost
            if op == "C":
                if algo == "sl":
                    self._sl_refund(key, token, cost, spans[key], now)
            elif algo == "cc":
                cost = most[key, token]
                if not self._cc_upkeep(op, key, cost + room[key, token], period, cost, token,
                                       now):
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
