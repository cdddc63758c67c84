"""The sliding log keeps one member per hit carrying its cost (issue 43, item 1).

One member per unit of cost made `ticket.settle(10**30)` run a script that never ended (BUSY
for every client of the Redis) and 10 hits of cost 1,000 leave 10,000 members (1.1 MB). A hit
is now one member, "<token>" or "<token>#<cost>", and "+" scored minus the running total of
what costs add above one apiece (lua/sliding_log.lua); the memory backend mirrors it
(tests/test_differential.py holds the two together, costs up to the largest accepted). A log
written before (members "<token>:<n>", one per unit) keeps working: read as it is.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import redis

import ratelimit_mw as rl
from ratelimit_mw.core import codec

POLICY = rl.Policy("1000/minute", name="costs")


def log_key(prefix: str, name: str = "costs") -> str:
    return f"{prefix}:{{u}}:{name}.sl:log"


def test_ten_hits_of_cost_1000_are_ten_members(redis_client: redis.Redis, prefix: str) -> None:
    limiter = rl.Limiter(rl.RedisBackend(redis_client), prefix=prefix, deny_cache=0)
    policy = rl.Policy("10000/minute", name="costs")
    for _ in range(10):
        assert limiter.hit(policy, "u", 1_000).allowed
    key = log_key(prefix)
    assert redis_client.zcard(key) == 11  # ten hits and the running total
    assert redis_client.zscore(key, "+") == -9_990
    assert redis_client.memory_usage(key) < 4_096  # was 1.1 MB
    assert not limiter.hit(policy, "u").allowed
    limiter.reset(policy, "u")
    assert not redis_client.exists(key)


def test_a_settle_of_the_largest_cost_is_one_member(
    redis_client: redis.Redis, prefix: str
) -> None:
    """settle(2**52): one member, written in one step (each unit a member would hold the
    shared Redis for days); the window is in debt, and still counts exactly."""
    limiter = rl.Limiter(rl.RedisBackend(redis_client), prefix=prefix, deny_cache=0)
    ticket = limiter.charge(POLICY, "u", 10)
    ticket.settle(POLICY.max_cost)
    key = log_key(prefix)
    assert redis_client.zcard(key) == 3
    refused = limiter.peek(POLICY, "u")
    assert not refused.allowed and 59 < refused.retry_after <= 60
    limiter.reset(POLICY, "u")


def test_a_settle_below_the_estimate_takes_from_the_hit_s_own_member(
    limiter: rl.Limiter, clock: Any
) -> None:
    first = limiter.charge(POLICY, "u", 300)
    clock.advance(1)
    assert limiter.hit(POLICY, "u", 200).remaining == 500
    first.settle(120)
    assert limiter.peek(POLICY, "u").remaining == 680
    # The first hit now weighs 120: when it leaves the window, 120 come back.
    clock.advance(59.5)
    assert limiter.peek(POLICY, "u").remaining == 800
    clock.advance(1)
    assert limiter.peek(POLICY, "u").remaining == 1000


def test_retry_after_waits_until_enough_weight_has_left(limiter: rl.Limiter, clock: Any) -> None:
    """Hits of 3, 4 and 2 at t, t + 1, t + 2 (limit 10 per 10 s): a hit of 5 at t + 3 needs 4
    units gone: the 3 at t are not enough, the 4 at t + 1 are: it fits at t + 11."""
    policy = rl.Policy("10/10 seconds", name="retry")
    for cost in (3, 4, 2):
        assert limiter.hit(policy, "u", cost).allowed
        clock.advance(1)
    refused = limiter.hit(policy, "u", 5)
    assert not refused.allowed and refused.retry_after == 8.0
    clock.advance(7.999)
    assert not limiter.hit(policy, "u", 5).allowed
    clock.advance(0.001)
    assert limiter.hit(policy, "u", 5).allowed


def test_a_log_written_before_the_upgrade_keeps_working(
    redis_client: redis.Redis, prefix: str, clock: Any
) -> None:
    """Members "<token>:<n>", one per unit of cost (as efbcb84 wrote them), then every
    operation with this code: hit, peek, refund (by token and without), reserve, reset."""
    limiter = rl.Limiter(rl.RedisBackend(redis_client), prefix=prefix, clock=clock,
                         deny_cache=0)
    policy = rl.Policy("10/minute", name="old")
    key = log_key(prefix, "old")
    now_ms = round(clock() * 1000)
    old = {f"T1:{j}": now_ms - 20_000 for j in range(1, 4)}  # a hit of cost 3
    old["T2:1"] = now_ms - 10_000  # a hit of cost 1
    redis_client.zadd(key, old)
    redis_client.pexpire(key, 60_000)
    assert limiter.peek(policy, "u").remaining == 6
    assert limiter.hit(policy, "u", 2).remaining == 4
    # The oldest unit leaves 40 s from now: the exact wait of a hit that does not fit.
    refused = limiter.hit(policy, "u", 5)
    assert not refused.allowed and refused.retry_after == 40.0
    # Without a token, the newest units: the new hit's 2 and T2's one.
    limiter.refund(policy, "u", 3)
    assert limiter.peek(policy, "u").remaining == 7
    # By its token, an old hit gives back its own members.
    back = codec.build(codec.REFUND, [codec.Check(policy, "u", 2)], prefix, token="T1",
                       now_us=round(clock() * 1_000_000))
    rl.RedisBackend(redis_client).run(back)
    assert sorted(redis_client.zrange(key, 0, -1)) == [b"T1:3"]
    assert limiter.peek(policy, "u").remaining == 9
    at = dt.datetime.fromtimestamp(clock() + 30, dt.timezone.utc)
    booked = limiter.reserve(policy, "u", at, cost=9)
    assert booked.allowed
    assert not limiter.reserve(policy, "u", at, cost=1).allowed
    limiter.cancel(booked.booking)  # type: ignore[arg-type]
    assert limiter.reserve(policy, "u", at, cost=9).allowed
    limiter.reset(policy, "u")
    assert not redis_client.exists(key)
