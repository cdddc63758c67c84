"""What the limiter hands out, each held by its caller: a slot of a fleet-wide semaphore
(`Slot`, from ``concurrent``), a cost reserved before it is known (`AsyncTicket`, from
``charge``) and one connection's message budget (`Messages`, from ``messages``). Each calls
back into its limiter for the I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ratelimit_mw._synchronization import every_async
from ratelimit_mw.core import codec
from ratelimit_mw.core.codec import Check
from ratelimit_mw.core.decision import Decision
from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.core.policy import Policy

if TYPE_CHECKING:  # its annotations only: the limiter builds these, and imports this module
    from ratelimit_mw._async.limiter import AsyncLimiter


class Slot:
    """One slot of a fleet-wide semaphore (`AsyncLimiter.concurrent`), held while its
    ``async with`` block runs; ``decision`` is the admission's."""

    __slots__ = ("_check", "_compiled", "_renewal", "_token", "decision", "limiter", "timeout")

    def __init__(self, limiter: AsyncLimiter, policy: Policy, timeout: float | None) -> None:
        self.limiter = limiter
        self.timeout = timeout
        self._check = Check(policy, "slots", 1)
        self._compiled = limiter.compile(((policy, 1),))
        self._token = ""
        self._renewal: Any = None
        self.decision: Decision | None = None

    def __repr__(self) -> str:
        return f"Slot({self._check.policy!r}, held={self._renewal is not None})"

    async def __aenter__(self) -> Decision:
        if self._renewal is not None:
            raise ConfigurationError("a Slot is held once at a time; call concurrent() again "
                                     "for another")
        self._token = token = self._compiled.token() or ""
        limiter = self.limiter
        self.decision = await limiter._wait(self._compiled, ("slots",), self.timeout, token)
        lease = self._check.policy.rates[0].period_ms / 1000
        self._renewal = every_async(lease / 3, self._renew)
        return self.decision

    async def _renew(self) -> None:
        await self.limiter.renew((self._check,), self._token)

    async def __aexit__(self, *exc: object) -> None:
        renewal, self._renewal = self._renewal, None
        if renewal is not None:
            await renewal.stop()
        await self.limiter._give_back((self._check,), None, self._token)


class AsyncTicket:
    """An estimated cost reserved by `AsyncLimiter.charge`, to settle once the actual cost
    is known: ``await ticket.settle(actual)`` gives back what was overestimated or charges
    what was under (a window may go into debt: later calls wait until what was really used
    has left it). A ticket never settled keeps its estimate. An in-flight slot it holds is
    given back when it is settled, or by ``release()``."""

    __slots__ = ("check", "decision", "held", "limiter", "settled", "token")

    def __init__(self, limiter: AsyncLimiter, check: Check, token: str,
                 decision: Decision, held: tuple[Check, ...] = ()) -> None:
        self.limiter = limiter
        self.check = check
        self.token = token
        self.decision = decision
        self.held = held  # in-flight slots, until given back
        self.settled: int | None = None

    def __repr__(self) -> str:
        return (f"Ticket({self.check.policy.name!r}, {self.check.identity!r}, "
                f"estimate={self.check.cost}, settled={self.settled})")

    async def settle(self, actual: int) -> None:
        """Make the charge `actual` (a whole number >= 0), once."""
        if isinstance(actual, bool) or not isinstance(actual, int) or actual < 0:
            raise ConfigurationError(f"a ticket settles at a whole cost >= 0, got {actual!r}; "
                                     "e.g. ticket.settle(usage.total_tokens)")
        policy, identity, estimate = self.check
        if actual > policy.max_cost:  # refused before any I/O: the ticket stays unsettled
            raise ConfigurationError(codec.cost_bound_message(actual, policy, "settle"))
        if self.settled is not None:
            raise ConfigurationError(f"this ticket was settled at {self.settled} already")
        # Counted as settled from here: a store error after this may or may not have been
        # applied, and settling again could charge twice.
        self.settled = actual
        limiter = self.limiter
        held, self.held = self.held, ()
        if actual < estimate:  # one call gives back the difference and the slot
            # In the window it was charged in, by the store's clock (none known: as a refund,
            # from what the window holds now).
            at_us = self.decision.at_us
            await limiter._give_back((Check(policy, identity, estimate - actual), *held), None,
                                     self.token, f"{at_us}:{estimate}" if at_us else None)
            return
        if actual > estimate:
            await limiter._backend.arun(
                limiter._single(codec.CHARGE, policy, identity, actual - estimate))
        if held:
            await limiter._give_back(held, None, self.token)

    async def release(self) -> None:
        """Give back the in-flight slot now (once; the estimate stands until settled)."""
        held, self.held = self.held, ()
        if held:
            await self.limiter._give_back(held, None, self.token)

    async def renew(self) -> None:
        """Push the lease of the in-flight slot on (a response that runs long)."""
        if self.held:
            await self.limiter.renew(self.held, self.token)


class Messages:
    """One connection's message budget (`AsyncLimiter.messages`); its counters expire with
    the policy's window once the connection is quiet."""

    __slots__ = ("identity", "limiter", "policy")

    def __init__(self, limiter: AsyncLimiter, policy: Policy, identity: str) -> None:
        self.limiter = limiter
        self.policy = policy
        self.identity = identity

    def __repr__(self) -> str:
        return f"Messages({self.policy!r}, identity={self.identity!r})"

    async def hit(self, cost: int = 1) -> Decision:
        """Count one message (of `cost`); nothing is counted when refused."""
        return await self.limiter.hit(self.policy, self.identity, cost)
