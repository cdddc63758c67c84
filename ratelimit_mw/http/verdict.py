"""What the guard says of one request: `Plan` (the checks it sends), `Admit` (serve it),
`Refuse` (a 429), `Unavailable` (a 503), and `Held` (the in-flight slots an admitted
request holds while its response runs). Data only: the guard makes them, the adapters read
them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from ratelimit_mw.core.codec import Check, GiveBack
from ratelimit_mw.core.compiled import Compiled
from ratelimit_mw.core.decision import Decision
from ratelimit_mw.core.identity import CACHED_LENGTH
from ratelimit_mw.http.headers import Headers, RawHeaders
from ratelimit_mw.http.selection import Selection


class Plan:
    """What one request sends: the compiled hit, an identity per check, the selection they
    came from (for headers), when some limit has one, each check's own count_when, and
    when it takes in-flight slots, the token they are held (and given back) by."""

    __slots__ = ("compiled", "identities", "selection", "token", "whens")

    def __init__(self, compiled: Compiled, identities: tuple[str, ...], selection: Selection,
                 whens: tuple[Callable[[int], bool] | None, ...] | None = None,
                 token: str | None = None) -> None:
        self.compiled = compiled
        self.identities = identities
        self.selection = selection
        self.whens = whens
        self.token = token

    @property
    def checks(self) -> tuple[Check, ...]:
        return self.compiled.checks(self.identities)

    @property
    def held(self) -> tuple[Check, ...]:
        """The in-flight slots among the checks."""
        compiled, identities = self.compiled, self.identities
        if len(compiled.in_flight) == 1:  # nearly always: one in-flight limit
            i = compiled.in_flight[0]
            return (_new(Check, (compiled.policies[i], identities[i], compiled.costs[i])),)
        return tuple(_new(Check, (compiled.policies[i], identities[i], compiled.costs[i]))
                     for i in compiled.in_flight)


_PLANS_KEPT = 16_384  # per selection, as the memory store keeps its keys


def keep(kept: dict[str, Plan], identity: str, plan: Plan) -> Plan:
    """`plan` (of one identity, holding no slots: the same for each of its requests), kept in
    its handler's `kept` where the identity's text is short: the clients that come back."""
    if len(identity) <= CACHED_LENGTH:
        if len(kept) >= _PLANS_KEPT:
            kept.clear()
        kept[identity] = plan
    return plan


class Held:
    """The in-flight slots of one admitted request while its response runs: when their
    lease is due for renewal (a third of the shortest lease since the last one, on the
    limiter's clock), whether they have been given back (once), and whether a renewal found
    them gone to another request (`slots.Slots.renewed`). `back`: the give-back of the slots
    alone (`give_back_of`), what most responses send when they end."""

    __slots__ = ("admit", "clock", "done", "every", "lost", "next", "plan")

    def __init__(self, admit: Admit, clock: Callable[[], float]) -> None:
        plan = admit.plan
        if plan is None or plan.token is None:
            raise ValueError("Held is for an admitted request that holds in-flight slots")
        # `asgi_send.Holding.__init__` sets these same fields itself: a new one goes in both.
        self.admit = admit
        self.plan = plan
        self.every = plan.compiled.renew_every
        self.clock = clock
        self.next = clock() + self.every
        self.done = False
        self.lost = False

    @property
    def token(self) -> str:
        return self.plan.token  # type: ignore[return-value]

    # Asked where the slots go back through the store's call (or a renewal): a store in this
    # process gives them back from the plan (`slots.given_back_here`).
    @property
    def checks(self) -> tuple[Check, ...]:
        return self.plan.held

    @property
    def back(self) -> GiveBack:
        return give_back_of(self.admit, self.checks)

    def due(self) -> bool:
        """Whether to renew now (and then not again for a third of the lease)."""
        now = self.clock()
        if self.done or now < self.next:
            return False
        self.next = now + self.every
        return True


def give_back_of(admit: Admit, checks: Sequence[Check]) -> GiveBack:
    """`checks` of an admitted request given back: by its hit's token, and only within the
    window the store charged it in (its decision's time; 0: not known)."""
    plan, decision = admit.plan, admit.decision
    return (checks, None if plan is None else plan.token,
            0 if decision is None else decision.at_us)


class Admit:
    """Serve the request; add `headers` (`raw`, for a guard built with ``raw=True``); when
    its `plan` is there, the response's status may give hits back (`Guard.given_back`), or
    it holds in-flight slots to give back when it ends.

    A class with slots, built with no ``__init__`` call (`admitted`, or in place by the
    handler): it builds and reads faster than a NamedTuple."""

    __slots__ = ("decision", "headers", "plan", "raw")
    decision: Decision | None
    headers: Headers | None
    plan: Plan | None
    raw: RawHeaders | None


def admitted(decision: Decision | None, headers: Headers | None, plan: Plan | None,
             raw: RawHeaders | None = None) -> Admit:
    """An `Admit` of these fields."""
    admit = Admit()
    admit.decision = decision
    admit.headers = headers
    admit.plan = plan
    admit.raw = raw
    return admit


class Refuse(NamedTuple):
    decision: Decision
    status: int
    headers: Headers
    body: bytes


class Unavailable(NamedTuple):
    status: int
    headers: Headers
    body: bytes


Verdict = Admit | Refuse | Unavailable
PASS = admitted(None, None, None)
# A NamedTuple built per request skips its generated __new__ (fields given in order).
_new = tuple.__new__
