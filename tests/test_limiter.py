"""What each algorithm promises, at its boundaries, on the memory backend and the real Redis.

Every test runs twice (the `backend` fixture): once on MemoryBackend, once on the Redis at
127.0.0.1:6379 under a per-test prefix. Time is a drift-free fake clock handed to the scripts
as `now`, so waits are asserted to the millisecond without sleeping.
"""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING, Any

import pytest

import ratelimit_mw as rl
from ratelimit_mw.backends._log import _Log
from tests.conftest import REDIS_URL

if TYPE_CHECKING:  # a fixture's type only: several conftest modules share that name
    from conftest import StepClock

ALGORITHMS = sorted(rl.ALGORITHMS)
MINUTE_MS = 60_000


def snapshot(limiter: rl.Limiter) -> dict[Any, Any]:
    """Everything stored under the limiter's prefix, to prove that a call wrote nothing."""
    backend = limiter.backend
    if isinstance(backend, rl.MemoryBackend):
        data = backend._data
        return {
            key: (tuple(value.entries) if isinstance(value, _Log) else value,
                  backend._expires.get(key))
            for key, value in data.items()
        }
    client = backend.client
    return {key: client.dump(key)
            for key in client.scan_iter(match=f"{limiter.prefix}:*", count=1000)}


def at_window_start(clock: StepClock, period_ms: int, offset_ms: int = 0) -> None:
    """Move the clock to the next epoch-aligned window start (plus an offset)."""
    clock.set_ms(clock.ms - clock.ms % period_ms + period_ms + offset_ms)


def hits(limiter: rl.Limiter, policy: rl.Policy, identity: str, n: int,
         cost: int = 1) -> list[bool]:
    return [limiter.hit(policy, identity, cost).allowed for _ in range(n)]


# -- fixed-window ---------------------------------------------------------------------------
def test_fixed_window_counts_in_windows_aligned_to_the_epoch(
    step_limiter: rl.Limiter, step_clock: StepClock
) -> None:
    policy = rl.Policy("3/minute", algorithm="fixed-window")
    at_window_start(step_clock, MINUTE_MS, offset_ms=10_000)
    decisions = [step_limiter.hit(policy, "u") for _ in range(3)]
    assert [d.remaining for d in decisions] == [2, 1, 0]
    assert all(d.allowed and d.reset_after == 50.0 for d in decisions)
    refused = step_limiter.hit(policy, "u")
    assert not refused.allowed
    assert refused.retry_after == 50.0 and refused.remaining == 0
    step_clock.advance_ms(50_000 - 1)
    assert not step_limiter.hit(policy, "u").allowed
    step_clock.advance_ms(1)
    admitted = step_limiter.hit(policy, "u")
    assert admitted.allowed and admitted.remaining == 2 and admitted.reset_after == 60.0


def test_fixed_window_admits_twice_the_limit_across_a_boundary(
    step_limiter: rl.Limiter, step_clock: StepClock
) -> None:
    policy = rl.Policy("5/minute", algorithm="fixed-window")
    at_window_start(step_clock, MINUTE_MS, offset_ms=MINUTE_MS - 500)
    before = hits(step_limiter, policy, "u", 6)
    step_clock.advance_ms(500)  # one second holds both bursts
    after = hits(step_limiter, policy, "u", 6)
    assert before.count(True) + after.count(True) == 2 * 5
    assert before[-1] is False and after[-1] is False


# -- sliding-log ----------------------------------------------------------------------------
def test_sliding_log_retry_after_is_the_time_until_the_oldest_hit_leaves(
    step_limiter: rl.Limiter, step_clock: StepClock
) -> None:
    policy = rl.Policy("5/minute")  # the default: sliding-log
    for _ in range(5):
        assert step_limiter.hit(policy, "u").allowed
        step_clock.advance(10)
    refused = step_limiter.hit(policy, "u")  # at t=50: hits at 0, 10, 20, 30, 40
    assert not refused.allowed and refused.retry_after == 10.0
    assert refused.reset_after == 50.0  # the hit at 40 leaves at 100
    step_clock.advance_ms(10_000 - 1)
    assert not step_limiter.hit(policy, "u").allowed
    step_clock.advance_ms(1)
    admitted = step_limiter.hit(policy, "u")
    assert admitted.allowed and admitted.remaining == 0 and admitted.reset_after == 60.0


