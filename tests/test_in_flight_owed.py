"""The give-backs a guard owes a store that missed them (`ratelimit_mw.http.slots.Slots`):
only in-flight slots are kept (a ZREM by token: sending it twice changes nothing; a rate's
give-back would count twice), each until its lease ends, at most `OWED_MAX`."""

from __future__ import annotations

from typing import Any

import ratelimit_mw as rl
from ratelimit_mw.core.codec import Check
from ratelimit_mw.core.policy import CONCURRENCY
from ratelimit_mw.http.slots import OWED_MAX, Slots


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
