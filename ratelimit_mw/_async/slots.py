"""The guard's calls for in-flight slots beyond a response's own: give-backs (with those owed
to the store), the owed ones settled before a request's call, and renewals, each in the memory
fallback for a slot taken there (`ratelimit_mw.http.slots` keeps the books).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ratelimit_mw.http.slots import Hits, given_back_here, lease_of

if TYPE_CHECKING:
    from ratelimit_mw._async.limiter import AsyncLimiter
    from ratelimit_mw.core.codec import Check
    from ratelimit_mw.http.guard import Guard
    from ratelimit_mw.http.verdict import Admit, Held


async def release_async(guard: Guard, limiter: AsyncLimiter, admit: Admit, status: int) -> None:
    """After an admitted response with this status has ended, however it ended: what it
    gives back (`Guard.released`), in at most one call; never raises."""
    plan = admit.plan
    if plan is not None:
        await refund_async(guard, limiter, admit, guard.released(admit, status))


async def refund_async(guard: Guard, limiter: AsyncLimiter, admit: Admit,
                       checks: Sequence[Check]) -> None:
    """After the admitted response: give back the hits its status gives back
    (`Guard.given_back`, asked by the caller: most responses give nothing back, and then
    nothing is called) and the slots it held, by the hit's token, in one call, each only
    within the window it was charged in (`Guard.give_back_of`); never raises."""
    if checks:
        await give_back_async(guard, limiter, (guard.give_back_of(admit, checks),))


async def give_back_async(guard: Guard, limiter: AsyncLimiter, hits: Hits) -> None:
    """The give-backs of several responses (those that ended in one turn of the event loop),
    never raising: in place where that is all they ask (`given_back_here`), else through
    `give_back_by_call_async`."""
    if not given_back_here(guard, limiter, hits):
        await give_back_by_call_async(guard, limiter, hits)


async def give_back_by_call_async(guard: Guard, limiter: AsyncLimiter, hits: Hits) -> None:
    """What `given_back_here` left, never raising: the slots taken in memory given back
    there; the rest, with any give-backs owed to the store, in one call (kept if the store
    misses them)."""
    slots = guard.slots
    if slots.local and guard.fallback is not None:
        hits = slots.release_here(guard.fallback, hits)
        if not hits:
            return
    if not guard.may_refund():
        slots.keep(limiter, hits)
        return
    owed = slots.due(limiter) if slots.owed else []
    try:
        await limiter.give_back_all([*hits, *((each.checks, each.token, 0) for each in owed)]
                                     if owed else hits, guard.timeout)
    except Exception as exc:
        slots.keep(limiter, hits)
        slots.put_back(owed)
        guard.refund_failed(exc)


async def settle_owed_async(guard: Guard, limiter: AsyncLimiter) -> None:
    """Before a request's call to the store: the give-backs it missed while it was out, in
    one call. If that fails they stay owed, and the error is the request's (the store is
    out: its failure policy, without a second deadline)."""
    owed = guard.slots.due(limiter)
    if not owed:
        return
    try:
        await limiter.give_back_all([(each.checks, each.token, 0) for each in owed],
                                     guard.timeout)
    except BaseException:
        guard.slots.put_back(owed)
        raise


async def renew_async(guard: Guard, limiter: AsyncLimiter, held: Held) -> None:
    """Push the leases of the slots a long response holds: in the memory fallback for a slot
    taken there, else in the store (a lease that could not be renewed ends, and its slot
    comes back, when its time is up); a lease found lost is reported (`Slots.renewed`);
    raises `LeaseLost` only then, with ``on_lease_lost="end"``."""
    slots = guard.slots
    token = held.token
    try:
        if token in slots.local:
            kept = guard.fallback.renew(held.checks, token)
            slots.local[token] = limiter.monotonic() + lease_of(held.checks)
        else:
            kept = await limiter.renew(held.checks, token, guard.timeout)
    except Exception as exc:
        guard.log_failure("ratelimit_mw: could not renew an in-flight lease", exc)
        return
    slots.renewed(guard, held, kept)

