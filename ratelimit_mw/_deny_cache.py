"""The local deny cache: remember "refused until T" so a flood costs no backend calls.

When the store refuses an identity under a policy, nothing but time (or a reset or refund)
can admit a hit of the same or a larger cost before `retry_after` has passed: other hits on
that identity are refused too, so they cannot change the answer. Remembering the refusal in
process until then answers a flood from one client without a round trip.

Honest limits, stated: a `reset`/`refund` made through THIS limiter forgets the entry at
once; one made by another process takes effect here when the entry runs out (at most the
retry_after the store gave). The size is bounded; when full, expired entries go first, then
the oldest.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from ratelimit_mw.core import Check
from ratelimit_mw.decision import Decision
from ratelimit_mw.policy import Policy


class DenyCache:
    __slots__ = ("_entries", "size")

    def __init__(self, size: int = 10_000) -> None:
        self.size = size
        # (policy, identity) -> (until, smallest refused cost, decision, decided at)
        self._entries: dict[tuple[Policy, str], tuple[float, int, Decision, float]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, checks: Sequence[Check], now: float) -> Decision | None:
        """A refusal still in force for any of the checks, or None."""
        entries = self._entries
        if not entries:
            return None
        found: tuple[float, int, Decision, float] | None = None
        for check in checks:
            if check.cost > check.policy.smallest_limit:
                # Never admissible, whatever the wait: the store answers that ("inf"), not us.
                return None
            entry = entries.get((check.policy, check.identity))
            if entry is None:
                continue
            if entry[0] <= now:
                del entries[(check.policy, check.identity)]
                continue
            if check.cost >= entry[1] and (found is None or entry[0] > found[0]):
                found = entry
        if found is None:
            return None
        until, _, decision, decided = found
        elapsed = now - decided
        # Rounded to the millisecond the store itself answers in.
        return decision._replace(
            retry_after=round(until - now, 3),
            reset_after=round(max(0.0, decision.reset_after - elapsed), 3),
        )

    def remember(self, checks: Sequence[Check], decision: Decision, now: float) -> None:
        """Keep the refusing tiers of a refused decision until their retry_after passes."""
        costs = {(c.policy, c.identity): c.cost for c in checks}
        for tier in decision.tiers:
            if tier.allowed or tier.retry_after == float("inf") or tier.retry_after <= 0:
                continue
            key = (tier.policy, tier.identity)
            cost = costs.get(key)
            if cost is None:
                continue
            until = now + tier.retry_after
            current = self._entries.get(key)
            if current is not None and current[0] >= until:
                continue
            if current is None and len(self._entries) >= self.size:
                self._evict(now)
            self._entries[key] = (until, cost, decision, now)

    def forget(self, policy: Policy, identity: str) -> None:
        self._entries.pop((policy, identity), None)

    def _evict(self, now: float) -> None:
        # Free a tenth of the room per pass (every expired entry, then the oldest): a pass
        # reads the whole map, so freeing one entry per pass would cost a full scan for every
        # new refusal while a flood of distinct identities keeps the cache full.
        entries = self._entries
        for key in [key for key, entry in entries.items() if entry[0] <= now]:
            del entries[key]
        excess = len(entries) - (self.size - max(1, self.size // 10))
        if excess > 0:
            for key in list(itertools.islice(entries, excess)):
                del entries[key]
