"""The guard's calls for in-flight slots beyond a response's own: give-backs (with those owed
to the store), the owed ones settled before a request's call, and renewals, each in the memory
fallback for a slot taken there (`ratelimit_mw.http.slots` keeps the books).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ratelimit_mw.http.slots import Hits, lease_of

if TYPE_CHECKING:
    from ratelimit_mw._async.limiter import AsyncLimiter
    from ratelimit_mw.http.guard import Guard, Held


async def give_back_async(guard: Guard, limiter: AsyncLimiter, hits: Hits) -> None:
    """`Guard.refund_all_async`: the slots taken in memory given back there; the rest, with
    any give-backs owed to the store, in one call (kept if the store misses them)."""
    slots = guard.slots
    if slots.local and guard._fallback is not None:
        hits = slots.release_here(guard._fallback, hits)
        if not hits:
            return
    if not guard.may_refund():
        slots.keep(limiter, hits)
        return
    owed = slots.due(limiter) if slots.owed else []
    try:
        await limiter._give_back_all([*hits, *((each.checks, each.token) for each in owed)]
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
        await limiter._give_back_all([(each.checks, each.token) for each in owed],
                                     guard.timeout)
    except BaseException:
        guard.slots.put_back(owed)
        raise


async def renew_async(guard: Guard, limiter: AsyncLimiter, held: Held) -> None:
    """`Guard.renew_async`: in the memory fallback for a slot taken there, else in the store;
    a lease found lost is reported (`Slots.renewed`); raises `LeaseLost` only then, with
    ``on_lease_lost="end"``."""
    slots = guard.slots
    token = held.token
    try:
        if token in slots.local:
            kept = guard._fallback._renew(held.checks, token)
            slots.local[token] = limiter._monotonic() + lease_of(held.checks)
        else:
            kept = await limiter._renew(held.checks, token, guard.timeout)
    except Exception as exc:
        guard.log_failure("ratelimit_mw: could not renew an in-flight lease", exc)
        return
    slots.renewed(guard, held, kept)

