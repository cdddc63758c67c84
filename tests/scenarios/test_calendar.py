"""Calendar windows: "100 uploads a day, reset at local midnight".

A fixed-window policy with ``tz=`` runs each whole-day tier from local midnight to local
midnight in that IANA zone (23 or 25 hours across a DST change; weeks start on Monday), and a
refusal's Retry-After points at that midnight. Expected instants are written out in UTC here,
not computed with the library's own method.
"""

from __future__ import annotations

import datetime as dt
import math
from typing import Any

import pytest

import ratelimit_mw as rl
from ratelimit_mw.http.headers import retry_after_seconds

from ._helpers import UTC, keys_under, local, ms, set_ms, set_time


def utc(*args: int) -> dt.datetime:
    return dt.datetime(*args, tzinfo=UTC)  # type: ignore[misc]


def seconds_until(clock: Any, when: dt.datetime) -> float:
    return (ms(when.timestamp()) - ms(clock.now)) / 1000


def daily(zone: str, limit: int = 1, **kwargs: Any) -> rl.Policy:
    return rl.Policy(f"{limit}/day", algorithm="fixed-window", tz=zone, **kwargs)


def test_a_hundred_uploads_a_day_reset_at_midnight_in_shanghai(
    limiter: rl.Limiter, clock: Any
) -> None:
    uploads = daily("Asia/Shanghai", 100, name="uploads")
    set_time(clock, local("Asia/Shanghai", 2026, 5, 1, 9, 0))
    for _ in range(100):
        assert limiter.hit(uploads, "u1").allowed
        clock.advance(60)
    refused = limiter.hit(uploads, "u1")
    midnight = utc(2026, 5, 1, 16)  # 2026-05-02 00:00 in Shanghai (UTC+8)
    assert not refused.allowed and refused.retry_after == seconds_until(clock, midnight)
    assert retry_after_seconds(refused) == math.ceil(seconds_until(clock, midnight))
    set_ms(clock, ms(midnight.timestamp()) - 1)
    assert limiter.hit(uploads, "u1").retry_after == pytest.approx(0.001, abs=1e-6)
    set_ms(clock, ms(midnight.timestamp()))
    fresh = limiter.hit(uploads, "u1")
    assert (fresh.allowed, fresh.remaining) == (True, 99)
    assert fresh.reset_after == 86_400.0


@pytest.mark.parametrize(
    ("zone", "day", "starts", "ends", "hours"),
    [
        ("Europe/Paris", (2026, 3, 29), utc(2026, 3, 28, 23), utc(2026, 3, 29, 22), 23),
        ("Europe/Paris", (2026, 10, 25), utc(2026, 10, 24, 22), utc(2026, 10, 25, 23), 25),
        ("America/New_York", (2026, 3, 8), utc(2026, 3, 8, 5), utc(2026, 3, 9, 4), 23),
        ("America/New_York", (2026, 11, 1), utc(2026, 11, 1, 4), utc(2026, 11, 2, 5), 25),
        # Chile moves its clocks AT midnight: that day starts at 01:00 local.
        ("America/Santiago", (2026, 9, 6), utc(2026, 9, 6, 4), utc(2026, 9, 7, 3), 23),
    ],
    ids=["paris-spring", "paris-autumn", "new-york-spring", "new-york-autumn",
         "santiago-no-midnight"],
)
def test_a_day_across_a_dst_change_runs_midnight_to_midnight(
    limiter: rl.Limiter, clock: Any, zone: str, day: tuple[int, int, int],
    starts: dt.datetime, ends: dt.datetime, hours: int,
) -> None:
    assert (ends - starts) == dt.timedelta(hours=hours)
    policy = daily(zone)
    set_ms(clock, ms(starts.timestamp()) - 1)  # the last millisecond of the day before
    assert limiter.hit(policy, "u1").allowed
    set_ms(clock, ms(starts.timestamp()))
    first = limiter.hit(policy, "u1")
    assert first.allowed and first.reset_after == hours * 3600
    clock.advance(30 * 60)
    refused = limiter.hit(policy, "u1")
    assert refused.retry_after == hours * 3600 - 30 * 60
    set_ms(clock, ms(ends.timestamp()) - 1)
    assert not limiter.hit(policy, "u1").allowed
    set_ms(clock, ms(ends.timestamp()))
    assert limiter.hit(policy, "u1").allowed