def test_sliding_log_cost_waits_for_as_many_old_hits_to_leave(
    step_limiter: rl.Limiter, step_clock: StepClock
) -> None:
    policy = rl.Policy("4/minute")
    for _ in range(4):
        step_limiter.hit(policy, "u")
        step_clock.advance(5)
    refused = step_limiter.hit(policy, "u", cost=3)  # at t=20: hits at 0, 5, 10, 15
    assert refused.retry_after == 60 + 10 - 20  # the third-oldest (at 10) must leave


def test_sliding_log_never_admits_more_than_the_limit_in_any_window(
    step_limiter: rl.Limiter, step_clock: StepClock
) -> None:
    """Exact: admitted iff the window (t - period, t] holds at most limit - cost."""
    limit, period = 5, 10_000
    policy = rl.Policy(f"{limit}/10 seconds")
    rng = random.Random(7)
    admitted: list[int] = []
    for _ in range(150):
        step_clock.advance_ms(rng.choice([0, 1, 250, 999, 1_000, 3_000]))
        cost = rng.choice([1, 1, 1, 2, 3])
        now = step_clock.ms
        in_window = sum(1 for t in admitted if now - period < t <= now)
        decision = step_limiter.hit(policy, "u", cost)
        assert decision.allowed == (in_window + cost <= limit), (now, in_window, cost)
        if decision.allowed:
            admitted += [now] * cost
            assert decision.remaining == limit - in_window - cost
        else:
            oldest_needed = sorted(t for t in admitted if now - period < t)[
                in_window + cost - limit - 1]
            assert decision.retry_after == (oldest_needed + period - now) / 1000
    for t in admitted:
        assert sum(1 for u in admitted if t - period < u <= t) <= limit


# -- sliding-window -------------------------------------------------------------------------
def test_sliding_window_weighs_the_previous_window_by_its_overlap(
    step_limiter: rl.Limiter, step_clock: StepClock
) -> None:
    policy = rl.Policy("10/minute", algorithm="sliding-window")
    at_window_start(step_clock, MINUTE_MS)
    assert hits(step_limiter, policy, "u", 10) == [True] * 10
    step_clock.advance(75)  # 15 s into the next window: the previous weighs 10 x 45/60 = 7.5
    first = step_limiter.hit(policy, "u")
    assert first.allowed and first.remaining == 1  # floor(10 - 7.5) - 1
    assert first.reset_after == 120 - 15
    assert step_limiter.hit(policy, "u").allowed  # 7.5 + 2 <= 10
    refused = step_limiter.hit(policy, "u")  # 7.5 + 3 > 10
    assert not refused.allowed
    # Admitted once 10 x (60 - e)/60 + 3 <= 10, i.e. at e = 18 s: 3 s from now.
    assert refused.retry_after == 3.0
    step_clock.advance_ms(3_000 - 1)
    assert not step_limiter.hit(policy, "u").allowed
    step_clock.advance_ms(1)
    assert step_limiter.hit(policy, "u").allowed


def test_sliding_window_full_window_waits_into_the_next_one(
    step_limiter: rl.Limiter, step_clock: StepClock
) -> None:
    policy = rl.Policy("4/minute", algorithm="sliding-window")
    at_window_start(step_clock, MINUTE_MS, offset_ms=20_000)
    assert hits(step_limiter, policy, "u", 4) == [True] * 4
    refused = step_limiter.hit(policy, "u", cost=2)
    # Next window starts in 40 s; there 4 x (60 - e)/60 + 2 <= 4 needs e >= 30 s.
    assert refused.retry_after == 70.0
    assert refused.retry_after <= 60 * (1 + 2 / 4)


