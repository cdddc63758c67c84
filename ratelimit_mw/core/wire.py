"""The wire format: what a policy becomes on its way to lua/main.lua.

`Policy` holds what a user configures; this module turns it into what the script reads: the
algorithm's two-letter code (`CODES`: fw, sl, sw, gc, cc), the key segment (``<name>.<code>``),
the key suffix and the seven arguments of each tier, the ban argument and the calendar
argument. The call's first argument, the op (H hit, P peek, R refund, X reset, B book,
C cancel, N renew, F charge, Z pause), is `ratelimit_mw.core.codec`'s. What does not
depend on the request is computed once per policy (`Wire`, kept in the policy's reserved slot,
so it lives exactly as long as the policy).

Calendar windows (``tz=``): every window is picked by Redis's clock, calendar days included.
Two app hosts whose clocks differ by two days would each write the counter of "their" day and
admit far more than the limit, so the call carries no boundaries, only the zone's UTC-offset
schedule over a wide span of time, and the script works out the local day from Redis's TIME:

- ``schedule(zone, app_ms)`` is ``"o0,t1,o1,t2,o2,..."`` (integers, ms): the zone's UTC offset
  ``o0`` up to the instant ``t1``, then ``o1`` up to ``t2``, and so on; the last offset holds
  on. It lists every offset change within 400 days either side of a 30-day bucket of the
  app's clock, cached per zone and bucket: the app's clock only chooses which stretch of the
  zone's rules to send. Hosts whose schedules both cover Redis's now compute the same windows
  (exact for host clocks up to ~370 days off; beyond, the nearest edge's offset is extended).
- A tier of ``k`` whole days runs over local days ``[D, D + k)``, counted from 1970-01-01, ``D``
  a multiple of ``k`` (from Monday 1969-12-29 when ``k`` is a multiple of 7). A local day
  starts at the first instant whose local date is that day or later: local midnight, or the
  end of a gap that skips it. Days across a DST change last 23 or 25 hours.
- lua/fixed_window.lua and the MemoryBackend run the same integer arithmetic on that
  schedule, held together by the differential test.
"""

from __future__ import annotations

import bisect
import datetime as _dt
import functools
from typing import TypeAlias
from zoneinfo import ZoneInfo

from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.core.identity import encode_segment
from ratelimit_mw.core.policy import Policy

Arg: TypeAlias = str | int

CODES = {"fixed-window": "fw", "sliding-log": "sl", "sliding-window": "sw", "gcra": "gc",
         "concurrency": "cc"}

DAY_MS = 86_400_000
# The schedule covers this much either side of the app clock's bucket, and is rebuilt when the
# app's clock enters another bucket.
SPAN_MS = 400 * DAY_MS
BUCKET_MS = 30 * DAY_MS
# Zone offsets are sampled this often and every change is then found to the second; tz
# rules change the offset at most a few times a year, never twice within hours.
_SAMPLE_S = 6 * 3600


def _offset_s(zone: ZoneInfo, t: int) -> int:
    offset = _dt.datetime.fromtimestamp(t, zone).utcoffset()
    return 0 if offset is None else int(offset.total_seconds())


@functools.lru_cache(maxsize=512)
def _schedule(zone: ZoneInfo, bucket: int) -> str:
    lo = (bucket * BUCKET_MS - SPAN_MS) // 1000
    hi = ((bucket + 1) * BUCKET_MS + SPAN_MS) // 1000
    current = _offset_s(zone, lo)
    parts = [current * 1000]
    for t in range(lo, hi, _SAMPLE_S):
        step = min(_SAMPLE_S, hi - t)
        offset = _offset_s(zone, t + step)
        if offset != current:
            # The change lies in (t, t + step]: find its first second.
            def changed(second: int, was: int = current) -> bool:
                return _offset_s(zone, second) != was

            seconds = range(t + 1, t + step + 1)
            first = seconds[bisect.bisect_left(seconds, True, key=changed)]
            parts += (first * 1000, offset * 1000)
            current = offset
    return ",".join(map(str, parts))


