"""The local deny cache: answer repeats of a refusal in process, exactly as the store would.

When the store refuses a hit, its reply also says for how long every number in it holds
(retry and reset counting down with the clock): until a fixed window ends, the oldest entry
of a sliding log leaves its window, a sliding window's fading weight frees a hit, a GCRA
emission step passes, a ban ends — and never past the refusing tier's retry. Until then,
with nothing written, the store would give the same hit the same answer: the cache replays
the reply (`codec.replay`, the same decoding and ms rounding as the store's answer), so a
flood from one client costs no round trip and no answer differs from the store's.

What could still write, and how it is bounded:

- Through this cache's limiter: every hit that reaches the store, and every peek, refund,
  reset, reservation and cancellation, forgets the entries sharing a (policy, identity) with
  it before anything else happens.
- Another process (or another limiter): entries live at most ``max_age`` seconds (1 s by
  default), so a reset, refund or cancel made anywhere takes effect everywhere within it.

An entry answers only the very call that was refused: the same checks (policies,
identities, costs) in the same order. Only a refusal one store call decided is kept (not
one from a request split over cluster slots). Size is bounded in entries and in bytes (long
identities are charged by their length); when full, expired entries go first, then the
oldest.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from ratelimit_mw.core import codec, wire
from ratelimit_mw.core.codec import Check, Layout
from ratelimit_mw.core.decision import Decision
from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.core.policy import Policy

DEFAULT_MAX_AGE = 1.0
DEFAULT_MAX_BYTES = 8 * 1024 * 1024
# What one entry costs besides its identities' text (the entry, its key, the reply, the last
# Decision replayed, the index), fixed and per tier: the byte bound holds whatever the
# identities look like.
_ENTRY_BYTES = 1_100
_TIER_BYTES = 280

_Key = tuple[Check, ...]


class Lapsed:
    """The type of LAPSED (see `DenyCache.find`)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "LAPSED"


LAPSED = Lapsed()
# What a write touches: a policy's counters are named by its key segment (its name and
# algorithm), so two Policy objects with one name share them, and a reset through either one
# must forget what the other holds.
_Pair = tuple[str, str]


class _Entry:
    """One refusal: the store's reply and when it was decided, in the cache's µs; the last
    Decision replayed from it, and until when (µs) that Decision stays the same, so a flood
    decodes the reply about once per millisecond rather than once per hit."""

    __slots__ = ("charge", "decided", "layout", "memo", "memo_from", "memo_until", "reply",
                 "until")

    def __init__(self, until: int, decided: int, layout: tuple[tuple[Policy, str], ...],
                 reply: Sequence[int], charge: int) -> None:
        self.until = until
        self.decided = decided
        self.layout = layout
        self.reply = reply
        self.charge = charge
        self.memo: Decision | None = None
        self.memo_from = self.memo_until = 0


def validate_max_age(max_age: float) -> float:
    if (isinstance(max_age, bool) or not isinstance(max_age, (int, float))
            or not 0 < max_age <= 3600):
        raise ConfigurationError(
            f"deny_cache_max_age is how long, in seconds, a refusal may be answered in process "
            f"without asking the store (a reset elsewhere takes effect within it); it must be "
            f"above 0 and at most 3600, got {max_age!r}; e.g. deny_cache_max_age=1.0"
        )
    return float(max_age)