# -- gcra -----------------------------------------------------------------------------------
def test_gcra_admits_a_burst_of_the_limit_then_one_per_interval(
    step_limiter: rl.Limiter, step_clock: StepClock
) -> None:
    policy = rl.Policy("5/minute", algorithm="gcra")
    burst = [step_limiter.hit(policy, "u") for _ in range(5)]
    assert all(d.allowed for d in burst)
    assert [d.remaining for d in burst] == [4, 3, 2, 1, 0]
    assert burst[-1].reset_after == 60.0
    refused = step_limiter.hit(policy, "u")
    assert not refused.allowed and refused.retry_after == 12.0  # the emission interval
    step_clock.advance_ms(12_000 - 1)
    assert not step_limiter.hit(policy, "u").allowed
    step_clock.advance_ms(1)
    assert step_limiter.hit(policy, "u").allowed
    assert step_limiter.hit(policy, "u").retry_after == 12.0


def test_gcra_cost_takes_as_many_intervals(
    step_limiter: rl.Limiter, step_clock: StepClock
) -> None:
    policy = rl.Policy("6/minute", algorithm="gcra")
    assert step_limiter.hit(policy, "u", cost=4).remaining == 2
    refused = step_limiter.hit(policy, "u", cost=3)
    assert refused.retry_after == 10.0  # one interval frees the third unit
    step_clock.advance(10)
    assert step_limiter.hit(policy, "u", cost=3).allowed


