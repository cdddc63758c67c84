"""The give-backs a guard owes a store that missed them (`ratelimit_mw.http.slots.Slots`):
only in-flight slots are kept (a ZREM by token: sending it twice changes nothing; a rate's
give-back would count twice), each until its lease ends, at most `OWED_MAX`; and the
give-back done in place (`given_back_here`) only where none of that is in play."""

from __future__ import annotations

from typing import Any

import pytest

import ratelimit_mw as rl
from ratelimit_mw.core.codec import Check
from ratelimit_mw.core.policy import CONCURRENCY
from ratelimit_mw.http.slots import OWED_MAX, Slots, given_back_here
from tests.conftest import REDIS_URL


def _limiter(clock: Any) -> rl.Limiter:
    return rl.Limiter(clock=clock)


def test_only_slots_are_owed_and_only_until_their_lease_ends(clock: Any) -> None:
    limiter = _limiter(clock)
    rate = Check(rl.Policy("5/minute"), "a", 1)
    slot = Check(rl.Policy.in_flight(3, lease=10), "a", 1)
    owed = Slots()
    owed.keep(limiter, [((rate, slot), "t1", 0), ((rate,), "t2", 0), ((slot,), None, 0)])
    assert [(each.checks, each.token) for each in owed.owed] == [((slot,), "t1")]
    clock.advance(9.9)
    assert [each.token for each in owed.due(limiter)] == ["t1"]
    assert owed.owed == []
    owed.keep(limiter, [((slot,), "t3", 0)])
    clock.advance(10.1)  # the lease has freed it in the store: nothing left to send
    assert owed.due(limiter) == []


def test_owed_give_backs_are_bounded_the_oldest_dropped_first(clock: Any) -> None:
    limiter = _limiter(clock)
    slot = Check(rl.Policy.in_flight(3), "a", 1)
    owed = Slots()
    owed.keep(limiter, [((slot,), f"t{i}", 0) for i in range(OWED_MAX + 5)])
    assert len(owed.owed) == OWED_MAX and owed.dropped == 5
    assert owed.owed[0].token == "t5"


def test_another_limiters_owed_give_backs_wait_for_a_call_of_their_own(clock: Any) -> None:
    mine, other = _limiter(clock), _limiter(clock)
    slot = Check(rl.Policy.in_flight(3), "a", 1)
    owed = Slots()
    owed.keep(mine, [((slot,), "m", 0)])
    owed.keep(other, [((slot,), "o", 0)])
    assert [each.token for each in owed.due(mine)] == ["m"]
    assert [each.token for each in owed.owed] == ["o"]


def test_the_module_names_the_in_flight_algorithm() -> None:
    assert rl.Policy.in_flight(1).algorithm == CONCURRENCY


# -- given back in place (`given_back_here`): only where nothing else is asked -------------
def _holding_one_slot(clock: Any) -> tuple[Any, rl.Limiter, Check]:
    """A guard over a memory limiter whose one slot of "a" is held by token "t1"."""
    from ratelimit_mw.wsgi import RateLimitMiddleware

    limiter = _limiter(clock)
    slot = Check(rl.Policy.in_flight(1, lease=30), "a", 1)
    guard = RateLimitMiddleware(lambda environ, start: [], limiter=limiter).guard
    compiled = limiter.compile([(slot.policy, 1)])
    assert limiter.hit_compiled(compiled, ("a",), token="t1").allowed
    assert not limiter.hit_compiled(compiled, ("a",), token="t2").allowed
    return guard, limiter, slot


def _slot_is_free(limiter: rl.Limiter, slot: Check) -> bool:
    return limiter.hit_compiled(limiter.compile([(slot.policy, 1)]), ("a",),
                                token="t3", cached=False).allowed


def test_a_give_back_in_process_is_done_in_place(clock: Any) -> None:
    guard, limiter, slot = _holding_one_slot(clock)
    assert given_back_here(guard, limiter, [((slot,), "t1", 0)])
    assert _slot_is_free(limiter, slot)


@pytest.mark.parametrize("state", ["owed", "taken in the fallback", "breaker open",
                                   "two responses"])
def test_a_give_back_is_left_to_the_full_path_where_more_is_asked(clock: Any,
                                                                  state: str) -> None:
    guard, limiter, slot = _holding_one_slot(clock)
    hits: list[Any] = [((slot,), "t1", 0)]
    if state == "owed":
        guard.slots.keep(limiter, [((slot,), "old", 0)])
    elif state == "taken in the fallback":
        guard.slots.taken_here(limiter, (slot,), "elsewhere")
    elif state == "breaker open":
        guard.breaker.failed("the store is down")
    else:
        hits.append(((slot,), "t9", 0))
    assert not given_back_here(guard, limiter, hits)
    assert not _slot_is_free(limiter, slot)  # nothing was given back


def test_a_store_elsewhere_is_never_given_back_in_place(clock: Any) -> None:
    from ratelimit_mw.wsgi import RateLimitMiddleware

    backend = rl.RedisBackend.from_url(REDIS_URL)
    try:
        limiter = rl.Limiter(backend, clock=clock)
        guard = RateLimitMiddleware(lambda environ, start: [], limiter=limiter).guard
        slot = Check(rl.Policy.in_flight(1), "a", 1)
        assert not given_back_here(guard, limiter, [((slot,), "t1", 0)])
    finally:
        backend.close()


def test_a_give_back_that_fails_in_place_is_kept_owed_not_raised(clock: Any) -> None:
    guard, limiter, slot = _holding_one_slot(clock)

    def broken(hits: Any) -> bool:
        raise RuntimeError("the store broke")

    limiter.give_back_here = broken  # type: ignore[method-assign]
    assert given_back_here(guard, limiter, [((slot,), "t1", 0)])  # handled: nothing left
    assert [each.token for each in guard.slots.owed] == ["t1"]