def test_week_windows_start_on_monday_at_local_midnight(limiter: rl.Limiter, clock: Any) -> None:
    weekly = rl.Policy("3/week", algorithm="fixed-window", tz="Europe/Paris")
    set_time(clock, local("Europe/Paris", 2026, 4, 1, 12))  # a Wednesday
    for _ in range(3):
        assert limiter.hit(weekly, "u1").allowed
    monday = utc(2026, 4, 5, 22)  # Monday 2026-04-06 00:00 CEST
    assert limiter.hit(weekly, "u1").retry_after == seconds_until(clock, monday)


def test_a_week_holding_the_spring_change_lasts_167_hours(limiter: rl.Limiter, clock: Any) -> None:
    weekly = rl.Policy("1/week", algorithm="fixed-window", tz="Europe/Paris")
    set_time(clock, local("Europe/Paris", 2026, 3, 23))  # Monday 00:00 CET = 03-22 23:00Z
    first = limiter.hit(weekly, "u1")
    assert first.allowed and first.reset_after == 167 * 3600


def test_multi_day_windows_align_to_local_days_counted_from_1970(
    limiter: rl.Limiter, clock: Any
) -> None:
    # 2026-05-01 is day 20574 since 1970-01-01: an even day opens each 2-day window.
    policy = rl.Policy("1/2 days", algorithm="fixed-window", tz="Asia/Shanghai")
    set_time(clock, local("Asia/Shanghai", 2026, 5, 2, 10))
    assert limiter.hit(policy, "u1").allowed
    assert limiter.hit(policy, "u1").retry_after == 14 * 3600  # to 2026-05-03 00:00


def test_tiers_shorter_than_a_day_stay_aligned_to_the_epoch(
    limiter: rl.Limiter, clock: Any
) -> None:
    # Kolkata is UTC+5:30: an epoch-aligned hour runs from :30 to :30 local time.
    policy = rl.Policy("2/hour;5/day", algorithm="fixed-window", tz="Asia/Kolkata")
    set_time(clock, local("Asia/Kolkata", 2026, 5, 1, 10, 45))  # 05:15Z
    assert limiter.hit(policy, "u1").allowed
    assert limiter.hit(policy, "u1").allowed
    refused = limiter.hit(policy, "u1")
    assert refused.rate == rl.Rate(2, 3_600_000)
    assert refused.retry_after == 45 * 60  # to 06:00Z = 11:30 local, not 11:00
    day = next(t for t in refused.tiers if t.rate.period_ms == 86_400_000)
    assert day.allowed and day.reset_after == seconds_until(clock, utc(2026, 5, 1, 18, 30))


def test_the_counter_in_redis_expires_at_local_midnight(
    redis_backend: rl.RedisBackend, redis_client: Any, prefix: str, clock: Any
) -> None:
    limiter = rl.Limiter(redis_backend, prefix=prefix, clock=clock)
    set_time(clock, local("Asia/Shanghai", 2026, 5, 1, 23, 0))
    assert limiter.hit(daily("Asia/Shanghai", 100), "u1").allowed
    (key,) = keys_under(redis_client, prefix)
    assert 3_590_000 < redis_client.pttl(key) <= 3_600_000


def test_a_refund_counts_in_the_local_day_it_was_made(limiter: rl.Limiter, clock: Any) -> None:
    policy = daily("Europe/Paris", 2)
    set_time(clock, local("Europe/Paris", 2026, 3, 29, 23, 30))
    assert limiter.hit(policy, "u1").allowed
    assert limiter.hit(policy, "u1").allowed
    limiter.refund(policy, "u1")
    assert limiter.hit(policy, "u1").allowed
    assert not limiter.hit(policy, "u1").allowed


async def test_async_daily_quota_resets_at_local_midnight(
    alimiter: rl.AsyncLimiter, clock: Any
) -> None:
    uploads = daily("America/New_York", 2, name="uploads")
    set_time(clock, local("America/New_York", 2026, 11, 1, 12))
    assert (await alimiter.hit(uploads, "u1")).allowed
    assert (await alimiter.hit(uploads, "u1")).allowed
    refused = await alimiter.hit(uploads, "u1")
    assert refused.retry_after == seconds_until(clock, utc(2026, 11, 2, 5))
    set_time(clock, utc(2026, 11, 2, 5))
    assert (await alimiter.hit(uploads, "u1")).allowed