# -- every algorithm ------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_cost_counts_as_that_many_hits(step_limiter: rl.Limiter, algorithm: str) -> None:
    policy = rl.Policy("10/minute", algorithm=algorithm)
    assert step_limiter.hit(policy, "u", cost=4).remaining == 6
    assert step_limiter.hit(policy, "u", cost=4).remaining == 2
    assert not step_limiter.hit(policy, "u", cost=3).allowed
    assert step_limiter.hit(policy, "u", cost=2).remaining == 0


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_cost_above_the_limit_is_refused_forever_and_writes_nothing(
    step_limiter: rl.Limiter, algorithm: str
) -> None:
    policy = rl.Policy("3/minute", algorithm=algorithm)
    decision = step_limiter.hit(policy, "u", cost=4)
    assert not decision.allowed
    assert decision.retry_after == math.inf
    assert snapshot(step_limiter) == {}
    assert step_limiter.hit(policy, "u", cost=3).allowed


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_waiting_retry_after_is_exactly_enough(
    step_limiter: rl.Limiter, step_clock: StepClock, algorithm: str
) -> None:
    """One millisecond before retry_after the hit is still refused; at retry_after it passes."""
    policy = rl.Policy("3/2 seconds;5/10 seconds", algorithm=algorithm)
    rng = random.Random(algorithm)
    for _ in range(60):
        step_clock.advance_ms(rng.choice([0, 1, 7, 300, 999, 1500]))
        cost = rng.choice([1, 1, 2, 3])
        decision = step_limiter.hit(policy, "u", cost)
        if decision.allowed:
            continue
        wait_ms = round(decision.retry_after * 1000)
        assert wait_ms >= 1
        assert wait_ms <= 10_000 * (1 + cost / 5) + 1 if algorithm == "sliding-window" else (
            wait_ms <= 10_000)
        step_clock.advance_ms(wait_ms - 1)
        assert not step_limiter.hit(policy, "u", cost).allowed
        step_clock.advance_ms(1)
        assert step_limiter.hit(policy, "u", cost).allowed


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_refused_hit_writes_nothing(
    step_limiter: rl.Limiter, step_clock: StepClock, algorithm: str
) -> None:
    policy = rl.Policy("2/minute;3/hour", algorithm=algorithm)
    assert hits(step_limiter, policy, "u", 2) == [True, True]
    before = snapshot(step_limiter)
    assert before
    step_clock.advance(1)
    for cost in (1, 2, 5):
        assert not step_limiter.hit(policy, "u", cost).allowed
    assert snapshot(step_limiter) == before


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_peek_reports_quota_left_now_and_records_nothing(
    step_limiter: rl.Limiter, algorithm: str
) -> None:
    policy = rl.Policy("5/minute", algorithm=algorithm)
    fresh = step_limiter.peek(policy, "u")
    assert fresh.allowed and fresh.remaining == 5 and fresh.reset_after == 0.0
    assert snapshot(step_limiter) == {}
    hits(step_limiter, policy, "u", 4)
    state = snapshot(step_limiter)
    one_left = step_limiter.peek(policy, "u")
    assert one_left.allowed and one_left.remaining == 1 and one_left.retry_after == 0.0
    assert step_limiter.peek(policy, "u") == one_left
    assert snapshot(step_limiter) == state
    step_limiter.hit(policy, "u")
    empty = step_limiter.peek(policy, "u")
    assert not empty.allowed and empty.remaining == 0 and empty.retry_after > 0
    assert empty.reset_after >= empty.retry_after


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_peek_allowed_means_a_hit_of_cost_one_would_pass(
    step_limiter: rl.Limiter, step_clock: StepClock, algorithm: str
) -> None:
    policy = rl.Policy("3/10 seconds;4/minute", algorithm=algorithm)
    rng = random.Random(algorithm)
    for _ in range(40):
        step_clock.advance_ms(rng.choice([0, 500, 2_000, 7_000]))
        peeked = step_limiter.peek(policy, "u")
        hit = step_limiter.hit(policy, "u")
        assert hit.allowed == peeked.allowed
        if hit.allowed:
            assert hit.remaining == peeked.remaining - 1
        else:
            assert hit.retry_after == peeked.retry_after


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_refund_gives_back_an_admitted_hit(step_limiter: rl.Limiter, algorithm: str) -> None:
    policy = rl.Policy("3/minute;5/hour", algorithm=algorithm)
    assert hits(step_limiter, policy, "u", 4) == [True, True, True, False]
    step_limiter.refund(policy, "u")
    assert step_limiter.peek(policy, "u").remaining == 1
    assert hits(step_limiter, policy, "u", 2) == [True, False]
    step_limiter.refund(policy, "u", cost=2)
    hour = step_limiter.peek(policy, "u").tiers[1]
    assert hour.remaining == 5 - 1


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_refund_of_nothing_is_harmless(step_limiter: rl.Limiter, algorithm: str) -> None:
    policy = rl.Policy("3/minute", algorithm=algorithm)
    step_limiter.refund(policy, "u", cost=2)
    assert step_limiter.peek(policy, "u").remaining == 3
    assert hits(step_limiter, policy, "u", 4) == [True, True, True, False]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_reset_clears_every_tier_and_the_ban(step_limiter: rl.Limiter, algorithm: str) -> None:
    policy = rl.Policy("2/minute;3/hour", algorithm=algorithm, penalty="1 hour")
    assert hits(step_limiter, policy, "u", 3) == [True, True, False]
    assert step_limiter.peek(policy, "u").banned
    step_limiter.reset(policy, "u")
    assert snapshot(step_limiter) == {}
    fresh = step_limiter.peek(policy, "u")
    assert fresh.allowed and not fresh.banned
    assert [t.remaining for t in fresh.tiers] == [2, 3]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_reset_leaves_other_identities_and_policies_alone(
    step_limiter: rl.Limiter, algorithm: str
) -> None:
    policy = rl.Policy("2/minute", algorithm=algorithm)
    other = rl.Policy("2/minute", algorithm=algorithm, name="other")
    for identity in ("u", "v"):
        step_limiter.hit(policy, identity)
    step_limiter.hit(other, "u")
    step_limiter.reset(policy, "u")
    assert step_limiter.peek(policy, "u").remaining == 2
    assert step_limiter.peek(policy, "v").remaining == 1
    assert step_limiter.peek(other, "u").remaining == 1


