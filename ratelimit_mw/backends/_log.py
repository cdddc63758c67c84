"""The memory backend's sliding log: lua/sliding_log.lua's sorted set and its sweeps, in Python.

A log keeps one entry per hit, named as the script names its member ("<token>" for a cost of
one, "<token>#<cost>" above), in Redis's order, with the running total of what costs add above
one apiece (the script's "+"). `MemoryBackend` (backends/memory.py) reads and writes it; the
differential test holds the two to identical answers.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence


def _sl_member(token: str, cost: int) -> str:
    """A hit's member in a sliding log: its token, and its cost above one."""
    return token if cost == 1 else f"{token}#{cost}"


class _Log:
    """A sorted set scored by time: parallel lists of scores and member names, kept in Redis's
    order (by score, then by member), and the members indexed by name; one member per hit,
    its cost in `weights` when above one, and `extra` what those costs add above one apiece
    (lua/sliding_log.lua's hash of costs and its running total).

    Two flat lists rather than (score, member) pairs: the window counts bisect the scores, and
    bisecting plain ints is twice as fast. Within one score the names are sorted, so a
    block of one score is found by bisecting the scores."""

    __slots__ = ("extra", "members", "names", "scores", "weights")

    def __init__(self) -> None:
        self.scores: list[int] = []
        self.names: list[str] = []
        self.members: dict[str, int] = {}
        self.weights: dict[str, int] = {}
        self.extra = 0

    @property
    def entries(self) -> list[tuple[int, str]]:
        """ZRANGE key 0 -1 WITHSCORES, as (score, member) pairs (for inspection)."""
        return list(zip(self.scores, self.names, strict=True))

    def times_above(self, floor: int) -> tuple[list[int], list[int]]:
        """The times after `floor` and their entries' costs."""
        first = bisect.bisect_right(self.scores, floor)
        weights = self.weights
        names = self.names[first:]
        return (self.scores[first:],
                [weights.get(name, 1) for name in names] if weights else [1] * len(names))

    def units(self, first: int) -> int:
        """The units of the entries from index `first` on: each weighs its cost, read from
        whichever side of `first` holds fewer entries (the running total covers both)."""
        inside = len(self.names) - first
        weights = self.weights
        if not weights or not self.extra:
            return inside
        if first < inside:
            return inside + self.extra - sum(weights.get(name, 1) - 1
                                             for name in self.names[:first])
        return inside + sum(weights.get(name, 1) - 1 for name in self.names[first:])

    def weigh(self, member: str, cost: int) -> None:
        """Set `member`'s cost (HSET / HDEL in the hash of costs)."""
        self.extra += cost - self.weights.pop(member, 1)
        if cost > 1:
            self.weights[member] = cost

    def add(self, score: int, members: list[str], cost: int = 1) -> None:
        """ZADD of `members` at one score (a hit's one member, of `cost`): appended after
        everything logged (the usual hit), else sorted and merged into that score's block,
        in O(k log k + n) rather than k inserts (Redis orders one score's members by name: a
        refund without a token takes the last ones)."""
        known = self.members
        scores, names = self.scores, self.names
        if len(members) == 1:
            member = members[0]
            if member in known:  # a token used twice: ZADD moves it
                self.remove(members)
            known[member] = score
            if cost != 1:
                self.weigh(member, cost)
            if not scores or scores[-1] < score or (scores[-1] == score and names[-1] < member):
                scores.append(score)
                names.append(member)
                return
        else:
            members = sorted(members)
            if not known.keys().isdisjoint(members):
                self.remove(members)
            known.update(dict.fromkeys(members, score))
        lo = bisect.bisect_left(scores, score)
        hi = bisect.bisect_right(scores, score, lo)
        block = names[lo:hi] + members
        block.sort()  # two sorted runs: one linear merge
        names[lo:hi] = block
        scores[lo:hi] = [score] * len(block)

    def remove(self, members: list[str]) -> None:
        """ZREM of `members` in one pass over the span of their scores."""
        known = self.members
        gone = {member: known.pop(member) for member in members if member in known}
        if not gone:
            return
        if self.weights:
            for member in gone:
                self.weigh(member, 1)
        scores, names = self.scores, self.names
        lo = bisect.bisect_left(scores, min(gone.values()))
        hi = bisect.bisect_right(scores, max(gone.values()), lo)
        kept = [i for i in range(lo, hi) if names[i] not in gone]
        names[lo:hi] = [names[i] for i in kept]
        scores[lo:hi] = [scores[i] for i in kept]

    def remove_entries(self, start: int, stop: int) -> None:
        members = self.members
        weights = self.weights
        for member in self.names[start:stop]:
            del members[member]
            if weights and member in weights:
                self.extra -= weights.pop(member) - 1
        del self.names[start:stop]
        del self.scores[start:stop]

    def take(self, indices: Sequence[int], amount: int) -> None:
        """Give back up to `amount` units from the entries at `indices`, in order: an entry
        given back whole leaves, one given back in part keeps the rest of its cost (renamed:
        its name carries its cost)."""
        gone: list[str] = []
        names, weights = self.names, self.weights
        renamed: tuple[int, str, int] | None = None
        for i in indices:
            if amount <= 0:
                break
            name = names[i]
            cost = weights.get(name, 1)
            if amount >= cost:
                gone.append(name)
                amount -= cost
            else:
                renamed = (self.scores[i], name, cost - amount)
                amount = 0
        if renamed is not None:
            score, name, cost = renamed
            gone.append(name)
        self.remove(gone)
        if renamed is not None:
            self.add(score, [_sl_member(name.partition("#")[0], cost)], cost)


def _sl_peak(ts: Sequence[int], ws: Sequence[int], period: int, at: int) -> int:
    """As sl_peak: the windows ending at `at` and at each entry in (at, at + period), each
    entry weighing its cost."""
    n = len(ts)
    best, lo, hi, units = 0, 0, -1, 0
    stop = at
    while True:
        while hi < n - 1 and ts[hi + 1] <= stop:
            hi += 1
            units += ws[hi]
        while lo <= hi and ts[lo] <= stop - period:
            units -= ws[lo]
            lo += 1
        best = max(best, units)
        if hi >= n - 1 or ts[hi + 1] >= at + period:
            return best
        stop = ts[hi + 1]


def _sl_blocked(
    ts: Sequence[int], ws: Sequence[int], limit: int, period: int, cost: int,
    out: list[tuple[int, int]],
) -> list[tuple[int, int]]:
    """As sl_blocked: the booking times at which `cost` more would not fit this tier."""
    full = limit - cost + 1
    n = len(ts)
    i = j = count = 0
    start: int | None = None
    while j < n:
        x = ts[j] + 1
        if i < n and ts[i] - period + 1 < x:
            x = ts[i] - period + 1
        while i < n and ts[i] - period + 1 == x:
            count += ws[i]
            i += 1
        while j < n and ts[j] + 1 == x:
            count -= ws[j]
            j += 1
        if start is None and count >= full:
            start = x
        elif start is not None and count < full:
            out.append((start, x + period - 2))
            start = None
    return out


def _sl_first_free(blocked: list[tuple[int, int]], at: int) -> int:
    """As sl_first_free: the earliest time from `at` on that no blocked interval covers."""
    for first, last in sorted(blocked, key=lambda b: b[0]):
        if first > at:
            break
        if last >= at:
            at = last + 1
    return at
