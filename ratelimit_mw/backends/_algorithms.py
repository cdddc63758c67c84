"""The memory backend's algorithms: mirrors of lua/<algorithm>.lua over the store's state.

Each algorithm's check (`_fw_check`, `_sw_check`, `_gc_check`, `_sl_check`, `_cc_check`) has
one signature and writes nothing: it returns a plain tuple, the reply's numbers and the exact
value phase 2 stores (see `_Result`). Beside it, what the script's refunds, stability figures
and commits do for that algorithm. The typed hit (`MemoryBackend.hitter`) and the ARGV adapter
(`MemoryBackend.run`) call these same functions.
"""

from __future__ import annotations

import bisect
from typing import Any

from ratelimit_mw.backends._log import _Log, _sl_blocked, _sl_first_free, _sl_member, _sl_peak
from ratelimit_mw.backends._store import _Store
from ratelimit_mw.core.rates import COUNT_CAP, GCRA_SPAN_US, MAX_COST
from ratelimit_mw.core.wire import calendar_window

# As the scripts saturate what a settle in debt leaves (core/rates.py): how far a GCRA TAT runs
# ahead, in µs, and what a sliding log's costs add above one unit per hit.
_GCRA_AHEAD_MAX = 2 * GCRA_SPAN_US
_SL_EXTRA_MAX = MAX_COST

# One tier of ARGV: algorithm, limit, period ms, cost, ban key index (1-based in KEYS, 0:
# none), ban end, calendar schedule, then the tier's key.
_Tier = tuple[str, int, int, int, int, str, str, str]
# A check's answer, as the scripts' checks: admitted, remaining before the hit, retry ms (-1:
# never), reset ms now, reset ms after the hit, then the value phase 2 stores and its ms to
# live (a sliding log: the log as read, or None, and 0: `_sl_commit` writes it).
_Result = tuple[bool, int, int, int, int, Any, int]


class _Slots(dict[str, int]):
    """A concurrency tier's slots, {member: lease end ms}, and `soonest`: no lease in it ends
    before then (every end written, by a take or a renewal, lowers it if earlier; a
    give-back leaves it), so the ended ones are looked for only once it has passed: a check
    and a take cost the same with one slot held or thousands until then (as ZCARD on a
    sorted set), one pass over them after."""

    __slots__ = ("soonest",)
    soonest: int  # set where each is made (no __init__: a take after the last give-back makes one)


_NO_END = 1 << 62  # an empty tier's `soonest`: no lease to end


def _members(token: str, cost: int) -> list[str]:
    """A holder's in-flight slots, or a hit in a log written before costs were kept (one
    member per unit): "<token>:1" .. "<token>:<cost>"."""
    if cost == 1:  # most holders: one slot
        return [token + ":1"]
    return [f"{token}:{j}" for j in range(1, cost + 1)]


def _fw_window(period: int, cal: str, now: int) -> tuple[int, int]:
    if cal:
        return calendar_window(cal, period, now)
    start = now - now % period
    return start, start + period