# -- several tiers, several policies --------------------------------------------------------
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_hit_refused_by_one_tier_leaves_every_tier_untouched(
    step_limiter: rl.Limiter, step_clock: StepClock, algorithm: str
) -> None:
    policy = rl.Policy("3/minute;5/hour", algorithm=algorithm)
    assert hits(step_limiter, policy, "u", 3) == [True] * 3
    state = snapshot(step_limiter)
    refused = step_limiter.hit(policy, "u")
    assert not refused.allowed
    assert [t.allowed for t in refused.tiers] == [False, True]
    assert refused.rate == rl.Rate(3, MINUTE_MS)
    assert snapshot(step_limiter) == state
    assert [t.remaining for t in step_limiter.peek(policy, "u").tiers] == [0, 2]
    step_clock.advance(120)  # two minutes: even sliding-window has forgotten the first
    assert [t.remaining for t in step_limiter.hit(policy, "u").tiers] == [2, 1]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_check_refused_by_one_policy_records_nothing_in_the_others(
    step_limiter: rl.Limiter, algorithm: str
) -> None:
    loose = rl.Policy("10/minute", algorithm=algorithm, name="loose")
    tight = rl.Policy("1/minute", algorithm="sliding-log", name="tight")
    checks = [rl.Check(loose, "ip:1"), rl.Check(tight, "user:1"), rl.Check(loose, "user:1")]
    first = step_limiter.check(checks)
    assert first.allowed and len(first.tiers) == 3
    state = snapshot(step_limiter)
    second = step_limiter.check(checks)
    assert not second.allowed and second.policy is tight and second.identity == "user:1"
    assert snapshot(step_limiter) == state
    assert step_limiter.peek(loose, "ip:1").remaining == 9
    assert step_limiter.peek(loose, "user:1").remaining == 9


def test_the_same_policy_and_identity_twice_in_one_check_counts_once(
    step_limiter: rl.Limiter,
) -> None:
    policy = rl.Policy("5/minute")
    decision = step_limiter.check([rl.Check(policy, "u"), rl.Check(policy, "u")])
    assert decision.remaining == 4 and len(decision.tiers) == 1


def test_the_refusing_tier_with_the_longest_wait_governs(
    step_limiter: rl.Limiter, step_clock: StepClock
) -> None:
    policy = rl.Policy("1/second;2/minute")
    step_limiter.hit(policy, "u")
    step_clock.advance(0.5)
    only_second = step_limiter.hit(policy, "u")
    assert only_second.rate == rl.Rate(1, 1_000) and only_second.retry_after == 0.5
    step_clock.advance(0.5)
    assert step_limiter.hit(policy, "u").allowed  # hits at 0 and 1
    step_clock.advance(0.5)
    both = step_limiter.hit(policy, "u")
    assert [t.allowed for t in both.tiers] == [False, False]
    assert both.rate == rl.Rate(2, MINUTE_MS) and both.retry_after == 58.5
    assert both.limit == 2


def test_an_admitted_hit_is_governed_by_the_tier_with_the_least_remaining(
    step_limiter: rl.Limiter,
) -> None:
    policy = rl.Policy("5/minute;3/hour", algorithm="gcra")
    decision = step_limiter.hit(policy, "u")
    assert decision.rate == rl.Rate(3, 3_600_000)
    assert (decision.limit, decision.remaining, decision.reset_after) == (3, 2, 1200.0)


def test_a_refusing_policy_governs_a_check_of_several_policies(
    step_limiter: rl.Limiter,
) -> None:
    a = rl.Policy("5/minute", name="a", algorithm="fixed-window")
    b = rl.Policy("2/minute", name="b", algorithm="gcra")
    checks = [rl.Check(a, "x"), rl.Check(b, "x")]
    assert step_limiter.check(checks).policy is b  # least remaining: 1 of b
    step_limiter.check(checks)
    refused = step_limiter.check(checks)
    assert not refused.allowed and refused.policy is b and refused.retry_after == 30.0
    assert [t.allowed for t in refused.tiers] == [True, False]


