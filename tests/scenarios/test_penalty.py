"""Penalties: a refusal bans the identity; every hit is refused until the ban ends.

"10 likes in 10 seconds, then banned for an hour." The ban is started by the very script that
refuses (so two workers cannot both slip a hit in), lives in the store under its own TTL,
answers Retry-After with the time left, and `reset` lifts it. Each scenario runs on memory and
on Redis; "another worker" is a second limiter on the same store with no in-process cache,
so what it sees is what the store holds.
"""

from __future__ import annotations

import datetime as dt
import math
from typing import Any
from zoneinfo import ZoneInfo

import pytest

import ratelimit_mw as rl

from ._helpers import at, keys_under, local, ms, set_ms, set_time

LIKES = "10/10 seconds"
SHANGHAI = ZoneInfo("Asia/Shanghai")


def other_worker(backend: Any, prefix: str, clock: Any) -> rl.Limiter:
    """A second process's limiter: same store, no deny cache, so it asks the store."""
    return rl.Limiter(backend, prefix=prefix, clock=clock, deny_cache=0)


def like_ten_times(limiter: rl.Limiter, policy: rl.Policy, clock: Any, who: str = "u1") -> None:
    for _ in range(10):
        assert limiter.hit(policy, who).allowed
        clock.advance(0.5)


@pytest.mark.parametrize("penalty", [3600, 3600.0, "1 hour", "60 minutes", "1h",
                                     dt.timedelta(hours=1)])
def test_ten_likes_in_ten_seconds_then_banned_for_an_hour(
    limiter: rl.Limiter, backend: Any, prefix: str, clock: Any, penalty: Any
) -> None:
    policy = rl.Policy(LIKES, name="likes", penalty=penalty)
    like_ten_times(limiter, policy, clock)
    refused = limiter.hit(policy, "u1")
    assert (refused.allowed, refused.banned, refused.remaining) == (False, True, 0)
    assert refused.retry_after == 3600.0
    refused_at = clock.now
    # The window empties after 10 s; the ban does not. Every worker sees it.
    for elapsed in (10, 60, 1800, 3599.999):
        set_ms(clock, ms(refused_at + elapsed))
        for view in (limiter, other_worker(backend, prefix, clock)):
            decision = view.hit(policy, "u1")
            assert (decision.allowed, decision.banned) == (False, True)
            assert decision.retry_after == pytest.approx(3600 - elapsed, abs=1e-6)
    clock.advance(0.001)
    assert limiter.hit(policy, "u1").allowed
    assert limiter.hit(policy, "someone else").allowed


def test_hits_during_the_ban_do_not_extend_it(limiter: rl.Limiter, clock: Any) -> None:
    policy = rl.Policy(LIKES, penalty="1 hour")
    like_ten_times(limiter, policy, clock)
    assert limiter.hit(policy, "u1").banned
    for _ in range(30):
        clock.advance(60)
        assert not limiter.hit(policy, "u1").allowed
    clock.advance(1800)  # 3600 s after the refusal
    assert limiter.hit(policy, "u1").allowed


def test_the_ban_lives_in_redis_with_its_own_ttl_and_reset_lifts_it(
    redis_backend: rl.RedisBackend, redis_client: Any, prefix: str, clock: Any
) -> None:
    limiter = rl.Limiter(redis_backend, prefix=prefix, clock=clock)
    policy = rl.Policy(LIKES, name="likes", penalty=3600)
    like_ten_times(limiter, policy, clock)
    assert limiter.hit(policy, "u1").banned
    bans = [k for k in keys_under(redis_client, prefix) if k.endswith(b":ban")]
    assert len(bans) == 1
    assert 3_590_000 < redis_client.pttl(bans[0]) <= 3_600_000  # its own TTL: the ban's end
    limiter.reset(policy, "u1")
    assert keys_under(redis_client, prefix) == []
    decision = other_worker(redis_backend, prefix, clock).hit(policy, "u1")
    assert (decision.allowed, decision.banned) == (True, False)


def test_reset_lifts_the_ban_on_every_backend(limiter: rl.Limiter, clock: Any) -> None:
    policy = rl.Policy(LIKES, penalty=3600)
    like_ten_times(limiter, policy, clock)
    assert limiter.hit(policy, "u1").banned
    limiter.reset(policy, "u1")
    assert limiter.hit(policy, "u1").allowed


def test_peek_reports_the_ban_and_never_starts_one(
    limiter: rl.Limiter, clock: Any
) -> None:
    policy = rl.Policy(LIKES, penalty=3600)
    like_ten_times(limiter, policy, clock)
    full = limiter.peek(policy, "u1")
    assert (full.allowed, full.banned) == (False, False)
    clock.advance(10)
    for _ in range(10):  # peeking at a full window banned nobody
        assert limiter.hit(policy, "u1").allowed
    assert limiter.hit(policy, "u1").banned
    clock.advance(100)
    seen = limiter.peek(policy, "u1")
    assert (seen.allowed, seen.banned, seen.retry_after) == (False, True, 3500.0)


def next_local_midnight(clock: Any, zone: ZoneInfo = SHANGHAI) -> dt.datetime:
    today = dt.datetime.fromtimestamp(clock.now, zone).date()
    return dt.datetime.combine(today + dt.timedelta(days=1), dt.time(), tzinfo=zone)


