"""Refund: count only what should count (e.g. failed logins).

The hit is recorded first and given back afterwards — never test-then-hit. For every
algorithm a refund gives back exactly the hit just admitted (the state is as if it had never
happened, now and later), never takes the count below zero (no credit for hits never made),
and, on a sliding log, never takes back a future booking.
"""

from __future__ import annotations

from typing import Any

import pytest

import ratelimit_mw as rl
from ratelimit_mw.core import codec

from ._helpers import at

ALGORITHMS = sorted(rl.ALGORITHMS)


def view(decision: rl.Decision) -> tuple[bool, int, float, float]:
    return (decision.allowed, decision.remaining, decision.retry_after, decision.reset_after)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_refund_gives_back_exactly_the_hit_just_admitted(
    limiter: rl.Limiter, clock: Any, algorithm: str
) -> None:
    policy = rl.Policy("3/minute", algorithm=algorithm)
    clock.advance(5)  # inside a fixed window, not on its edge
    for who in ("refunded", "untouched"):
        assert limiter.hit(policy, who).allowed
    clock.advance(10)
    assert limiter.hit(policy, "refunded").allowed
    limiter.refund(policy, "refunded")
    # From here on the two identities must be indistinguishable.
    for step in (0, 7, 20, 30):
        clock.advance(step)
        assert view(limiter.peek(policy, "refunded")) == view(limiter.peek(policy, "untouched"))
        assert view(limiter.hit(policy, "refunded")) == view(limiter.hit(policy, "untouched"))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_refund_never_takes_the_count_below_zero(
    limiter: rl.Limiter, clock: Any, algorithm: str
) -> None:
    policy = rl.Policy("3/minute", algorithm=algorithm)
    limiter.refund(policy, "u1", cost=5)  # nothing was recorded: nothing to give back
    assert limiter.hit(policy, "u1").allowed
    limiter.refund(policy, "u1", cost=5)  # more than was recorded
    assert limiter.peek(policy, "u1").remaining == 3
    for _ in range(3):
        assert limiter.hit(policy, "u1").allowed
    refused = limiter.hit(policy, "u1")
    assert not refused.allowed and refused.remaining == 0


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_refund_of_a_costly_hit_gives_back_its_whole_cost(
    limiter: rl.Limiter, clock: Any, algorithm: str
) -> None:
    policy = rl.Policy("10/minute", algorithm=algorithm)
    assert limiter.hit(policy, "u1", cost=4).allowed
    assert limiter.hit(policy, "u1", cost=3).allowed
    limiter.refund(policy, "u1", cost=3)
    assert limiter.peek(policy, "u1").remaining == 6


def test_a_sliding_log_gives_back_a_hit_and_a_booking_of_any_cost(
    limiter: rl.Limiter, clock: Any
) -> None:
    # Thousands of entries at once: Lua's unpack fails past about 8000 values, and the
    # script failed here where MemoryBackend gave the quota back.
    policy = rl.Policy("100000/day", algorithm="sliding-log")
    assert limiter.hit(policy, "u1", cost=9_000).allowed
    limiter.refund(policy, "u1", cost=9_000)
    assert limiter.peek(policy, "u1").remaining == 100_000
    booked = limiter.reserve(policy, "u2", at=at(clock, 3600), cost=9_000)
    assert booked.booking is not None
    limiter.cancel(booked.booking)
    assert limiter.peek(policy, "u2").remaining == 100_000


def test_a_refund_never_takes_back_a_future_booking(limiter: rl.Limiter, clock: Any) -> None:
    policy = rl.Policy("2/minute")
    assert limiter.reserve(policy, "u1", at=at(clock, 30)).allowed
    assert limiter.hit(policy, "u1").allowed
    limiter.refund(policy, "u1")
    limiter.refund(policy, "u1")  # one too many: the booking must survive it
    assert limiter.peek(policy, "u1").remaining == 1
    assert limiter.hit(policy, "u1").allowed
    assert not limiter.hit(policy, "u1").allowed
    clock.advance(90)  # the booking has left every window
    assert limiter.peek(policy, "u1").remaining == 2


def test_a_compensating_refund_takes_back_its_own_entries_not_the_newest(
    backend: Any, prefix: str, clock: Any
) -> None:
    # On a cluster, a request refused in its second slot refunds what its first slot admitted
    # (codec.refund_of keeps the hit's token): exactly that hit, even when newer ones exist.
    policy = rl.Policy("2/minute")
    limiter = rl.Limiter(backend, prefix=prefix, clock=clock, deny_cache=0)
    first = codec.build(codec.HIT, [rl.Check(policy, "u1")], prefix,
                       now_us=int(clock.now * 1_000_000))
    assert backend.run(first)[0] == 1
    clock.advance(30)
    assert limiter.hit(policy, "u1").allowed
    backend.run(codec.refund_of(first))
    assert limiter.hit(policy, "u1").allowed
    refused = limiter.hit(policy, "u1")
    assert refused.retry_after == 60.0  # both left are from now: the t=0 hit was the one removed


def test_a_refund_after_a_refusal_lets_the_next_hit_in(limiter: rl.Limiter) -> None:
    policy = rl.Policy("1/minute")
    assert limiter.hit(policy, "u1").allowed
    assert not limiter.hit(policy, "u1").allowed  # remembered by the in-process deny cache
    limiter.refund(policy, "u1")
    assert limiter.hit(policy, "u1").allowed


@pytest.mark.parametrize("algorithm", ALGORITHMS)
async def test_async_refund_gives_the_hit_back(
    alimiter: rl.AsyncLimiter, algorithm: str
) -> None:
    policy = rl.Policy("2/minute", algorithm=algorithm)
    assert (await alimiter.hit(policy, "u1")).allowed
    assert (await alimiter.hit(policy, "u1")).allowed
    await alimiter.refund(policy, "u1")
    assert (await alimiter.peek(policy, "u1")).remaining == 1
    await alimiter.refund(policy, "u1", cost=9)
    assert (await alimiter.peek(policy, "u1")).remaining == 2