# -- penalty --------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_refusal_starts_a_ban_that_refuses_every_hit_until_it_ends(
    step_limiter: rl.Limiter, step_clock: StepClock, algorithm: str
) -> None:
    policy = rl.Policy("2/second;100/day", algorithm=algorithm, penalty=30)
    hits(step_limiter, policy, "u", 2)
    first = step_limiter.hit(policy, "u")
    assert first.banned and first.retry_after == 30.0 and first.remaining == 0
    assert all(t.banned for t in first.tiers)
    step_clock.advance(10)
    later = step_limiter.hit(policy, "u")
    assert later.banned and later.retry_after == 20.0
    step_clock.advance_ms(20_000 - 1)
    assert step_limiter.peek(policy, "u").banned
    step_clock.advance_ms(1)
    assert step_limiter.hit(policy, "u").allowed
    assert step_limiter.peek(policy, "u").tiers[1].remaining == 100 - 3


def test_a_penalty_callable_bans_until_the_time_it_returns(
    step_limiter: rl.Limiter, step_clock: StepClock
) -> None:
    import datetime as dt

    end = dt.datetime.fromtimestamp(step_clock.ms / 1000 + 3600, dt.timezone.utc)
    policy = rl.Policy("1/minute", penalty=lambda: end)
    step_limiter.hit(policy, "u")
    assert step_limiter.hit(policy, "u").retry_after == 3600.0
    step_clock.advance(3599)
    assert step_limiter.hit(policy, "u").retry_after == 1.0


def test_a_penalty_end_in_the_past_starts_no_ban(
    step_limiter: rl.Limiter, step_clock: StepClock
) -> None:
    import datetime as dt

    end = dt.datetime.fromtimestamp(step_clock.ms / 1000 - 1, dt.timezone.utc)
    policy = rl.Policy("1/minute", algorithm="fixed-window", penalty=lambda: end)
    step_limiter.hit(policy, "u")
    refused = step_limiter.hit(policy, "u")
    assert not refused.banned and not refused.allowed
    assert not step_limiter.peek(policy, "u").banned


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_cost_above_the_limit_stays_never_under_a_ban(
    step_limiter: rl.Limiter, algorithm: str
) -> None:
    policy = rl.Policy("2/minute", algorithm=algorithm, penalty=30)
    assert step_limiter.hit(policy, "u", cost=3).retry_after == math.inf
    assert step_limiter.peek(policy, "u").banned
    assert step_limiter.hit(policy, "u", cost=3).retry_after == math.inf  # waiting won't help
    assert step_limiter.hit(policy, "u").retry_after == 30.0  # a cost of 1 waits the ban out


def test_a_peek_never_starts_a_ban(step_limiter: rl.Limiter) -> None:
    policy = rl.Policy("1/minute", penalty=60)
    step_limiter.hit(policy, "u")
    assert not step_limiter.peek(policy, "u").banned
    assert not step_limiter.peek(policy, "u").banned


# -- calendar windows -----------------------------------------------------------------------
def test_day_windows_with_tz_reset_at_local_midnight(
    step_limiter: rl.Limiter, step_clock: StepClock
) -> None:
    import datetime as dt
    from zoneinfo import ZoneInfo

    zone = ZoneInfo("Asia/Shanghai")
    policy = rl.Policy("2/day", algorithm="fixed-window", tz="Asia/Shanghai")
    late = dt.datetime(2027, 3, 1, 23, 59, 0, tzinfo=zone)
    step_clock.set_ms(int(late.timestamp() * 1000))
    assert hits(step_limiter, policy, "u", 3) == [True, True, False]
    assert step_limiter.hit(policy, "u").retry_after == 60.0  # until local midnight
    step_clock.advance(60)
    assert step_limiter.hit(policy, "u").remaining == 1


# -- acquire --------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_acquire_sleeps_until_admitted(
    step_limiter: rl.Limiter, step_clock: StepClock, algorithm: str
) -> None:
    policy = rl.Policy("2/minute", algorithm=algorithm)
    hits(step_limiter, policy, "u", 2)
    started = step_clock.ms
    decision = step_limiter.acquire(policy, "u")
    assert decision.allowed
    waited = step_clock.ms - started
    assert 0 < waited <= 2 * MINUTE_MS