class _Algorithms(_Store):
    """Per algorithm: its check, refund and stability figures over the store's state."""

    # -- concurrency (lua/concurrency.lua): the value is `_Slots`, {member: lease end ms} -----
    def _cc_live(self, key: str, now: int) -> _Slots | None:
        """The tier's slots, those whose lease has ended dropped first (the script's
        ZREMRANGEBYSCORE: nothing any reply says changes); None: none held. A set found
        expired goes now, as Redis drops a key read past its expiry: a clock stepped back
        must not find it again before the sweep does."""
        if self._expires.get(key, 0) <= now:
            if key in self._data:
                self._delete(key)
            return None
        slots: _Slots = self._data[key]
        if slots.soonest <= now:
            for member in [m for m, end in slots.items() if end <= now]:
                del slots[member]
            if not slots:
                self._delete(key)  # Redis drops an empty sorted set
                return None
            slots.soonest = min(slots.values())
        return slots

    def _cc_check(self, key: str, limit: int, period: int, cost: int, cal: str, at: int,
                  now: int, now_us: int) -> _Result:
        # Its reset now (the last lease's end) is asked of `_cc_reset` by whoever reads it (a
        # peek, a refusal): -1 here where it admits, as the script's lazy check.
        slots = self._cc_live(key, now)
        held = len(slots) if slots else 0
        ok = held + cost <= limit
        if ok:
            return (True, limit - held, 0, -1 if held else 0, period, slots, 0)
        ends = slots.values() if slots else ()
        return (False, max(0, limit - held),
                -1 if cost > limit else min(min(ends) - now, 1000),
                max(ends) - now if ends else 0, period, slots, 0)

    def _cc_reset(self, key: str, now: int) -> int:
        """When the tier's last lease ends, in ms from now (0: none held)."""
        slots = self._cc_live(key, now)
        return max(slots.values()) - now if slots else 0

    def _cc_take(self, key: str, slots: _Slots | None, lease: int, cost: int, token: str,
                 now: int) -> None:
        """Take the slots into `slots`, the tier's live set (`_cc_live`): the one its check
        read where no other tier of the call writes to the key, else read again, as the
        script's ZADD writes to the key as it is."""
        end = now + lease
        if not slots:
            slots = _Slots()
            slots.soonest = end
        elif end < slots.soonest:
            slots.soonest = end
        if cost == 1:  # most holders: one slot
            slots[token + ":1"] = end
        else:
            for member in _members(token, cost):
                slots[member] = end
        self._set(key, slots, now, lease)

    def _cc_release(self, key: str, cost: int, token: str, now: int) -> None:
        """Give a holder's slots back: ZREM of its members; Redis drops an empty set (and
        one read past its expiry)."""
        if not token:
            return
        slots: _Slots | None = self._data[key] if self._expires.get(key, 0) > now else None
        if slots is not None:
            if cost == 1:  # most holders: one slot
                slots.pop(token + ":1", None)
            else:
                for member in _members(token, cost):
                    slots.pop(member, None)
            if slots:
                return
        self._delete(key)

    def _cc_upkeep(self, op: str, key: str, limit: int, lease: int, cost: int, token: str,
                   now: int) -> bool:
        """Give a holder's slots back (R), or renew its leases (N): those that have ended are
        taken again if the tier has room for them all; False when it has not (lost)."""
        if op == "R":
            self._cc_release(key, cost, token, now)
            return True
        slots: _Slots | None = (self._data[key] if self._expires.get(key, 0) > now
                                else None)  # `_get`, inline
        if not token:
            return True
        if slots is None:
            slots = _Slots()
            slots.soonest = _NO_END
        renewed = False
        ended: list[str] = []
        for member in _members(token, cost):
            if slots.get(member, 0) > now:
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
        if renewed and now + lease < slots.soonest:  # a clock stepped back writes earlier ends
            slots.soonest = now + lease
        if not slots:
            self._delete(key)  # Redis drops an empty sorted set
        elif renewed:
            self._set(key, slots, now, lease)
        return held

    # -- fixed-window (lua/fixed_window.lua): the value is (window start, count) --------------
    def _fw_check(self, key: str, limit: int, period: int, cost: int, cal: str, at: int,
                  now: int, now_us: int) -> _Result:
        if cal:
            start, left = calendar_window(cal, period, now)
            left -= now
        else:  # _fw_window's epoch-aligned case, without the call
            left = now % period
            start = now - left
            left = period - left
        if self._expires.get(key, 0) > now and (v := self._data[key])[0] == start:
            count = v[1]
        else:
            count = 0
        ok = (after := count + cost) <= limit
        return (ok, limit - count if count < limit else 0,
                -1 if cost > limit else 0 if ok else left, left if count else 0, left,
                (start, after if ok or after <= COUNT_CAP else COUNT_CAP), left)

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
