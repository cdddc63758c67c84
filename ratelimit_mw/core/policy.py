"""Policy: named tiers of rates under one algorithm, with an optional penalty and time zone.

A Policy holds what a user configures, validated; what it becomes on the wire (key segments,
script arguments, ban and calendar arguments) is the core's business (`core.wire`).
"""

from __future__ import annotations

import datetime as _dt
import math
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Literal, TypeAlias, get_args
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.core.rates import GCRA_SPAN_US, MAX_COST, Rate, emission_us, parse_rates, unit_ms

Algorithm: TypeAlias = Literal["fixed-window", "sliding-log", "sliding-window", "gcra",
                               "concurrency"]
# The rate algorithms; "concurrency" (in flight, `Policy.in_flight`) counts no rate.
ALGORITHMS: tuple[Algorithm, ...] = get_args(Algorithm)[:4]
CONCURRENCY = "concurrency"  # the algorithm of an in-flight limit
DEFAULT_ALGORITHM: Algorithm = "sliding-log"
DEFAULT_LEASE = 60.0  # seconds an in-flight slot is held at most without a renewal

Penalty: TypeAlias = (int | float | str | _dt.timedelta | Callable[[], _dt.datetime | None]
                      | None)

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


# The longest penalty: a ban's end (now + penalty, in ms) stays exact in the scripts' doubles.
MAX_PENALTY_MS = 2**52
# The longest in-flight lease, in seconds (31 years): a holder renews every third of it, and a
# thread waits at most threading.TIMEOUT_MAX (292 years) at once.
MAX_LEASE = 10**9