def schedule(zone: ZoneInfo, app_ms: int) -> str:
    """The zone's UTC-offset schedule around the app's clock (see the module docstring)."""
    return _schedule(zone, app_ms // BUCKET_MS)


@functools.lru_cache(maxsize=64)
def _parse_schedule(cal: str) -> tuple[int, ...]:
    return tuple(map(int, cal.split(",")))


def _day_start(s: tuple[int, ...], day: int) -> int:
    """The first instant whose local date is `day` (days since 1970-01-01) or later: local
    midnight, or the end of a gap that skips it. In the segment of offset s[k] (from s[k - 1]
    up to s[k + 1]) local time is UTC + s[k]. As day_start in lua/fixed_window.lua."""
    m = day * DAY_MS
    k = 0
    while True:
        t = m - s[k]
        if k + 1 >= len(s) or t < s[k + 1]:
            return max(t, s[k - 1]) if k > 0 else t
        k += 2


def calendar_window(cal: str, period: int, now: int) -> tuple[int, int]:
    """The calendar window [start, stop) in ms holding `now` for a tier of `period` (whole
    days) under the schedule `cal`, as window in lua/fixed_window.lua (the MemoryBackend's
    twin of the script, and what the tests read windows with)."""
    s = _parse_schedule(cal)
    days = period // DAY_MS
    k = 0
    while k + 1 < len(s) and s[k + 1] <= now:
        k += 2
    day = (now + s[k]) // DAY_MS
    day -= (day - (-3 if days % 7 == 0 else 0)) % days  # weeks from Monday 1969-12-29
    start, stop = _day_start(s, day), _day_start(s, day + days)
    if stop <= now:  # a clock set back over midnight left the local date behind a new day
        start, stop = stop, _day_start(s, day + 2 * days)
    return start, stop


class Wire:
    """What a policy contributes to every call, computed once: the key segment and tier
    suffixes, the ban key suffix, which tiers are calendar tiers, and the seven arguments of
    each tier for a given cost (when no penalty or calendar makes them vary)."""

    __slots__ = ("ban_suffix", "by_cost", "calendar_tiers", "code", "policy", "segment",
                 "static", "suffixes")

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.code = code = CODES[policy.algorithm]
        self.segment = segment = encode_segment(policy.name) + "." + code
        # A sliding log: one log serves every tier of the policy, the longest period bounds it.
        self.suffixes = tuple(f"{segment}:{'log' if code == 'sl' else rate.period_ms}"
                              for rate in policy.rates)
        self.ban_suffix = f"{segment}:ban"
        self.calendar_tiers = tuple(policy.tz is not None and rate.period_ms % DAY_MS == 0
                                    for rate in policy.rates)
        # Neither a ban nor a calendar: the arguments depend on the cost alone.
        self.static = policy.penalty is None and not any(self.calendar_tiers)
        self.by_cost: dict[int, tuple[Arg, ...]] = {}

    def static_args(self, cost: int) -> tuple[Arg, ...]:
        found = self.by_cost.get(cost)
        if found is None:
            found = tuple(arg for rate in self.policy.rates
                          for arg in (self.code, rate.limit, rate.period_ms, cost, 0, "", ""))
            if len(self.by_cost) < 64:  # costs are few in practice; never grow unbounded
                self.by_cost[cost] = found
        return found

    def tier_args(self, cost: int, ban_index: int, ban: str, app_ms: int) -> list[Arg]:
        """The seven arguments of every tier when a ban or a calendar is involved."""
        zone = self.policy.tz
        cal = schedule(zone, app_ms) if zone is not None else ""
        out: list[Arg] = []
        for rate, calendar in zip(self.policy.rates, self.calendar_tiers, strict=True):
            out += (self.code, rate.limit, rate.period_ms, cost, ban_index, ban,
                    cal if calendar else "")
        return out


def wire(policy: Policy) -> Wire:
    """The policy's wire data, built on first use and kept in the policy's reserved slot."""
    found = policy._wire
    if not isinstance(found, Wire):
        found = Wire(policy)
        policy._wire = found
    return found


def code(policy: Policy) -> str:
    """The algorithm's code in keys and arguments: fw, sl, sw, gc or cc (in-flight slots)."""
    return CODES[policy.algorithm]


def ban_end(policy: Policy) -> str:
    """The ban argument for a hit: "" (no penalty, or a callable's None: no ban starts),
    "d<ms>" or "a<absolute ms>"."""
    if policy.penalty is None:
        return ""
    if policy.penalty_ms:
        return f"d{policy.penalty_ms}"
    end = policy.penalty()  # type: ignore[operator]
    if end is None:
        return ""
    if not isinstance(end, _dt.datetime) or end.tzinfo is None or end.utcoffset() is None:
        raise ConfigurationError(
            f"the penalty callable of {policy.name!r} must return an aware datetime or None, "
            f"got {end!r}; e.g. lambda: datetime.now(ZoneInfo('Asia/Shanghai')).replace(...)"
        )
    return f"a{int(end.timestamp() * 1000)}"
