"""Outbound throttling: `acquire` waits until the shared quota admits a call.

On the fake clock: `acquire` sleeps the decision's retry_after plus a little jitter, tries
again, and raises RateLimitExceeded (carrying the refusal) as soon as the next wait would pass
its timeout; `timeout=0` is one try. The fleet test at the end runs real processes on the real
Redis with real time and counts what was admitted.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

import ratelimit_mw as rl

ALGORITHMS = sorted(rl.ALGORITHMS)


class RecordingSleep:
    """A sleep for the limiter that advances the fake clock and remembers each wait."""

    def __init__(self, clock: Any) -> None:
        self.clock = clock
        self.waits: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.clock.advance(seconds)

    async def asleep(self, seconds: float) -> None:
        self(seconds)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_acquire_waits_retry_after_plus_a_little_jitter_then_is_admitted(
    backend: Any, prefix: str, clock: Any, algorithm: str
) -> None:
    sleep = RecordingSleep(clock)
    limiter = rl.Limiter(backend, prefix=prefix, clock=clock, sleep=sleep)
    policy = rl.Policy("2/second", algorithm=algorithm)
    clock.advance(0.25)  # off the fixed window's edge
    for _ in range(2):
        assert limiter.acquire(policy, "api").allowed
    assert sleep.waits == []
    refused = limiter.peek(policy, "api")
    decision = limiter.acquire(policy, "api")
    assert decision.allowed
    assert len(sleep.waits) == 1
    jitter = sleep.waits[0] - refused.retry_after
    assert 0 <= jitter <= min(0.05, refused.retry_after * 0.1 + 0.001)


def test_acquire_with_timeout_zero_tries_once_and_raises_with_the_decision(
    limiter: rl.Limiter, clock: Any
) -> None:
    policy = rl.Policy("1/minute")
    assert limiter.acquire(policy, "api", timeout=0).allowed
    with pytest.raises(rl.RateLimitExceeded) as caught:
        limiter.acquire(policy, "api", timeout=0)
    decision = caught.value.decision
    assert (decision.allowed, decision.retry_after) == (False, 60.0)
    assert clock.now == 1_800_000_000.0  # no sleep at all
    assert "retry after 60.000s" in str(caught.value)


def test_acquire_gives_up_at_once_when_the_wait_would_pass_the_timeout(
    limiter: rl.Limiter, clock: Any
) -> None:
    policy = rl.Policy("1/minute")
    assert limiter.hit(policy, "api").allowed
    with pytest.raises(rl.RateLimitExceeded):
        limiter.acquire(policy, "api", timeout=59.9)
    assert clock.now == 1_800_000_000.0  # it did not sleep 59.9 s to fail anyway
    assert limiter.acquire(policy, "api", timeout=61).allowed
    assert 60 <= clock.now - 1_800_000_000.0 <= 60.05


def test_acquire_never_waits_for_a_cost_above_the_limit(limiter: rl.Limiter, clock: Any) -> None:
    with pytest.raises(rl.RateLimitExceeded) as caught:
        limiter.acquire(rl.Policy("5/second"), "api", cost=6)
    assert caught.value.decision.retry_after == math.inf
    assert clock.now == 1_800_000_000.0


@pytest.mark.parametrize("timeout", [-1, -0.5, True])
def test_acquire_rejects_a_negative_timeout(limiter: rl.Limiter, timeout: Any) -> None:
    with pytest.raises(rl.ConfigurationError, match="timeout"):
        limiter.acquire(rl.Policy("5/second"), "api", timeout=timeout)


def test_a_refused_acquire_records_nothing(limiter: rl.Limiter, clock: Any) -> None:
    policy = rl.Policy("3/minute")
    for _ in range(3):
        limiter.acquire(policy, "api")
    for _ in range(5):
        with pytest.raises(rl.RateLimitExceeded):
            limiter.acquire(policy, "api", timeout=0)
    clock.advance(60)
    assert limiter.peek(policy, "api").remaining == 3


def test_sequential_acquirers_are_paced_at_the_rate(limiter: rl.Limiter, clock: Any) -> None:
    policy = rl.Policy("10/second", algorithm="gcra")
    start = clock.now
    for _ in range(50):
        assert limiter.acquire(policy, "api").allowed
    # A burst of 10, then one every 100 ms (plus jitter of at most ~11 ms each).
    assert 4.0 <= clock.now - start <= 4.0 + 40 * 0.011


async def test_async_acquire_waits_and_times_out(
    abackend: Any, prefix: str, clock: Any
) -> None:
    sleep = RecordingSleep(clock)
    limiter = rl.AsyncLimiter(abackend, prefix=prefix, clock=clock, sleep=sleep.asleep)
    policy = rl.Policy("1/second")
    assert (await limiter.acquire(policy, "api")).allowed
    with pytest.raises(rl.RateLimitExceeded) as caught:
        await limiter.acquire(policy, "api", timeout=0)
    assert caught.value.decision.retry_after == 1.0 and sleep.waits == []
    assert (await limiter.acquire(policy, "api", timeout=2)).allowed
    assert len(sleep.waits) == 1 and 1.0 <= sleep.waits[0] <= 1.05