def _max_cost(algorithm: str, rates: Sequence[Rate]) -> int:
    """The largest cost a hit, an estimate or a settle of this policy may carry (`MAX_COST`;
    GCRA: what keeps cost x emission interval within `GCRA_SPAN_US`; in-flight: the slots,
    one member each)."""
    if algorithm == "gcra":
        for rate in rates:
            if rate.limit * emission_us(rate) > GCRA_SPAN_US:
                raise ConfigurationError(
                    f"gcra counts {rate} in microseconds: a period of at most "
                    f"{GCRA_SPAN_US // 1000 // 86_400_000:,} days fits; use a shorter period or "
                    f'another algorithm, e.g. Policy("{rate}", algorithm="sliding-window")')
        return min(GCRA_SPAN_US // emission_us(rate) for rate in rates)
    if algorithm == "concurrency":
        return rates[0].limit
    return MAX_COST


def _penalty_ms(penalty: int | float | str | _dt.timedelta) -> int:
    example = 'write penalty=3600, penalty="1 hour" or penalty=timedelta(hours=1)'
    match = _DURATION_RE.match(penalty) if isinstance(penalty, str) else None
    unit = (unit_ms(match[2]) if match[2] else 1_000) if match else None
    if isinstance(penalty, _dt.timedelta):
        amount: float = penalty.total_seconds() * 1000
    elif isinstance(penalty, (int, float)) and not isinstance(penalty, bool):
        amount = penalty * 1000
    elif match is not None and unit is not None:
        amount = float(match[1]) * unit
    else:
        raise ConfigurationError(f"cannot read the penalty {penalty!r}; {example}")
    if isinstance(amount, float) and not math.isfinite(amount):
        raise ConfigurationError(f"penalty must be a finite duration, got {penalty!r}; {example}")
    ms = int(amount)
    if ms < 1:
        raise ConfigurationError(f"penalty must be positive, got {penalty!r}; {example}")
    if ms > MAX_PENALTY_MS:
        raise ConfigurationError(f"penalty must be at most {MAX_PENALTY_MS:,} ms (about 142,000 "
                                 f"years), got {penalty!r}; {example}")
    return ms


class Policy:
    """Tiers of rates enforced together, e.g. ``Policy("1/minute;5/hour;10/day")``: a hit is
    admitted only if every tier admits it (and then it counts in every tier).

    - ``algorithm``: ``"sliding-log"`` (default, exact), ``"sliding-window"`` (O(1), an
      approximation), ``"gcra"`` (O(1), smooth) or ``"fixed-window"`` (O(1), bursts of up to
      2 x limit across a window boundary); ``"concurrency"`` counts what is in flight
      (``Policy.in_flight(4)``: slots held until given back, or until their lease ends).
    - ``name``: names the counters (two policies with one name and algorithm share them) and
      the headers; defaults to the rate text.
    - ``penalty``: refuse every hit for this long after a refusal: seconds, ``"1 hour"``, a
      ``timedelta``, or a zero-argument callable returning an aware datetime (the ban's end)
      or None (no ban for this refusal). A policy with a penalty also obeys the pauses that
      ``limiter.pause`` sets (a provider's 429): ``penalty=lambda: None`` obeys them only.
    - ``tz``: fixed-window only; tiers of whole days run from local midnight in this IANA zone.
    """

    __slots__ = ("_wire", "algorithm", "max_cost", "name", "penalty", "penalty_ms", "rates",
                 "smallest_limit", "tz")

    def __init__(
        self,
        rates: str | Rate | Sequence[Rate],
        algorithm: Algorithm = DEFAULT_ALGORITHM,
        name: str | None = None,
        penalty: Penalty = None,
        tz: str | None = None,
    ) -> None:
        if isinstance(rates, str):
            parsed = parse_rates(rates)
        elif isinstance(rates, Rate):
            parsed = (rates,)
        elif isinstance(rates, Sequence) and rates and all(isinstance(r, Rate) for r in rates):
            parsed = tuple(r for r in rates if isinstance(r, Rate))
        else:
            raise ConfigurationError(
                f"cannot read the rates {rates!r}; write Policy(\"10/minute\"), "
                'Policy("1/minute;5/hour") or Policy([Rate(10, 60_000)])'
            )
        periods = [r.period_ms for r in parsed]
        if len(set(periods)) != len(periods):
            raise ConfigurationError(
                f"two tiers of {rates!r} share a period; keep the smaller limit, e.g. "
                '"5/minute;100/hour"'
            )
        # Checked at run time too: mypy catches a typo only where the caller is type-checked.
        if not isinstance(algorithm, str) or algorithm not in get_args(Algorithm):
            raise ConfigurationError(
                f"unknown algorithm {algorithm!r}; choose one of "
                + ", ".join(repr(a) for a in ALGORITHMS)
                + ', e.g. Policy("10/minute", algorithm="gcra")'
            )
        if name is None:
            name = ";".join(str(r) for r in parsed)
        elif not isinstance(name, str) or not name:
            raise ConfigurationError(
                f'a policy name must be a non-empty string, got {name!r}; e.g. name="login"'
            )
        if algorithm == "concurrency" and (len(parsed) > 1 or penalty is not None):
            raise ConfigurationError(
                f"an in-flight limit has one number and one lease, and no penalty, got "
                f"{rates!r}; write Policy.in_flight(4) or Policy.in_flight(4, lease=300)"
            )
        zone: ZoneInfo | None = None
        if tz is not None:
            if algorithm != "fixed-window":
                raise ConfigurationError(
                    f"tz= aligns fixed windows to local midnight; it does not apply to "
                    f'{algorithm!r}. Write Policy("100/day", algorithm="fixed-window", tz={tz!r})'
                )
            try:
                zone = ZoneInfo(tz)
            except (ZoneInfoNotFoundError, ValueError, TypeError) as exc:
                raise ConfigurationError(
                    f'unknown time zone {tz!r}; use an IANA name such as tz="Asia/Shanghai"'
                ) from exc
        self.rates: tuple[Rate, ...] = parsed
        self.smallest_limit: int = min(rate.limit for rate in parsed)
        self.max_cost: int = _max_cost(algorithm, parsed)
        self.algorithm: Algorithm = algorithm
        self.name: str = name
        self.tz: ZoneInfo | None = zone
        self.penalty: Penalty = penalty
        self.penalty_ms = 0 if penalty is None or callable(penalty) else _penalty_ms(penalty)
        # Reserved for core.wire: what this policy becomes on the wire, built on first use.
        self._wire: object = None

    @classmethod
    def in_flight(cls, slots: int, *, lease: float = DEFAULT_LEASE,
                  name: str | None = None) -> Policy:
        """At most `slots` at once per identity, across every process sharing the store: a
        slot is held until given back, or for `lease` seconds at most (a holder that died;
        a long holder renews it)."""
        if type(slots) is not int or slots < 1:
            raise ConfigurationError(
                f"an in-flight limit is a whole number of slots (at least 1), got {slots!r}; "
                "e.g. concurrency=4")
        if (isinstance(lease, bool) or not isinstance(lease, (int, float)) or lease < 0.01
                or not lease <= MAX_LEASE):
            raise ConfigurationError(
                f"an in-flight lease is seconds (at least 0.01, at most {MAX_LEASE:,}), got "
                f"{lease!r}; e.g. lease=60")
        return cls([Rate(slots, int(lease * 1000))], algorithm="concurrency",
                   name=name or f"{slots} in flight")

    def __repr__(self) -> str:
        if self.algorithm == "concurrency":
            return (f"Policy.in_flight({self.rates[0].limit}, "
                    f"lease={self.rates[0].period_ms / 1000:g}, name={self.name!r})")
        extra = "" if self.penalty is None else f", penalty={self.penalty!r}"
        extra += "" if self.tz is None else f", tz={self.tz.key!r}"
        rates = ";".join(map(str, self.rates))
        return f"Policy({rates!r}, algorithm={self.algorithm!r}, name={self.name!r}{extra})"


def as_policy(value: Policy | str, *, name: str | None = None) -> Policy:
    """Accept a Policy or a rate string (default algorithm) wherever a policy is configured."""
    if isinstance(value, Policy):
        return value
    if isinstance(value, str):
        return Policy(value, name=name)
    raise ConfigurationError(
        f'expected a Policy or a rate string such as "10/minute", got {value!r}'
    )


def check_shared_logs(policies: Iterable[Policy]) -> None:
    """Raise ConfigurationError where sliding-log namesakes disagree on their longest window.

    Policies of one name and algorithm share their counters; for `sliding-log` that is one
    log of hits for all of a policy's tiers, which every call trims to, and keeps alive for,
    its own policy's longest window: namesakes with different longest windows would drop
    hits the longer one still counts, and admit more than it says.
    """
    first_of_name: dict[str, Policy] = {}
    for policy in policies:
        if policy.algorithm != "sliding-log":
            continue
        seen = first_of_name.setdefault(policy.name, policy)
        if _window(seen) != _window(policy):
            raise ConfigurationError(
                f"the sliding-log policies {seen!r} and {policy!r} share the name "
                f"{policy.name!r}, so they count in one log of hits, but they keep it for "
                f"different windows ({_window(seen)} and {_window(policy)}): the shorter "
                f"would drop hits the longer still counts. Give them different names, or "
                f"one longest window (e.g. both Policy(\"{_tiers(seen, policy)}\", "
                f"name={policy.name!r}))"
            )


class SharedLogs:
    """The sliding-log policies configured on one limiter so far, one per name, for
    `check_shared_logs` across decorators applied one by one and a middleware's limits."""

    __slots__ = ("_by_name",)

    def __init__(self) -> None:
        self._by_name: dict[str, Policy] = {}

    def add(self, policies: Iterable[Policy]) -> None:
        """Record `policies`, or none of them when one's namesake keeps its log for another
        window (ConfigurationError)."""
        fresh = [policy for policy in policies if policy.algorithm == "sliding-log"]
        check_shared_logs([*(self._by_name[p.name] for p in fresh if p.name in self._by_name),
                           *fresh])
        for policy in fresh:
            self._by_name.setdefault(policy.name, policy)


def _window(policy: Policy) -> str:
    """The longest tier's period as its rate text writes it ("1 minute", "3 hours"): one text
    per period."""
    period = str(max(policy.rates, key=lambda r: r.period_ms)).partition("/")[2]
    return period if period[:1].isdigit() else f"1 {period}"


def _tiers(*policies: Policy) -> str:
    """The tiers of `policies` as one rate text, the smaller limit for a period in both."""
    rates = [rate for policy in policies for rate in policy.rates]
    return ";".join(str(min((rate for rate in rates if rate.period_ms == period),
                            key=lambda rate: rate.limit))
                    for period in sorted({rate.period_ms for rate in rates}))