def test_acquire_gives_up_with_the_decision_when_the_wait_exceeds_the_timeout(
    step_limiter: rl.Limiter,
) -> None:
    policy = rl.Policy("1/minute")
    step_limiter.hit(policy, "u")
    with pytest.raises(rl.RateLimitExceeded) as info:
        step_limiter.acquire(policy, "u", timeout=5)
    assert info.value.decision.retry_after == 60.0
    with pytest.raises(rl.RateLimitExceeded):
        step_limiter.acquire(policy, "u", cost=2)


# -- argument checks ------------------------------------------------------------------------
@pytest.mark.parametrize("cost", [0, -1, 1.0, 1.5, True, "2"])
def test_a_bad_cost_is_a_configuration_error(step_limiter: rl.Limiter, cost: object) -> None:
    with pytest.raises(rl.ConfigurationError, match="cost=2"):
        step_limiter.hit("5/minute", "u", cost)  # type: ignore[arg-type]


@pytest.mark.parametrize(("policy", "identity", "cost"), [
    ("5/minute", "u", True), ("5/minute", "u", 1.0), ("5/minute", 42, 1),
    (["5/minute"], "u", 1), ({"rates": "5/minute"}, "u", 1)])
def test_bad_arguments_are_refused_after_a_good_hit_of_the_same_policy(
        step_limiter: rl.Limiter, policy: object, identity: object, cost: object) -> None:
    # The first hit keeps its decision by the policy as given: a later call finds it only
    # with a cost of exactly one and a string identity, else it is checked.
    assert step_limiter.hit("5/minute", "u").allowed
    with pytest.raises(rl.ConfigurationError):
        step_limiter.hit(policy, identity, cost)  # type: ignore[arg-type]
    assert step_limiter.peek("5/minute", "u").remaining == 4


@pytest.mark.parametrize("error", [KeyError, TypeError])
def test_what_a_kept_hit_raises_reaches_the_caller_once(error: type[Exception]) -> None:
    # The kept decision is looked up inside a try that catches KeyError and TypeError (not
    # kept yet, unhashable): the same errors raised by the hit itself (here its clock) are
    # the caller's, not a reason to ask the store a second time.
    calls: list[int] = []
    failing = [False]

    def clock() -> float:
        calls.append(1)
        if failing[0]:
            raise error("the clock failed")
        return 4_000_000_000.0

    limiter = rl.Limiter(rl.MemoryBackend(), clock=clock, deny_cache=0)
    policy = rl.Policy("5/minute", name="kept")
    assert limiter.hit(policy, "u").remaining == 4
    failing[0], calls[:] = True, []
    with pytest.raises(error, match="the clock failed"):
        limiter.hit(policy, "u")
    assert len(calls) == 1
    failing[0] = False
    assert limiter.peek(policy, "u").remaining == 4


class _Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def observe(self, event: str, policy: str, seconds: float) -> None:
        self.events.append((event, policy))


@pytest.mark.parametrize("deny_cache", [0, 10])
@pytest.mark.parametrize("side", ["sync", "async"])
async def test_a_clock_or_metrics_hook_assigned_later_takes_effect_on_the_next_hit(
        side: str, deny_cache: int) -> None:
    # What is built around an in-process store's hit (its clock, the metrics hook) is built
    # again when either is replaced: nothing built for the old ones answers after.
    limiter: Any = (rl.Limiter(deny_cache=deny_cache) if side == "sync"
                    else rl.AsyncLimiter(deny_cache=deny_cache))

    async def hit(policy: rl.Policy) -> bool:
        decision = limiter.hit(policy, "u")
        return bool(decision if side == "sync" else await decision)

    policy = rl.Policy("1/minute", name="one")
    recorder = _Recorder()
    assert await hit(policy) and recorder.events == []
    limiter.metrics = recorder
    assert not await hit(policy)
    assert recorder.events == [("refused", "one")]
    clock = [4_000_000_000.0]
    limiter.clock = lambda: clock[0]  # an hour past the window: the store reads this clock
    assert await hit(policy)
    assert recorder.events[-1] == ("admitted", "one")
    limiter.metrics = None  # the store's hit alone again (no deny cache): nothing reported
    clock[0] += 3600
    assert await hit(policy) and not await hit(policy)
    assert len(recorder.events) == 2
    clock[0] += 3600  # the new clock's window: admitted at once, as the clock says
    assert await hit(policy)


