"""The in-flight slots a guard answers for beyond a response's own calls, for every adapter.

A slot is taken in the request's one call and given back, renewed, in one call each
(`ratelimit_mw.http.guard`, through `ratelimit_mw._async.slots` and its sync twin). Three
cases a lease alone would settle late, or never report:

- **A give-back the store missed** (it was down, or the breaker skipped it): the slots are
  owed to the store (`Slots.owed`), and given back with the next give-back this guard sends,
  or just before the next request's call to the store (the breaker's probe, after an
  outage), whichever comes first. Only slots are kept (a ZREM by the hit's
  token: sending it twice changes nothing), at most `OWED_MAX`, each until its lease has
  ended (the store frees it then anyway).
- **A slot taken in the memory fallback** (``on_backend_error="memory"``): it is given back
  and renewed in that memory, by its token, never in the store (`Slots.local`).
- **A lease that ended before its renewal** (the process was paused past it): the script
  takes the slot again if it is still free; if it is someone else's, the holder is lost:
  the ``lease_lost`` metric, a throttled log line, and ``on_lease_lost`` ("continue": the
  response goes on without its slot; "end": `LeaseLost` is raised into it).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from ratelimit_mw.core.codec import Check, GiveBack
from ratelimit_mw.core.policy import CONCURRENCY
from ratelimit_mw.http.verdict import Held
from ratelimit_mw.log import ThrottledLog
from ratelimit_mw.metrics import LEASE_LOST

if TYPE_CHECKING:
    from ratelimit_mw.http.guard import Guard
    from ratelimit_mw.limiter import Limiter

# Give-backs kept for a store that is out: a worker's in-flight responses of a few leases
# at most; past it the oldest go (their leases end first, and free them).
OWED_MAX = 10_000

Hits = Sequence[GiveBack]


class LeaseLost(Exception):
    """Raised into a response that holds in-flight slots (``on_lease_lost="end"``) when a
    renewal finds its lease ended and the slot taken by another request: the response ends
    (the server closes its connection), so the limit holds again."""


class Owed(NamedTuple):
    """Slots whose give-back the store missed: `limiter`'s, by `token`, until `until` (the
    limiter's monotonic clock), when their lease has freed them anyway."""

    until: float
    limiter: Any
    checks: tuple[Check, ...]
    token: str


def given_back_here(guard: Guard, limiter: Any, hits: Hits | Held) -> bool:
    """One response's give-back done now, where the store is in this process (the limiter's
    `give_back_here`; for a `Held`, its slots alone: `give_back_held`) and nothing asks for
    more than its own release: no slot of the guard's is in its fallback's memory, nothing
    is owed to the store, and the breaker lets the store be asked. False: left to
    `give_back_by_call_async` or its sync twin. Never raises: a failure is kept owed and
    reported, as there."""
    slots = guard.slots
    if not limiter.local_store or slots.local or slots.owed or guard.breaker.open_until:
        return False  # a store out of this process: its call
    try:
        if not isinstance(hits, Held):
            return bool(limiter.give_back_here(hits))
        plan, decision = hits.plan, hits.admit.decision
        # A selection the store does not type whole (a penalty's, a calendar's beside the
        # slots): its slots alone, as checks.
        return bool(limiter.give_back_held(plan.compiled, plan.identities, plan.token,
                                           0 if decision is None else decision.at_us)
                    or limiter.give_back_here((hits.back,)))
    except Exception as exc:
        slots.keep(limiter, (hits.back,) if isinstance(hits, Held) else hits)
        guard.refund_failed(exc)
        return True


def lease_of(checks: Iterable[Check]) -> float:
    """The longest lease of these slots, in seconds."""
    return max(check.policy.rates[0].period_ms for check in checks) / 1000