def test_a_ban_until_local_midnight_ends_exactly_at_midnight(
    limiter: rl.Limiter, backend: Any, prefix: str, clock: Any
) -> None:
    set_time(clock, local("Asia/Shanghai", 2026, 5, 1, 23, 0))
    policy = rl.Policy("5/minute", name="comments", penalty=lambda: next_local_midnight(clock))
    for _ in range(5):
        assert limiter.hit(policy, "u1").allowed
    refused = limiter.hit(policy, "u1")
    assert (refused.banned, refused.retry_after) == (True, 3600.0)
    midnight_ms = ms(local("Asia/Shanghai", 2026, 5, 2).timestamp())
    set_ms(clock, midnight_ms - 1)
    for view in (limiter, other_worker(backend, prefix, clock)):
        last = view.hit(policy, "u1")
        assert (last.allowed, last.banned) == (False, True)
        assert last.retry_after == pytest.approx(0.001, abs=1e-6)
    set_ms(clock, midnight_ms)
    assert limiter.hit(policy, "u1").allowed


@pytest.mark.parametrize("offset", [0, -1, -3600])
def test_a_ban_end_not_in_the_future_starts_no_ban(
    limiter: rl.Limiter, clock: Any, offset: float
) -> None:
    policy = rl.Policy("2/minute", penalty=lambda: at(clock, offset))
    assert limiter.hit(policy, "u1").allowed
    assert limiter.hit(policy, "u1").allowed
    refused = limiter.hit(policy, "u1")
    assert (refused.allowed, refused.banned, refused.retry_after) == (False, False, 60.0)
    clock.advance(60)
    assert limiter.hit(policy, "u1").allowed


def test_a_penalty_callable_returning_a_naive_datetime_is_a_configuration_error(
    limiter: rl.Limiter,
) -> None:
    policy = rl.Policy("2/minute", penalty=lambda: dt.datetime(2030, 1, 1))
    with pytest.raises(rl.ConfigurationError, match="aware datetime"):
        limiter.hit(policy, "u1")


def test_only_a_refusal_by_the_penalised_policy_starts_its_ban(
    limiter: rl.Limiter, clock: Any
) -> None:
    lenient = rl.Policy("100/minute", name="lenient", penalty=3600)
    strict = rl.Policy("1/minute", name="strict")
    both = [rl.Check(lenient, "u1"), rl.Check(strict, "u1")]
    assert limiter.check(both).allowed
    refused = limiter.check(both)
    assert not refused.allowed and refused.policy is strict and not refused.banned
    assert not limiter.peek(lenient, "u1").banned
    assert limiter.hit(lenient, "u1").allowed


def test_every_tier_of_a_banned_policy_reports_the_ban(limiter: rl.Limiter, clock: Any) -> None:
    policy = rl.Policy("3/second;5/minute", penalty=60)
    for _ in range(5):
        assert limiter.hit(policy, "u1").allowed
        clock.advance(1)
    refused = limiter.hit(policy, "u1")
    assert refused.banned and refused.retry_after == 60.0
    assert [t.banned for t in refused.tiers] == [True, True]
    assert {t.retry_after for t in refused.tiers} == {60.0}


def test_a_cost_above_the_limit_is_never_admitted_even_after_the_ban(
    limiter: rl.Limiter, clock: Any
) -> None:
    policy = rl.Policy(LIKES, penalty=60)
    refused = limiter.hit(policy, "u1", cost=11)
    assert refused.banned and refused.retry_after == math.inf
    with pytest.raises(rl.RateLimitExceeded):
        limiter.acquire(policy, "u2", cost=11)  # "never" does not become a 60 s wait
    assert clock.now == 1_800_000_000.0


def test_acquire_waits_out_a_ban_or_gives_up_when_it_outlasts_the_timeout(
    limiter: rl.Limiter, clock: Any
) -> None:
    policy = rl.Policy(LIKES, penalty=600)
    like_ten_times(limiter, policy, clock)
    assert limiter.hit(policy, "u1").banned
    with pytest.raises(rl.RateLimitExceeded) as caught:
        limiter.acquire(policy, "u1", timeout=60)
    assert caught.value.decision.banned and caught.value.decision.retry_after == 600.0
    started = clock.now
    assert limiter.acquire(policy, "u1").allowed
    assert 600 <= clock.now - started <= 600.05


async def test_async_ten_likes_then_banned_until_the_ban_ends(
    alimiter: rl.AsyncLimiter, clock: Any
) -> None:
    policy = rl.Policy(LIKES, name="likes", penalty="1 hour")
    for _ in range(10):
        assert (await alimiter.hit(policy, "u1")).allowed
    refused = await alimiter.hit(policy, "u1")
    assert (refused.banned, refused.retry_after) == (True, 3600.0)
    clock.advance(3599.999)
    assert (await alimiter.peek(policy, "u1")).banned
    clock.advance(0.001)
    assert (await alimiter.hit(policy, "u1")).allowed
    await alimiter.reset(policy, "u1")


async def test_async_ban_until_midnight_and_reset(alimiter: rl.AsyncLimiter, clock: Any) -> None:
    set_time(clock, local("Asia/Shanghai", 2026, 5, 1, 22, 30))
    policy = rl.Policy("1/minute", penalty=lambda: next_local_midnight(clock))
    assert (await alimiter.hit(policy, "u1")).allowed
    refused = await alimiter.hit(policy, "u1")
    assert (refused.banned, refused.retry_after) == (True, 5400.0)
    await alimiter.reset(policy, "u1")
    assert (await alimiter.hit(policy, "u1")).allowed
