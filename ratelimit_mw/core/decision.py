"""Decision: what the limiter answered, as plain data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from ratelimit_mw.core.policy import Policy
    from ratelimit_mw.core.rates import Rate


class TierState(NamedTuple):
    """One tier's answer within a Decision (immutable; a NamedTuple because one is built per
    tier per request)."""

    policy: Policy
    rate: Rate
    identity: str
    allowed: bool
    remaining: int
    retry_after: float
    reset_after: float
    banned: bool = False


@dataclass(frozen=True, slots=True)
class Booking:
    """What `cancel` needs to take back an admitted `reserve`."""

    policy: Policy
    identity: str
    token: str
    cost: int
    at_ms: int


class Decision(NamedTuple):
    """The answer to one hit, peek or reservation — an immutable value.

    ``remaining`` is the quota left after this hit (for peek: left now), ``retry_after`` the
    seconds until a retry can be admitted (0.0 when admitted; ``inf`` when the cost exceeds the
    limit and can never be admitted), ``reset_after`` the seconds until the quota is whole
    again. ``policy`` and ``rate`` name the governing tier: the refusing one with the longest
    wait, otherwise the one with the least remaining. ``tiers`` holds every tier's answer.
    ``at_us`` is the store's clock (µs since the epoch) when it admitted the call, 0 when not
    known (a refusal): a `Ticket` gives back only within the window it was charged in.

    A NamedTuple because one is built for every request, and a tuple builds faster than a
    frozen dataclass. ``bool(decision)`` is ``decision.allowed``.
    """

    allowed: bool
    limit: int
    remaining: int
    retry_after: float
    reset_after: float
    policy: Policy | None = None
    rate: Rate | None = None
    identity: str = ""
    banned: bool = False
    tiers: tuple[TierState, ...] = ()
    booking: Booking | None = None
    at_us: int = 0

    def __bool__(self) -> bool:
        return self.allowed

    def __repr__(self) -> str:
        return (
            f"Decision(allowed={self.allowed}, limit={self.limit}, remaining={self.remaining}, "
            f"retry_after={self.retry_after!r}, reset_after={self.reset_after!r}, "
            f"policy={self.policy!r}, rate={self.rate!r}, identity={self.identity!r}, "
            f"banned={self.banned})"
        )