class Slots:
    """One guard's owed give-backs and slots taken in its memory fallback (threads may share
    it: a lock around every change; readers look at `owed` and `local` without it)."""

    __slots__ = ("_lock", "dropped", "local", "log", "owed")

    def __init__(self) -> None:
        self.owed: list[Owed] = []
        # token -> when its lease ends (the limiter's clock): slots taken in the fallback.
        self.local: dict[str, float] = {}
        self.dropped = 0  # owed give-backs dropped for room (OWED_MAX)
        self._lock = threading.Lock()
        self.log = ThrottledLog()

    # -- owed to the store ---------------------------------------------------------------
    def keep(self, limiter: Any, hits: Hits) -> None:
        """The give-back of `hits` failed: keep their slots for the store's return."""
        now = limiter.monotonic()
        kept = [Owed(now + lease_of(held), limiter, held, token) for checks, token, _ in hits
                if token for held in (tuple(c for c in checks
                                            if c.policy.algorithm == CONCURRENCY),) if held]
        if kept:
            self.put_back(kept)

    def put_back(self, owed: Sequence[Owed]) -> None:
        """Owed give-backs that were sent and failed again: kept as they were (same end)."""
        with self._lock:
            self.owed.extend(owed)
            over = len(self.owed) - OWED_MAX
            if over > 0:
                del self.owed[:over]
                self.dropped += over

    def due(self, limiter: Any) -> list[Owed]:
        """Take the give-backs owed by `limiter` whose leases have not ended (the ended
        ones are dropped: the store has freed them)."""
        now = limiter.monotonic()
        with self._lock:
            owed, self.owed = self.owed, []
            mine = [each for each in owed if each.limiter is limiter]
            # Another limiter's (a test fixture's swap) wait for a call of their own.
            self.owed = [each for each in owed if each.limiter is not limiter
                         and each.until > now]
        return [each for each in mine if each.until > now]

    # -- taken in the memory fallback ----------------------------------------------------
    def taken_here(self, limiter: Any, checks: Sequence[Check], token: str) -> None:
        now = limiter.monotonic()
        with self._lock:
            local = self.local
            if len(local) >= OWED_MAX:  # responses that never ended: their leases did
                for stale in [t for t, until in local.items() if until <= now]:
                    del local[stale]
            local[token] = now + lease_of(c for c in checks if c.policy.algorithm == CONCURRENCY)

    def release_here(self, fallback: Limiter, hits: Hits) -> Hits:
        """Give back in the fallback's memory the slots among `hits` that were taken there;
        the rest, for the store. (What the fallback admitted is never given back, only
        its slots: the store never recorded it.)"""
        mine: list[GiveBack] = []
        rest: list[GiveBack] = []
        with self._lock:
            for hit in hits:
                checks, token, _ = hit
                if token and self.local.pop(token, None) is not None:
                    mine.append((tuple(c for c in checks if c.policy.algorithm == CONCURRENCY),
                                 token, 0))
                else:
                    rest.append(hit)
        if mine:
            try:
                fallback.give_back_all(mine)
            except Exception as exc:  # the memory backend's own failure: the lease frees it
                self.log("ratelimit_mw: could not give back a slot held in memory", exc)
        return rest

    # -- a renewal's answer --------------------------------------------------------------
    def renewed(self, guard: Guard, held: Held, kept: bool) -> None:
        """What a renewal found: the slots held (renewed, or taken again after a pause), or
        lost to another request: reported once per response, then ``on_lease_lost``."""
        if kept:
            if held.lost:
                held.lost = False
                self.log("ratelimit_mw: an in-flight response took its slot again after "
                         "losing it")
            return
        if not held.lost:
            held.lost = True
            names = [check.policy.name for check in held.checks]
            guard.observe(LEASE_LOST, names, 0.0)
            choice = guard.config.on_lease_lost
            self.log(f"ratelimit_mw: an in-flight lease ({', '.join(dict.fromkeys(names))}) "
                     f"ended before its renewal (the process paused past it?) and its slot "
                     f"is another request's now; on_lease_lost={choice!r}: "
                     + ("the response goes on without it" if choice == "continue"
                        else "ending the response"))
        if guard.config.on_lease_lost == "end":
            raise LeaseLost("the response's in-flight slot went to another request while "
                            "its lease had ended (on_lease_lost=\"end\")")