class DenyCache:
    __slots__ = ("_bytes", "_lock", "entries", "index", "max_age_us", "max_bytes", "size")

    def __init__(self, size: int = 10_000, max_age: float = DEFAULT_MAX_AGE,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.size = size
        self.max_age_us = round(validate_max_age(max_age) * 1_000_000)
        self.max_bytes = max_bytes
        self.entries: dict[_Key, _Entry] = {}
        # (policy segment, identity) -> the keys of the entries it appears in: what a write
        # forgets.
        self.index: dict[_Pair, list[_Key]] = {}
        self._bytes = 0
        # Changes take the lock (threaded WSGI servers share one limiter); a lookup that
        # finds a live entry does not: it only reads, and at worst replays a Decision again.
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def bytes(self) -> int:
        """The bytes charged for the entries held (what `max_bytes` bounds)."""
        return self._bytes

    def find(self, checks: Sequence[Check], now_us: int) -> Decision | Lapsed | None:
        """The store's answer to this very hit now, if a refusal held for it still says it;
        else one of two misses: None, nothing was held for this call; LAPSED, a refusal of
        this very call was held and no longer holds (dropped now), so the store will most
        likely refuse again: the async limiter lets one call ask it for every request
        waiting on the same answer."""
        entries = self.entries
        if not entries:
            return None
        key = tuple(checks)
        entry = entries.get(key)
        if entry is None:
            return None
        if not entry.decided <= now_us < entry.until:
            with self._lock:
                self._drop(key)
            return LAPSED
        memo = entry.memo
        if memo is not None and entry.memo_from <= now_us < entry.memo_until:
            return memo
        memo, same_until = codec.replay(entry.layout, entry.reply, now_us - entry.decided)
        entry.memo, entry.memo_from, entry.memo_until = memo, now_us, entry.decided + same_until
        return memo

    def record(self, checks: Sequence[Check], layout: Layout, reply: Sequence[int],
               sent_us: int) -> None:
        """After the store decided a hit in one call sent at `sent_us` (its reply read by
        `layout`, the call's): forget what the checks' pairs held (the hit may have
        written), and keep a refusal it says holds."""
        if reply[0] == 1 and not self.index:
            return
        window = codec.replay_window(reply)
        if window is not None and (window < 0 or window > self.max_age_us):
            window = self.max_age_us
        key = tuple(checks)
        charge = (_ENTRY_BYTES + _TIER_BYTES * ((len(reply) - 1) // 8)
                  + sum(len(check.identity) for check in checks))
        with self._lock:
            self._forget(checks)
            if window is None or charge > self.max_bytes:
                return
            if len(self.entries) >= self.size or self._bytes + charge > self.max_bytes:
                self._evict(sent_us, charge)
            self.entries[key] = _Entry(sent_us + window, sent_us, layout, reply, charge)
            self._bytes += charge
            index = self.index
            for check in checks:
                pair = (wire.wire(check.policy).segment, check.identity)
                keys = index.get(pair)
                if keys is None:
                    index[pair] = [key]
                elif key not in keys:
                    keys.append(key)

    def forget(self, checks: Sequence[Check]) -> None:
        """Drop every entry in which any of these (policy, identity) pairs appears."""
        if self.index:
            with self._lock:
                self._forget(checks)

    def _forget(self, checks: Sequence[Check]) -> None:
        index = self.index
        for check in checks:
            keys = index.get((wire.wire(check.policy).segment, check.identity))
            if keys is not None:
                for key in list(keys):
                    self._drop(key)

    def _drop(self, key: _Key) -> None:
        entry = self.entries.pop(key, None)
        if entry is None:
            return
        self._bytes -= entry.charge
        index = self.index
        for check in key:
            pair = (wire.wire(check.policy).segment, check.identity)
            keys = index.get(pair)
            if keys is not None:
                if key in keys:
                    keys.remove(key)
                if not keys:
                    del index[pair]

    def _evict(self, now_us: int, incoming: int) -> None:
        # Free a tenth of the room per pass (every expired entry, then the oldest): a pass
        # reads the whole map, so freeing one entry per pass would cost a full scan for every
        # new refusal while a flood of distinct identities keeps the cache full.
        entries = self.entries
        for key in [key for key, entry in entries.items() if entry.until <= now_us]:
            self._drop(key)
        count_goal = self.size - max(1, self.size // 10)
        bytes_goal = self.max_bytes - max(incoming, self.max_bytes // 10)
        if len(entries) > count_goal or self._bytes > bytes_goal:
            for key in list(entries):
                if len(entries) <= count_goal and self._bytes <= bytes_goal:
                    break
                self._drop(key)
