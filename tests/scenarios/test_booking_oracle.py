"""Scheduled bookings against a brute-force oracle, on the memory backend and on Redis.

The oracle knows nothing of the scripts' sweeps: for a booking at `a` it counts, for every tier
and EVERY window [s, s + period) that contains `a`, the entries already admitted (hits and
bookings, past or future) and admits only if each stays within its limit. For a refusal it
walks forward from `a` to the first time at which the same booking would fit: that is what
`retry_after` must say (infinite when the cost exceeds a limit).

Times and periods are whole multiples of a unit U (one second): every window starting between
two grid points holds the same entries as the one starting at the next grid point, so checking
the grid checks every millisecond, and the first fitting time is itself a grid point. A
second-sized unit also keeps the Redis keys alive (their TTLs are real milliseconds) for far
longer than an example takes.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import ratelimit_mw as rl

from ._helpers import at, ms

U = 1000  # ms per grid unit
START = 1_800_000_000.0


@dataclass
class Oracle:
    """Admitted entries as {time in units: count}, bookings by token; all checks by brute force."""

    tiers: list[tuple[int, int]]  # (limit, period in units)
    units: dict[int, int] = field(default_factory=dict)
    bookings: dict[str, tuple[int, int]] = field(default_factory=dict)

    def window(self, s: int, period: int) -> int:
        return sum(self.units.get(t, 0) for t in range(s, s + period))

    def peak(self, a: int, period: int) -> int:
        return max(self.window(s, period) for s in range(a - period + 1, a + 1))

    def fits(self, a: int, cost: int) -> bool:
        return all(self.peak(a, period) + cost <= limit for limit, period in self.tiers)

    def earliest(self, a: int, cost: int) -> float:
        if any(cost > limit for limit, _ in self.tiers):
            return math.inf
        b = a + 1
        while not self.fits(b, cost):  # past the last entry + the longest period, all fit
            b += 1
        return b

    def remaining(self, a: int, cost: int) -> int:
        return min(limit - self.peak(a, period) - cost for limit, period in self.tiers)

    def add(self, a: int, cost: int, token: str | None = None) -> None:
        self.units[a] = self.units.get(a, 0) + cost
        if token is not None:
            self.bookings[token] = (a, cost)

    def cancel(self, token: str) -> None:
        a, cost = self.bookings.pop(token)
        self.units[a] -= cost


tiers_strategy = st.lists(
    st.tuples(st.integers(1, 4), st.integers(1, 12)), min_size=1, max_size=3,
    unique_by=lambda tier: tier[1],
)
op_strategy = st.one_of(
    st.tuples(st.just("book"), st.integers(-3, 40), st.integers(1, 2)),
    st.tuples(st.just("hit"), st.just(0), st.integers(1, 2)),
    st.tuples(st.just("peek"), st.just(0), st.just(1)),
    st.tuples(st.just("advance"), st.integers(1, 8), st.just(0)),
    st.tuples(st.just("cancel"), st.integers(0, 50), st.just(0)),
)


@settings(max_examples=400, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tiers=tiers_strategy, ops=st.lists(op_strategy, min_size=1, max_size=30))
# Alone, each tier fits again by 9; but at 9 the 2-unit tier holds the booking at 8: first fit 10.
@example(tiers=[(2, 6), (1, 2)], ops=[("book", 3, 1), ("book", 8, 1), ("book", 4, 1)])
# Exactly one window apart: both fit; anything between does not.
@example(tiers=[(1, 5)], ops=[("book", 5, 1), ("book", 10, 1), ("book", 9, 1), ("book", 0, 1)])
def test_reserve_admits_exactly_what_every_window_allows_and_retry_after_is_the_first_fit(
    backend: Any, clock: Any, tiers: list[tuple[int, int]], ops: list[tuple[str, int, int]]
) -> None:
    clock.now = START
    # deny_cache=0: the scripts answer every call (the in-process cache is tested elsewhere).
    limiter = rl.Limiter(backend, prefix="o" + uuid.uuid4().hex[:12], clock=clock, deny_cache=0)
    policy = rl.Policy([rl.Rate(limit, period * U) for limit, period in tiers], name="push")
    oracle = Oracle(tiers)
    now = 0  # in units since START
    admitted: list[rl.Booking] = []
    for kind, value, cost in ops:
        if kind == "advance":
            clock.advance(value * U / 1000)
            now += value
            continue
        if kind == "cancel":
            if admitted:
                booking = admitted.pop(value % len(admitted))
                limiter.cancel(booking)
                oracle.cancel(booking.token)
            continue
        a = max(now, now + value)  # a booking in the past is a booking now
        if kind == "book":
            decision = limiter.reserve(policy, "u", at(clock, value * U / 1000), cost=cost)
        elif kind == "hit":
            decision = limiter.hit(policy, "u", cost=cost)
        else:
            decision = limiter.peek(policy, "u")
        expected = oracle.fits(a, cost)
        assert decision.allowed is expected, (kind, a, cost, oracle)
        if not expected:
            wait = oracle.earliest(a, cost)
            assert decision.retry_after == (math.inf if wait == math.inf else (wait - a)), (
                kind, a, cost, oracle)
            continue
        if kind == "peek":
            assert decision.remaining == oracle.remaining(a, 0)
            continue
        assert decision.remaining == oracle.remaining(a, cost)
        if kind == "book":
            assert decision.booking is not None
            admitted.append(decision.booking)
            oracle.add(a, cost, decision.booking.token)
        else:
            oracle.add(a, cost)


@pytest.mark.parametrize("unit", [1, U])
def test_the_oracle_unit_does_not_change_a_refusal(unit: int) -> None:
    """A guard on the grid argument: the oracle's answers scale with the unit."""
    oracle = Oracle([(1, 60)])
    oracle.add(100, 1)
    assert not oracle.fits(50, 1)
    assert oracle.earliest(50, 1) == 160
    assert ms(oracle.earliest(50, 1) * unit / 1000) == 160 * unit
