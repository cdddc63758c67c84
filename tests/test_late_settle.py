"""A settle gives back only within the window it was charged in (issue 43, item 3).

A ticket charged in one window and settled below its estimate after that window ended gave
the difference back from the next one: another client's hits vanished and a hit of 100 was
admitted on top of them (limit 100 per 2 s; fixed window, sliding window and GCRA alike).
The ticket now carries the store's clock of its charge (`Decision.at_us`), and the give-back
is bounded by what of that charge still counts (docs/settle.md). Memory and the real Redis,
on the fake clock (the script's `now`, as the store's clock).
"""

from __future__ import annotations

from typing import Any

import pytest

import ratelimit_mw as rl
from ratelimit_mw.core.codec import Check

RATE = "100/2 seconds"


def settle_late(limiter: rl.Limiter, clock: Any, algorithm: str, charged_at: float,
                settled_at: float) -> rl.Policy:
    """Charge an estimate of 100 at `charged_at` s into the first 2 s window, another
    client's hit of 50 at `settled_at` s, then the settle at 50 (a give-back of 50)."""
    policy = rl.Policy(RATE, algorithm=algorithm, name=f"late-{algorithm}")
    clock.advance(2 - clock() % 2 + charged_at)  # `charged_at` into a fresh 2 s window
    ticket = limiter.charge(policy, "u", 100)
    assert ticket.decision.allowed
    clock.advance(settled_at - charged_at)
    assert limiter.hit(policy, "u", 50).allowed  # another client's 50
    ticket.settle(50)
    return policy


@pytest.mark.parametrize("algorithm", ["fixed-window", "gcra", "sliding-log"])
def test_a_late_settle_gives_nothing_back_from_the_next_window(
    limiter: rl.Limiter, clock: Any, algorithm: str
) -> None:
    policy = settle_late(limiter, clock, algorithm, 0.1, 2.5)
    # The other client's 50 still counts: 50 left, and a hit of 100 is refused.
    assert limiter.peek(policy, "u").remaining == 50
    assert not limiter.hit(policy, "u", 100).allowed
    assert limiter.hit(policy, "u", 50).allowed


def test_a_late_settle_on_a_sliding_window_gives_back_from_the_window_charged_in(
    limiter: rl.Limiter, clock: Any
) -> None:
    """The previous window still weighs on the current one: the give-back comes out of its
    count (100 -> 50), never out of the other client's 50 in the current window."""
    policy = settle_late(limiter, clock, "sliding-window", 0.1, 3.9)
    # Elapsed 1.9 s of 2: the previous window weighs 50 x 0.1 / 2 = 2.5 -> 100 - 2.5 - 50.
    assert limiter.peek(policy, "u").remaining == 47
    assert not limiter.hit(policy, "u", 48).allowed


def test_a_settle_two_windows_late_gives_nothing_back_on_a_sliding_window(
    limiter: rl.Limiter, clock: Any
) -> None:
    policy = settle_late(limiter, clock, "sliding-window", 0.1, 4.5)
    # The window charged in weighs nothing any more: the current one holds the other 50.
    assert limiter.peek(policy, "u").remaining == 50


@pytest.mark.parametrize("algorithm", sorted(rl.ALGORITHMS))
def test_a_settle_within_its_window_still_gives_back(
    limiter: rl.Limiter, clock: Any, algorithm: str
) -> None:
    policy = rl.Policy(RATE, algorithm=algorithm, name=f"early-{algorithm}")
    clock.advance(2 - clock() % 2 + 0.1)
    ticket = limiter.charge(policy, "u", 100)
    clock.advance(0.02)
    ticket.settle(40)
    # As if 40 had been charged: 60 left (GCRA: and the 20 ms since have freed one more).
    expected = 61 if algorithm == "gcra" else 60
    assert limiter.peek(policy, "u").remaining == expected


def test_gcra_gives_back_only_what_of_the_charge_is_still_ahead(
    limiter: rl.Limiter, clock: Any
) -> None:
    """Charged 100 at t (emission [t, t + 2 s)), another client's 25 at t + 1.5 s (stacked
    on it: the TAT is t + 2.5 s), then settled at 10: of the 90 to give back only 0.5 s (25
    units) of the charge's own emission is still ahead. The other client's 25 stay."""
    policy = rl.Policy(RATE, algorithm="gcra", name="gcra-partial")
    clock.advance(2 - clock() % 2)
    ticket = limiter.charge(policy, "u", 100)
    clock.advance(1.5)
    assert limiter.hit(policy, "u", 25).remaining == 50
    ticket.settle(10)
    assert limiter.peek(policy, "u").remaining == 75


def test_the_ticket_carries_the_store_clock_of_its_charge(
    limiter: rl.Limiter, clock: Any
) -> None:
    ticket = limiter.charge(rl.Policy(RATE, algorithm="fixed-window"), "u", 5)
    assert ticket.decision.at_us == round(clock() * 1_000_000)


@pytest.mark.parametrize("algorithm", ["fixed-window", "gcra"])
def test_a_batch_of_give_backs_gives_each_back_within_its_own_window(
    limiter: rl.Limiter, clock: Any, algorithm: str
) -> None:
    """The responses that end in one turn give back in one call, each naming its own charge
    (the middleware's 405s and count_when): a hit charged in a window that has ended gives
    nothing back from this one; a hit charged in this one is given back."""
    policy = rl.Policy("3/2 seconds", algorithm=algorithm, name=f"batch-{algorithm}")
    clock.advance(2 - clock() % 2 + 0.1)
    old = limiter.hit(policy, "u")
    clock.advance(2.0)  # the next window
    new = limiter.hit(policy, "u")
    assert limiter.hit(policy, "u").allowed  # another request's, which stays
    check = Check(policy, "u")
    limiter.give_back_all([((check,), "old-response", old.at_us),
                           ((check,), "new-response", new.at_us)])
    assert limiter.peek(policy, "u").remaining == 2
