"""Scheduled bookings: "push at most 1 message a minute, 5 an hour, 10 a day per user, for
messages scheduled at arbitrary times".

`reserve(at=...)` admits a booking only if every window of every tier that contains `at` stays
within its limit, counting the bookings already made before AND after `at`; hits and bookings
share one log; a refusal's retry_after is how much later the same booking would fit (the
oracle suite checks that on random schedules). Each scenario runs on memory and Redis.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

import ratelimit_mw as rl

from ._helpers import at, keys_under, now_ms

MINUTE, HOUR, DAY = 60, 3600, 86400
PUSH = "1/minute;5/hour;10/day"


def push() -> rl.Policy:
    return rl.Policy(PUSH, name="push")


def test_push_at_most_one_a_minute_five_an_hour_ten_a_day(limiter: rl.Limiter, clock: Any) -> None:
    policy = push()

    def book(seconds: float) -> rl.Decision:
        return limiter.reserve(policy, "u1", at=at(clock, seconds))

    # Five messages in the 9 o'clock hour (booked out of order), a minute apart at least.
    for minute in (30, 10, 50, 20, 40):
        assert book(HOUR + minute * MINUTE).allowed
    too_close = book(HOUR + 10 * MINUTE + 30)
    assert not too_close.allowed and too_close.rate == rl.Rate(1, 60_000)
    sixth = book(HOUR + 55 * MINUTE)
    assert not sixth.allowed and sixth.rate == rl.Rate(5, 3_600_000)
    # The hour tier frees up once the window can slide past the 10-past message.
    assert sixth.retry_after == (HOUR + 10 * MINUTE + HOUR) - (HOUR + 55 * MINUTE)
    assert book(HOUR + 55 * MINUTE + sixth.retry_after).allowed
    # A message BEFORE the hour is refused too: the hour starting at 8:51 would hold six.
    assert not book(HOUR - 9 * MINUTE).allowed
    # Four more later in the day (the one at 10:10 was the sixth), then the day tier is full.
    for hours in (4, 5, 6):
        assert book(hours * HOUR).allowed
    tenth = book(7 * HOUR)
    assert tenth.allowed and tenth.remaining == 0
    eleventh = book(12 * HOUR)
    assert not eleventh.allowed and eleventh.rate == rl.Rate(10, 86_400_000)
    assert eleventh.retry_after == (HOUR + 10 * MINUTE + DAY) - 12 * HOUR


@pytest.mark.parametrize("order", ["earlier-first", "later-first"])
def test_bookings_exactly_one_window_apart_are_both_admitted(
    limiter: rl.Limiter, clock: Any, order: str
) -> None:
    policy = rl.Policy("1/minute")
    times = [600, 660] if order == "earlier-first" else [660, 600]
    for seconds in times:
        assert limiter.reserve(policy, "u1", at=at(clock, seconds)).allowed
    between = limiter.reserve(policy, "u1", at=at(clock, 659.999))
    assert not between.allowed
    assert between.retry_after == pytest.approx(720 - 659.999)  # after both have passed
    assert limiter.reserve(policy, "u1", at=at(clock, 540)).allowed  # one window before


def test_a_booking_before_an_existing_one_in_the_same_window_is_refused(
    limiter: rl.Limiter, clock: Any
) -> None:
    policy = rl.Policy("1/minute")
    assert limiter.reserve(policy, "u1", at=at(clock, 100)).allowed
    earlier = limiter.reserve(policy, "u1", at=at(clock, 50))  # [50 s, 110 s) would hold both
    assert not earlier.allowed and earlier.retry_after == 110.0
    assert limiter.reserve(policy, "u1", at=at(clock, 40)).allowed  # [40 s, 100 s) holds one


def test_retry_after_of_a_refused_booking_is_the_first_time_every_tier_fits(
    limiter: rl.Limiter, clock: Any
) -> None:
    # Alone, the minute tier fits again at +60 s and the hour tier at +540 s; but at +540 s
    # the minute tier refuses (a booking at +480 s), so the first time that fits both is +541 s.
    policy = rl.Policy([rl.Rate(2, 360_000), rl.Rate(1, 120_000)])
    assert limiter.reserve(policy, "u1", at=at(clock, 180)).allowed
    assert limiter.reserve(policy, "u1", at=at(clock, 480)).allowed
    refused = limiter.reserve(policy, "u1", at=at(clock, 240))
    assert not refused.allowed
    assert refused.retry_after == 600 - 240
    assert {t.retry_after for t in refused.tiers if not t.allowed} == {360.0}
    assert not limiter.reserve(policy, "u1", at=at(clock, 540)).allowed
    assert limiter.reserve(policy, "u1", at=at(clock, 240 + refused.retry_after)).allowed


def test_a_booking_of_more_than_a_limit_is_never_admitted(limiter: rl.Limiter, clock: Any) -> None:
    refused = limiter.reserve(push(), "u1", at=at(clock, 60), cost=2)
    assert not refused.allowed and refused.retry_after == math.inf


def test_hits_and_bookings_share_one_log(limiter: rl.Limiter, clock: Any) -> None:
    policy = rl.Policy("1/minute")
    assert limiter.reserve(policy, "booked", at=at(clock, 30)).allowed
    hit = limiter.hit(policy, "booked")  # [now, now + 60 s) would hold the booking too
    assert not hit.allowed and hit.retry_after == 90.0
    assert limiter.hit(policy, "hit").allowed
    assert not limiter.reserve(policy, "hit", at=at(clock, 30)).allowed
    assert limiter.reserve(policy, "hit", at=at(clock, 60)).allowed


def test_a_booking_in_the_past_counts_as_a_hit_now(limiter: rl.Limiter, clock: Any) -> None:
    policy = rl.Policy("1/minute")
    assert limiter.reserve(policy, "u1", at=at(clock, -3600)).allowed
    refused = limiter.hit(policy, "u1")
    assert not refused.allowed and refused.retry_after == 60.0


def test_cancel_gives_the_booked_slot_back(limiter: rl.Limiter, clock: Any) -> None:
    policy = push()
    first = limiter.reserve(policy, "u1", at=at(clock, 600), cost=1)
    booking = first.booking
    assert booking is not None
    assert (booking.policy, booking.identity, booking.cost) == (policy, "u1", 1)
    assert booking.at_ms == now_ms(clock) + 600_000
    refused = limiter.reserve(policy, "u1", at=at(clock, 630))
    assert not refused.allowed and refused.booking is None
    limiter.cancel(booking)
    assert limiter.reserve(policy, "u1", at=at(clock, 630)).allowed
    limiter.cancel(booking)  # cancelling twice changes nothing
    assert not limiter.reserve(policy, "u1", at=at(clock, 600)).allowed


def test_cancel_takes_back_every_unit_of_one_booking_only(limiter: rl.Limiter, clock: Any) -> None:
    policy = rl.Policy("3/minute")
    two = limiter.reserve(policy, "u1", at=at(clock, 10), cost=2).booking
    assert two is not None
    assert limiter.reserve(policy, "u1", at=at(clock, 20)).allowed
    assert limiter.peek(policy, "u1").remaining == 0
    limiter.cancel(two)
    assert limiter.reserve(policy, "u1", at=at(clock, 15), cost=2).allowed
    assert not limiter.reserve(policy, "u1", at=at(clock, 16)).allowed


def test_the_log_expires_when_the_last_booking_has_left_every_window(
    redis_backend: rl.RedisBackend, redis_client: Any, prefix: str, clock: Any
) -> None:
    limiter = rl.Limiter(redis_backend, prefix=prefix, clock=clock)
    policy = push()
    soon = limiter.reserve(policy, "u1", at=at(clock, 10 * MINUTE)).booking
    late = limiter.reserve(policy, "u1", at=at(clock, 2 * HOUR)).booking
    assert soon is not None and late is not None
    (log,) = keys_under(redis_client, prefix)
    assert (2 * HOUR + DAY) * 1000 - 1000 < redis_client.pttl(log) <= (2 * HOUR + DAY) * 1000
    limiter.cancel(late)  # the log now needs to outlive the 10-minute booking only
    assert (10 * MINUTE + DAY) * 1000 - 1000 < redis_client.pttl(log) <= (10 * MINUTE + DAY) * 1000
    limiter.cancel(soon)
    assert keys_under(redis_client, prefix) == []


def test_reserve_needs_a_sliding_log_policy_and_an_aware_time(
    limiter: rl.Limiter, clock: Any
) -> None:
    for algorithm in ("fixed-window", "sliding-window", "gcra"):
        with pytest.raises(rl.ConfigurationError, match='algorithm="sliding-log"'):
            limiter.reserve(rl.Policy("1/minute", algorithm=algorithm), "u1", at=at(clock, 60))
    naive = at(clock, 60).replace(tzinfo=None)
    with pytest.raises(rl.ConfigurationError, match="aware datetime"):
        limiter.reserve(push(), "u1", at=naive)


async def test_async_bookings_cancel_and_retry_after(alimiter: rl.AsyncLimiter, clock: Any) -> None:
    policy = push()
    first = await alimiter.reserve(policy, "u1", at=at(clock, HOUR))
    assert first.allowed and first.booking is not None
    refused = await alimiter.reserve(policy, "u1", at=at(clock, HOUR - 30))
    assert not refused.allowed and refused.retry_after == 90.0
    assert (await alimiter.reserve(policy, "u1", at=at(clock, HOUR + 60))).allowed
    await alimiter.cancel(first.booking)
    assert (await alimiter.reserve(policy, "u1", at=at(clock, HOUR - 30))).allowed
