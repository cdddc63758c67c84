"""Fleet-wide semaphores: ``with limiter.concurrent(name, slots):`` holds one of `slots` while
its block runs, for every process sharing the store.

At most `slots` are held at once; a slot comes back when its block ends, however it ends; a
holder that dies keeps its slot until its lease ends, not longer, and a live holder renews
its lease. Memory and the real Redis, sync and async, on the fake clock (leases are the
store's time; only the renewal's interval is real time).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

import ratelimit_mw as rl


def held(limiter: rl.Limiter, name: str, slots: int, lease: float) -> int:
    """How many slots are held now (the semaphore's policy, asked without taking one)."""
    decision = limiter.peek(rl.Policy.in_flight(slots, lease=lease, name=name), "slots")
    return slots - decision.remaining


def test_at_most_slots_are_held_at_once(limiter: rl.Limiter) -> None:
    with contextlib.ExitStack() as stack:
        for expected_left in (2, 1, 0):
            decision = stack.enter_context(limiter.concurrent("vendor", 3))
            assert decision.allowed and decision.remaining == expected_left
        with pytest.raises(rl.RateLimitExceeded) as refused:
            limiter.concurrent("vendor", 3, timeout=0).__enter__()
        assert refused.value.decision.policy is not None
        assert refused.value.decision.policy.name == "vendor"
        assert 0 < refused.value.decision.retry_after <= 1.0
        assert held(limiter, "vendor", 3, 60) == 3
    assert held(limiter, "vendor", 3, 60) == 0


def test_a_slot_comes_back_when_its_block_raises(limiter: rl.Limiter) -> None:
    with pytest.raises(ZeroDivisionError), limiter.concurrent("vendor", 1):
        _ = 1 / 0
    with limiter.concurrent("vendor", 1, timeout=0) as decision:
        assert decision.allowed


def test_semaphores_of_other_names_are_apart(limiter: rl.Limiter) -> None:
    with limiter.concurrent("a", 1), limiter.concurrent("b", 1) as decision:
        assert decision.allowed


def test_a_dead_holder_keeps_its_slot_until_its_lease_ends(limiter: rl.Limiter,
                                                           clock: Any) -> None:
    dead = limiter.concurrent("vendor", 1, lease=30)
    dead.__enter__()  # and never leaves (its renewal thread waits 10 real seconds)
    try:
        clock.advance(29.9)
        with pytest.raises(rl.RateLimitExceeded):
            limiter.concurrent("vendor", 1, lease=30, timeout=0).__enter__()
        clock.advance(0.2)
        with limiter.concurrent("vendor", 1, lease=30, timeout=0) as decision:
            assert decision.allowed
    finally:
        dead.__exit__(None, None, None)


def test_a_waiter_gets_the_slot_once_it_is_given_back(limiter: rl.Limiter,
                                                      clock: Any) -> None:
    holder = limiter.concurrent("vendor", 1, lease=30)
    holder.__enter__()
    waits: list[float] = []

    def sleep(seconds: float) -> None:  # the holder leaves while the waiter sleeps
        waits.append(seconds)
        clock.advance(seconds)
        if len(waits) == 3:
            holder.__exit__(None, None, None)

    waiter = rl.Limiter(limiter.backend, prefix=limiter.prefix, clock=clock, sleep=sleep)
    with waiter.concurrent("vendor", 1, lease=30, timeout=5) as decision:
        assert decision.allowed
    # Asked again soon, not after the refusal's full second: 10, 20, 40 ms (with jitter).
    assert len(waits) == 3 and all(wait < 0.05 for wait in waits)


def test_a_live_holder_renews_its_lease(limiter: rl.Limiter, clock: Any) -> None:
    with limiter.concurrent("vendor", 1, lease=0.3):
        clock.advance(0.2)
        for _ in range(400):  # the renewal thread runs every 0.1 real seconds
            if limiter.peek(rl.Policy.in_flight(1, lease=0.3, name="vendor"),
                            "slots").reset_after > 0.2:
                break
            asyncio.run(asyncio.sleep(0.01))
        clock.advance(0.2)  # past the first lease, within the renewed one
        with pytest.raises(rl.RateLimitExceeded):
            limiter.concurrent("vendor", 1, lease=0.3, timeout=0).__enter__()


def test_a_slot_is_held_once_at_a_time(limiter: rl.Limiter) -> None:
    slot = limiter.concurrent("vendor", 2)
    with slot, pytest.raises(rl.ConfigurationError, match="once at a time"):
        slot.__enter__()


@pytest.mark.parametrize(("args", "match"), [
    (("", 2), "non-empty string"),
    (("vendor", 0), "whole number of slots"),
    (("vendor", 2.5), "whole number of slots"),
])
def test_a_bad_semaphore_is_refused_where_it_is_written(
    limiter: rl.Limiter, args: tuple[Any, ...], match: str
) -> None:
    with pytest.raises(rl.ConfigurationError, match=match):
        limiter.concurrent(*args)


async def test_async_holders_share_the_slots_and_give_them_back(
    abackend: Any, prefix: str
) -> None:
    # Real time: a waiter's sleep must let the holders run (the fake clock's would not).
    alimiter = rl.AsyncLimiter(abackend, prefix=prefix)
    running = 0
    most = 0
    three_in = asyncio.Event()

    async def job() -> None:
        nonlocal running, most
        async with alimiter.concurrent("vendor", 3):
            running += 1
            most = max(most, running)
            if running == 3:
                three_in.set()
            # The first three hold their slots together (a semaphore that let fewer in at
            # once times out here; one that let a fourth in shows it in `most`).
            await asyncio.wait_for(three_in.wait(), 10)
            running -= 1

    await asyncio.gather(*(job() for _ in range(12)))
    assert most == 3
    async with alimiter.concurrent("vendor", 3, timeout=0) as decision:
        assert decision.remaining == 2


async def test_an_async_holder_renews_its_lease(alimiter: rl.AsyncLimiter, clock: Any) -> None:
    policy = rl.Policy.in_flight(1, lease=0.3, name="vendor")
    async with alimiter.concurrent("vendor", 1, lease=0.3):
        clock.advance(0.2)
        for _ in range(400):
            if (await alimiter.peek(policy, "slots")).reset_after > 0.2:
                break
            await asyncio.sleep(0.01)
        clock.advance(0.2)
        with pytest.raises(rl.RateLimitExceeded):
            async with alimiter.concurrent("vendor", 1, lease=0.3, timeout=0):
                pass
    async with alimiter.concurrent("vendor", 1, lease=0.3, timeout=0) as decision:
        assert decision.allowed


def test_a_set_two_in_flight_limits_of_one_name_share_is_renewed_and_given_back_whole(
        limiter: rl.Limiter, clock: Any) -> None:
    """Two in-flight limits of one name, costs 1 and 3, take one set: the larger cost's
    members. Its renewal keeps them all and its give-back frees them all, on either store."""
    one = rl.Policy.in_flight(4, lease=60, name="jobs")
    three = rl.Policy.in_flight(4, lease=60, name="jobs")
    compiled = limiter.compile([(one, 1), (three, 3)])
    assert limiter.hit_compiled(compiled, ("u", "u"), token="T1").allowed
    checks = compiled.checks(("u", "u"))
    assert limiter.peek(one, "u").remaining == 1
    clock.advance(50)
    assert limiter.renew(checks, "T1")
    clock.advance(50)  # past the first lease, within the renewed one
    assert limiter.peek(one, "u").remaining == 1
    limiter.give_back_all([(checks, "T1", 0)])
    assert limiter.peek(one, "u").remaining == 4


@pytest.mark.parametrize(("other_cost", "kept"), [(0, True), (1, True), (2, False)])
def test_a_shared_set_past_its_lease_is_taken_again_where_each_limit_has_room(
        limiter: rl.Limiter, clock: Any, other_cost: int, kept: bool) -> None:
    """Limits of one name, 2 slots at cost 1 and 4 at cost 3: a holder paused past its
    lease takes its three members again only where each limit has room for its own cost
    beside the others' members: another holder's one slot leaves each room enough, its
    two leave the first none."""
    two = rl.Policy.in_flight(2, lease=60, name="jobs")
    four = rl.Policy.in_flight(4, lease=60, name="jobs")
    compiled = limiter.compile([(two, 1), (four, 3)])
    assert limiter.hit_compiled(compiled, ("u", "u"), token="T1").allowed
    checks = compiled.checks(("u", "u"))
    clock.advance(61)  # every member's lease has ended
    if other_cost:
        assert limiter.hit(two, "u", cost=other_cost).allowed
    assert limiter.renew(checks, "T1") is kept
    assert limiter.peek(four, "u").remaining == 4 - other_cost - (3 if kept else 0)
