"""Costs that settle: ``ticket = limiter.charge(policy, identity, estimate)`` reserves an
estimate, ``ticket.settle(actual)`` makes the charge what was really used.

For every algorithm, a settled ticket leaves the state as a hit of the actual cost would
have (now and later); a cost above the estimate may take a window into debt, and later
calls wait until what was really used has left it; a ticket never settled keeps its
estimate; `calls=` counts the call beside its cost, all or nothing. Memory and the real
Redis, sync and async, on the fake clock.
"""

from __future__ import annotations

from typing import Any

import pytest

import ratelimit_mw as rl

ALGORITHMS = sorted(rl.ALGORITHMS)


def view(decision: rl.Decision) -> tuple[bool, int, float, float]:
    return (decision.allowed, decision.remaining, decision.retry_after, decision.reset_after)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize(("estimate", "actual"), [(30, 10), (30, 0), (30, 30), (10, 25)])
def test_a_settled_ticket_counts_as_a_hit_of_the_actual_cost(
    limiter: rl.Limiter, clock: Any, algorithm: str, estimate: int, actual: int
) -> None:
    policy = rl.Policy("100/minute", algorithm=algorithm)
    clock.advance(5)  # inside a fixed window, not on its edge
    ticket = limiter.charge(policy, "settled", estimate)
    assert ticket.decision.allowed and ticket.decision.remaining == 100 - estimate
    ticket.settle(actual)
    if actual:
        assert limiter.hit(policy, "hit", actual).allowed
    for step in (0, 7, 20, 59):
        clock.advance(step)
        assert view(limiter.peek(policy, "settled")) == view(limiter.peek(policy, "hit"))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_an_overshoot_takes_the_window_into_debt(
    limiter: rl.Limiter, clock: Any, algorithm: str
) -> None:
    policy = rl.Policy("100/minute", algorithm=algorithm)
    clock.advance(1)
    limiter.charge(policy, "llm", 50).settle(250)  # 150 more than the limit
    refused = limiter.peek(policy, "llm")
    assert not refused.allowed and refused.remaining == 0
    # Nothing is admitted until what was really used has left the window.
    clock.advance(refused.retry_after - 0.01)
    assert not limiter.peek(policy, "llm").allowed
    clock.advance(0.02)
    assert limiter.hit(policy, "llm").allowed


def test_a_ticket_never_settled_keeps_its_estimate(limiter: rl.Limiter) -> None:
    policy = rl.Policy("100/minute")
    limiter.charge(policy, "llm", 40)
    assert limiter.peek(policy, "llm").remaining == 60


def test_calls_count_beside_the_cost_all_or_nothing(limiter: rl.Limiter) -> None:
    tokens, calls = rl.Policy("1000/minute", name="tokens"), rl.Policy("2/minute", name="calls")
    for _ in range(2):
        limiter.charge(tokens, "llm", 100, calls=calls).settle(50)
    with pytest.raises(rl.RateLimitExceeded) as refused:
        limiter.charge(tokens, "llm", 100, calls=calls, timeout=0)
    assert refused.value.decision.policy is calls
    assert limiter.peek(tokens, "llm").remaining == 900  # the refused call took nothing
    assert limiter.peek(calls, "llm").remaining == 0


def test_charge_waits_for_the_estimate_like_acquire(limiter: rl.Limiter, clock: Any) -> None:
    policy = rl.Policy("100/minute", algorithm="sliding-log")
    limiter.charge(policy, "llm", 80)
    started = clock.now
    limiter.charge(policy, "llm", 50, timeout=120)
    assert clock.now - started >= 59.9  # until the first 80 left the window


@pytest.mark.parametrize(("actual", "match"), [(-1, "whole cost >= 0"),
                                               (2.5, "whole cost >= 0"),
                                               (True, "whole cost >= 0")])
def test_a_bad_actual_cost_is_refused_and_changes_nothing(
    limiter: rl.Limiter, actual: Any, match: str
) -> None:
    policy = rl.Policy("100/minute")
    ticket = limiter.charge(policy, "llm", 10)
    with pytest.raises(rl.ConfigurationError, match=match):
        ticket.settle(actual)
    ticket.settle(4)  # still open
    with pytest.raises(rl.ConfigurationError, match="settled at 4 already"):
        ticket.settle(4)
    assert limiter.peek(policy, "llm").remaining == 96


@pytest.mark.parametrize("algorithm", ALGORITHMS)
async def test_async_tickets_settle_alike(
    alimiter: rl.AsyncLimiter, clock: Any, algorithm: str
) -> None:
    policy = rl.Policy("100/minute", algorithm=algorithm)
    clock.advance(5)
    ticket = await alimiter.charge(policy, "settled", 40)
    await ticket.settle(15)
    assert (await alimiter.hit(policy, "hit", 15)).allowed
    for step in (0, 30):
        clock.advance(step)
        assert view(await alimiter.peek(policy, "settled")) == view(
            await alimiter.peek(policy, "hit"))


@pytest.mark.parametrize("transport", ["tcp", "sentinel", "cluster"])
async def test_tickets_and_semaphores_on_every_redis_deployment(
    request: pytest.FixtureRequest, transport: str, prefix: str
) -> None:
    """Settling and in-flight slots are script calls like any hit: one node, Sentinel and
    the 3-node cluster answer them alike, sync and async."""
    from transports import transport_url  # the session's servers, started on first use

    url = transport_url(request, transport)
    policies = [rl.Policy("100/minute", algorithm=algorithm, name=f"tokens-{algorithm}")
                for algorithm in ALGORITHMS]
    limiter = rl.Limiter(rl.RedisBackend.from_url(url), prefix=prefix)
    alimiter = rl.AsyncLimiter(rl.AsyncRedisBackend.from_url(url), prefix=prefix)
    try:
        for policy in policies:
            limiter.charge(policy, "sync", 30, calls="10/minute").settle(12)
            await (await alimiter.charge(policy, "async", 30, calls="10/minute")).settle(45)
            assert limiter.peek(policy, "sync").remaining == 88
            assert (await alimiter.peek(policy, "async")).remaining == 55
        with limiter.concurrent("vendor", 1), pytest.raises(rl.RateLimitExceeded):
            async with alimiter.concurrent("vendor", 1, timeout=0):
                pass
        async with alimiter.concurrent("vendor", 1, timeout=0) as decision:
            assert decision.allowed
    finally:
        for policy in policies:
            for who in ("sync", "async"):
                limiter.reset(policy, who)
                limiter.reset("10/minute", who)
        limiter.backend.close()
        await alimiter.backend.aclose()


def test_a_ticket_may_hold_an_in_flight_slot_until_it_is_settled(limiter: rl.Limiter) -> None:
    tokens = rl.Policy("1000/minute", name="tokens")
    slots = rl.Policy.in_flight(1, name="llm calls")
    ticket = limiter.charge(tokens, "llm", 100, concurrency=slots)
    with pytest.raises(rl.RateLimitExceeded) as refused:
        limiter.charge(tokens, "llm", 100, concurrency=slots, timeout=0)
    assert refused.value.decision.policy is slots
    assert limiter.peek(tokens, "llm").remaining == 900  # refused for the slot: no tokens
    ticket.settle(40)  # one call gives back 60 tokens and the slot
    assert limiter.peek(slots, "llm").remaining == 1
    second = limiter.charge(tokens, "llm", 100, concurrency=2)  # a number: named for tokens
    second.release()
    second.release()  # once
    assert limiter.peek(tokens, "llm").remaining == 860  # released, not settled: 100 stands
