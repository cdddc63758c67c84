"""`limiter.pause`: a ban started without a refusal (an upstream's 429), binding every limiter
on the store; `charge`'s timeout and `wait_out`; what a refusal carries; the exported Ticket."""

from __future__ import annotations

import pytest
import redis
from support import REDIS_URL

import ratelimit_mw as rl
from ratelimit_mw.core.errors import ConfigurationError, RateLimitExceeded
from tests.conftest import FakeClock, keys_under

OBEYS = rl.Policy("100/minute", name="tokens", penalty=lambda: None)
PLAIN = rl.Policy("100/minute", name="tokens")


def test_a_pause_refuses_the_policies_that_obey_it_until_it_ends(
        limiter: rl.Limiter, clock: FakeClock) -> None:
    assert limiter.hit(OBEYS, "openai").allowed
    assert limiter.pause(PLAIN, "openai", 2) == clock.now + 2  # its end, on the store's clock
    refused = limiter.hit(OBEYS, "openai")
    assert not refused.allowed and refused.retry_after == 2.0
    assert limiter.hit(OBEYS, "anthropic").allowed  # another identity: not paused
    assert limiter.hit(PLAIN, "openai").allowed  # no penalty: pauses are not read
    clock.advance(1.999)
    assert not limiter.hit(OBEYS, "openai").allowed
    clock.advance(0.001)
    assert limiter.hit(OBEYS, "openai").allowed


def test_a_shorter_pause_never_cuts_a_longer_one(limiter: rl.Limiter, clock: FakeClock) -> None:
    end = limiter.pause(OBEYS, "k", 5)
    assert limiter.pause(OBEYS, "k", 1) == end  # the longer pause stands
    clock.advance(2)
    assert limiter.hit(OBEYS, "k").retry_after == 3.0
    limiter.pause(OBEYS, "k", 10)  # a longer one lengthens it
    assert limiter.hit(OBEYS, "k").retry_after == 10.0


def test_a_pause_binds_every_limiter_on_the_store(redis_client: redis.Redis,
                                                  prefix: str) -> None:
    clock = FakeClock()
    one = rl.Limiter(rl.RedisBackend.from_url(REDIS_URL), prefix=prefix, clock=clock)
    other = rl.Limiter(rl.RedisBackend.from_url(REDIS_URL), prefix=prefix, clock=clock,
                       sleep=clock.sleep)
    one.pause(OBEYS, "openai", 2)
    try:
        other.charge(OBEYS, "openai", 10, timeout=1)
    except RateLimitExceeded as exc:
        assert exc.retry_after == 2.0
    else:
        raise AssertionError("a paused identity was admitted")
    ticket = other.charge(OBEYS, "openai", 10)  # waits the pause out
    assert clock.now >= 1_800_000_002.0 and ticket.decision.allowed
    one.reset(OBEYS, "openai")
    assert keys_under(redis_client, prefix) == []  # the ban key went with the reset


@pytest.mark.parametrize("seconds", [0, -1, float("inf"), True, "2"])
def test_a_pause_must_last(limiter: rl.Limiter, seconds: object) -> None:
    with pytest.raises(ConfigurationError, match=r"limiter\.pause\(policy, identity, 2\.5\)"):
        limiter.pause(OBEYS, "k", seconds)  # type: ignore[arg-type]


def test_timeout_raises_at_once_unless_wait_out(limiter: rl.Limiter,
                                                clock: FakeClock) -> None:
    budget = rl.Policy("10/minute", name="budget")
    limiter.charge(budget, "k", 10)
    started = clock.now
    try:
        limiter.charge(budget, "k", 5, timeout=30)
    except RateLimitExceeded as exc:
        assert exc.retry_after == 60.0 and clock.now == started  # no wait at all
    else:
        raise AssertionError("admitted over the budget")
    try:
        limiter.charge(budget, "k", 5, timeout=30, wait_out=True)
    except RateLimitExceeded as exc:
        assert clock.now == started + 30  # the whole timeout waited, then one more try
        assert exc.retry_after == 30.0
    else:
        raise AssertionError("admitted over the budget")
    ticket = limiter.charge(budget, "k", 5, timeout=40, wait_out=True)
    assert isinstance(ticket, rl.Ticket) and clock.now >= started + 60


async def test_the_async_side_pauses_and_exports_its_ticket(prefix: str) -> None:
    clock = FakeClock()
    limiter = rl.AsyncLimiter(prefix=prefix, clock=clock, sleep=clock.asleep)
    await limiter.pause(OBEYS, "k", 3)
    ticket = await limiter.charge(OBEYS, "k", 5)
    assert isinstance(ticket, rl.AsyncTicket) and clock.now >= 1_800_000_003.0