def test_isolation_and_its_end_rebuild_a_limiters_in_process_decisions() -> None:
    from ratelimit_mw.testing import isolated

    backend = rl.MemoryBackend()
    limiter = rl.Limiter(backend, deny_cache=0)
    policy = rl.Policy("1/minute")
    assert limiter.hit(policy, "u").allowed and not limiter.hit(policy, "u").allowed
    with isolated(limiter) as isolation:  # another store and clock: the old hit not used
        assert limiter.hit(policy, "u").allowed and not limiter.hit(policy, "u").allowed
        isolation.clock.advance(60)
        assert limiter.hit(policy, "u").allowed
    assert not limiter.hit(policy, "u").allowed  # the first store again, still refusing
    assert len(backend._data) == 1


def test_limiter_rejects_a_bad_prefix_and_a_non_string_identity() -> None:
    with pytest.raises(rl.ConfigurationError, match='prefix="rl"'):
        rl.Limiter(prefix="has space")
    with pytest.raises(rl.ConfigurationError, match="user:42"):
        rl.Limiter().hit("5/minute", 42)  # type: ignore[arg-type]


def test_limiters_default_to_the_memory_backend() -> None:
    assert isinstance(rl.Limiter().backend, rl.MemoryBackend)
    assert isinstance(rl.AsyncLimiter().backend, rl.MemoryBackend)
    assert [rl.Limiter().hit("1/minute", "u").allowed for _ in range(1)] == [True]


def test_a_sync_limiter_refuses_an_async_backend_and_vice_versa(
    redis_client: Any,
) -> None:
    import redis.asyncio

    with pytest.raises(rl.ConfigurationError, match="AsyncLimiter"):
        rl.Limiter(object())  # type: ignore[arg-type]
    with pytest.raises(rl.ConfigurationError, match="AsyncRedisBackend"):
        rl.AsyncLimiter(rl.RedisBackend(redis_client))  # type: ignore[arg-type]
    with pytest.raises(rl.ConfigurationError, match="AsyncRedisBackend"):
        rl.RedisBackend(redis.asyncio.Redis())
    with pytest.raises(rl.ConfigurationError, match="RedisBackend"):
        rl.AsyncRedisBackend(redis_client)


async def test_the_async_limiter_gives_the_same_answers_on_memory(
    step_clock: StepClock,
) -> None:
    sync = rl.Limiter(rl.MemoryBackend(), clock=step_clock)
    asyn = rl.AsyncLimiter(rl.MemoryBackend(), clock=step_clock, sleep=step_clock.asleep)
    for algorithm in ALGORITHMS:
        policy = rl.Policy("3/minute;4/hour", algorithm=algorithm, penalty=5)
        for step in range(12):
            cost = 1 + step % 2
            assert sync.hit(policy, "u", cost) == await asyn.hit(policy, "u", cost)
            assert sync.peek(policy, "u") == await asyn.peek(policy, "u")
            if step == 6:
                sync.refund(policy, "u")
                await asyn.refund(policy, "u")
            step_clock.advance(7)
        sync.reset(policy, "u")
        await asyn.reset(policy, "u")
        assert sync.peek(policy, "u") == await asyn.peek(policy, "u")
        assert await asyn.acquire(policy, "u") == sync.acquire(policy, "u")


async def test_assigning_another_backend_routes_every_later_call_to_it() -> None:
    limiter = rl.AsyncLimiter(rl.AsyncRedisBackend.from_url(REDIS_URL), prefix="swap")
    redis_backend = limiter.backend
    limiter.backend = rl.MemoryBackend()
    policy = rl.Policy("1/minute")
    assert [(await limiter.hit(policy, "u")).allowed for _ in range(2)] == [True, False]
    assert len(limiter.backend) > 0  # counted in memory
    limiter.backend = redis_backend
    assert (await limiter.hit(policy, "u")).allowed  # counted in Redis again
    await limiter.reset(policy, "u")
    await redis_backend.aclose()
