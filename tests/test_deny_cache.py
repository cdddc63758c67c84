"""The local deny cache: a refusal is remembered until its retry_after, and no longer."""

from __future__ import annotations

import math
from typing import Any

import pytest

import ratelimit_mw as rl
from ratelimit_mw._deny_cache import DenyCache
from ratelimit_mw.core import Check
from tests.conftest import FakeClock


class CountingBackend:
    """A MemoryBackend that counts the calls that reach it."""

    is_cluster = False

    def __init__(self) -> None:
        self.inner = rl.MemoryBackend()
        self.calls = 0

    def run(self, call: Any) -> list[int]:
        self.calls += 1
        return self.inner.run(call)

    async def arun(self, call: Any) -> list[int]:
        self.calls += 1
        return self.inner.run(call)


@pytest.fixture
def counting() -> CountingBackend:
    return CountingBackend()


def make(counting: CountingBackend, clock: FakeClock, **kwargs: Any) -> rl.Limiter:
    return rl.Limiter(counting, prefix="dc", clock=clock, **kwargs)  # type: ignore[arg-type]


def test_a_flood_after_the_first_refusal_costs_no_backend_call(
    counting: CountingBackend, clock: FakeClock
) -> None:
    limiter = make(counting, clock)
    policy = rl.Policy("3/minute", algorithm="fixed-window")
    clock.now = 1_800_000_000.0  # a window boundary: the refusal lasts the whole minute
    results = [limiter.hit(policy, "ip:1").allowed for _ in range(100)]
    assert results[:3] == [True, True, True] and not any(results[3:])
    assert counting.calls == 4


def test_a_cached_refusal_counts_its_retry_after_down(
    counting: CountingBackend, clock: FakeClock
) -> None:
    limiter = make(counting, clock)
    policy = rl.Policy("1/minute", algorithm="gcra")
    limiter.hit(policy, "ip:1")
    first = limiter.hit(policy, "ip:1")
    clock.advance(20)
    cached = limiter.hit(policy, "ip:1")
    assert counting.calls == 2
    assert not cached.allowed
    assert cached.retry_after == pytest.approx(first.retry_after - 20, abs=1e-6)


def test_the_store_is_asked_again_once_the_wait_is_over(
    counting: CountingBackend, clock: FakeClock
) -> None:
    limiter = make(counting, clock)
    policy = rl.Policy("1/minute", algorithm="gcra")
    limiter.hit(policy, "ip:1")
    refused = limiter.hit(policy, "ip:1")
    clock.advance(refused.retry_after)
    assert limiter.hit(policy, "ip:1").allowed
    assert counting.calls == 3


@pytest.mark.parametrize("undo", ["reset", "refund"])
def test_reset_and_refund_through_the_limiter_forget_the_refusal(
    counting: CountingBackend, clock: FakeClock, undo: str
) -> None:
    limiter = make(counting, clock)
    policy = rl.Policy("1/minute")
    limiter.hit(policy, "ip:1")
    assert not limiter.hit(policy, "ip:1").allowed
    getattr(limiter, undo)(policy, "ip:1")
    assert limiter.hit(policy, "ip:1").allowed


def test_a_cost_above_the_limit_is_never_answered_from_the_cache(
    counting: CountingBackend, clock: FakeClock
) -> None:
    limiter = make(counting, clock)
    policy = rl.Policy("2/minute")
    for _ in range(3):
        limiter.hit(policy, "ip:1")
    assert limiter.hit(policy, "ip:1", cost=5).retry_after == math.inf


def test_a_smaller_cost_than_the_refused_one_still_asks_the_store(
    counting: CountingBackend, clock: FakeClock
) -> None:
    limiter = make(counting, clock)
    policy = rl.Policy("3/minute")
    limiter.hit(policy, "ip:1", cost=2)
    assert not limiter.hit(policy, "ip:1", cost=2).allowed
    assert limiter.hit(policy, "ip:1", cost=1).allowed


def test_other_identities_are_not_affected(counting: CountingBackend, clock: FakeClock) -> None:
    limiter = make(counting, clock)
    policy = rl.Policy("1/minute")
    limiter.hit(policy, "ip:1")
    limiter.hit(policy, "ip:1")
    assert limiter.hit(policy, "ip:2").allowed


def test_deny_cache_zero_turns_it_off(counting: CountingBackend, clock: FakeClock) -> None:
    limiter = make(counting, clock, deny_cache=0)
    policy = rl.Policy("1/minute")
    for _ in range(5):
        limiter.hit(policy, "ip:1")
    assert counting.calls == 5


@pytest.mark.parametrize("bad", [-1, 1.5, True, "10"])
def test_a_bad_size_is_a_configuration_error(bad: object) -> None:
    with pytest.raises(rl.ConfigurationError, match="deny_cache"):
        rl.Limiter(deny_cache=bad)  # type: ignore[arg-type]


def test_the_cache_is_bounded_and_drops_expired_entries_first() -> None:
    cache = DenyCache(size=3)
    policy = rl.Policy("1/minute")
    limiter = rl.Limiter(deny_cache=0)

    def refusal(identity: str) -> rl.Decision:
        limiter.hit(policy, identity)
        return limiter.hit(policy, identity)

    for i in range(5):
        identity = f"ip:{i}"
        cache.remember([Check(policy, identity)], refusal(identity), now=float(i))
    assert len(cache) == 3
    # The two oldest went; the newest three still answer.
    assert cache.lookup([Check(policy, "ip:0")], now=5.0) is None
    assert cache.lookup([Check(policy, "ip:4")], now=5.0) is not None


async def test_the_async_limiter_uses_the_cache_too(
    counting: CountingBackend, clock: FakeClock
) -> None:
    limiter = rl.AsyncLimiter(counting, prefix="dc", clock=clock)  # type: ignore[arg-type]
    policy = rl.Policy("2/minute", algorithm="gcra")
    decisions = [await limiter.hit(policy, "ip:1") for _ in range(50)]
    assert sum(d.allowed for d in decisions) == 2
    assert counting.calls == 3
