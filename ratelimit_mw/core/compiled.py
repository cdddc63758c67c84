"""A compiled set of limits: the script calls of a set of (policy, cost), for any identities.

Whatever applies to a request (one policy or several, each with its cost) is compiled once
into a `Compiled`, the one builder of every call the limiter sends (hit, peek, refund,
reset, book, cancel, a call per cluster slot). It memoises what does not depend on the
request:

- the keys' shapes (a head per identity, a suffix per tier) and the argument tail;
- the hit's wire bytes (RESP) but for its keys: the command header, the script's SHA and
  the argument tail (`head`, `after_key`, `tail_bytes`);
- per returning client (its identities; bounded for the whole process), its common hit
  whole, keys and bytes (`call`, `_keep`): a hit with a clock or a token, a give-back or a
  renewal by a hit's token go on from its keys' bytes, and so does a loop turn's batch of
  give-backs, several hits' kept keys and tiers' bytes put together (`refunds`);
- the deny cache's key (`checks`).

Any other operation, and a hit whose arguments vary per request (a penalty's end, a
calendar's schedule) or that names a policy twice (a default that is also a rule: one
count per identity), is `codec.build`'s call. A memoised call is exactly the one
`codec.build` makes (tests/test_compiled.py holds them to it on random selections). Pure:
no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ratelimit_mw.core import scripts
from ratelimit_mw.core.codec import (
    HIT,
    REFUND,
    RENEW,
    TOKENED,
    Check,
    ScriptCall,
    build,
    governing_tier,
    new_token,
    validate_cost,
)
from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.core.identity import CACHED_LENGTH, encode_identity, encode_short
from ratelimit_mw.core.policy import CONCURRENCY, Policy
from ratelimit_mw.core.wire import Arg, wire

_BY_TOKEN = frozenset((REFUND, RENEW))  # ops that name what a hit holds by its token

_new = tuple.__new__
# The common calls of the clients that come back, per compiled hit and identities, for every
# `Compiled` of the process at once (dynamic limits and costs make many): bounded, emptied
# whole when full, as the identity encoding's cache.
_CALLS_KEPT = 16_384
_kept: dict[tuple[Compiled, tuple[str, ...]], tuple[ScriptCall, bytes]] = {}


def bulk(value: Arg) -> bytes:
    """One RESP bulk string, as hiredis packs a str or an int argument."""
    raw = value.encode("utf-8") if isinstance(value, str) else str(value).encode("ascii")
    return b"$%d\r\n%s\r\n" % (len(raw), raw)


# The ops a kept call is sent with, and an empty argument, packed once.
_OPS = {op: bulk(op) for op in (HIT, *_BY_TOKEN)}
_EMPTY = bulk("")
_EVALSHA = bulk("EVALSHA")


class Compiled:
    """The hit of `items` ((policy, cost) pairs, in the call's order) under `prefix`."""

    __slots__ = (
        "_hit_args",
        "after_key",
        "costs",
        "governs",
        "head",
        "held_release",
        "here",
        "in_flight",
        "items",
        "key_suffixes",
        "log",
        "policies",
        "prefix",
        "rate",
        "release_of",
        "renew_every",
        "slotted",
        "static",
        "tail",
        "tail_bytes",
        "tier_bytes",
    )

    def __init__(self, items: Sequence[tuple[Policy, int]], prefix: str) -> None:
        if not items:
            raise ConfigurationError("a limiter call needs at least one policy")
        for policy, cost in items:
            if not isinstance(policy, Policy):
                raise ConfigurationError(f"expected a Policy, got {policy!r}")
            validate_cost(cost)
        self.items = tuple(items)
        self.policies = tuple(policy for policy, _ in items)
        self.costs = tuple(cost for _, cost in items)
        self.prefix = prefix
        forms = [wire(policy) for policy in self.policies]
        # A sliding log's entries and in-flight slots are named by a token unique to the call.
        self.log = any(form.code in TOKENED for form in forms)
        # The in-flight items (their positions), and how often a holder renews their leases
        # (a third of the shortest), in seconds.
        self.in_flight = tuple(i for i, form in enumerate(forms) if form.code == "cc")
        self.renew_every = min((self.policies[i].rates[0].period_ms / 3000
                                for i in self.in_flight), default=0.0)
        # The tier that governs every admitted decision, where the layout alone says
        # (`codec.governing_tier`): a reply is read without ranking its tiers.
        self.governs = governing_tier([policy.algorithm for policy in self.policies
                                       for _ in policy.rates])
        # A rate and then an in-flight limit, one number each (a route's limit with
        # ``concurrency``): its admitted reply is read by `codec.decoded` without a loop.
        only, *rest = self.policies
        self.slotted = (len(rest) == 1 and len(only.rates) == 1
                        and only.algorithm != CONCURRENCY and rest[0].algorithm == CONCURRENCY)
        self.rate = only.rates[0] if len(items) == 1 and len(only.rates) == 1 else None
        # Arguments fixed by the costs alone, each policy once: the call is assembled here.
        self.static = (all(form.static for form in forms)
                       and len(set(map(id, self.policies))) == len(items))
        suffixes = [s for form in forms for s in form.suffixes]
        self.key_suffixes = tuple(form.suffixes for form in forms)
        args = [arg for form, cost in zip(forms, self.costs, strict=True)
                for arg in (form.static_args(cost) if self.static else ())]
        self.tail: tuple[Arg, ...] = (len(suffixes), *args)
        # The arguments of the common hit (Redis's clock, no token), shared by its calls.
        self._hit_args: tuple[Arg, ...] = (HIT, "", "", "", *self.tail)
        # RESP: *<count> EVALSHA <sha> <number of keys> <keys...> <op> <now> <token> <at> <tail>
        count = 3 + len(suffixes) + 4 + len(self.tail)
        self.head = (b"*%d\r\n" % count + _EVALSHA + bulk(scripts.sha1())
                      + bulk(len(suffixes)))
        # The tiers' arguments alone (a batch of give-backs puts several together).
        self.tier_bytes = b"".join(bulk(arg) for arg in self.tail[1:])
        self.tail_bytes = bulk(self.tail[0]) + self.tier_bytes
        # The common request: no token, Redis's clock, so everything after the keys is fixed.
        self.after_key = bulk(HIT) + bulk("") + bulk("") + bulk("") + self.tail_bytes
        # The limiter's in-process decision of it (`in_process`), and what it was built for
        # (the limiter's `_built`: its store, clock and metrics hook).
        self.here: tuple[Any, Any] = (None, None)
        # The store's own give-back of a hit of it (`releaser`), and the store it is of.
        self.release_of: tuple[Any, Any] = (None, None)
        # The same of its in-flight slots alone (a holder's, when its response ends).
        self.held_release: tuple[Any, Any] = (None, None)

    def __repr__(self) -> str:
        return f"Compiled({list(self.items)!r}, prefix={self.prefix!r})"

    def token(self) -> str | None:
        """A member token for one hit (a sliding log's), else None: drawn once per request,
        so that a call sent again is the very same call."""
        return new_token() if self.log else None

    def checks(self, identities: Sequence[str]) -> tuple[Check, ...]:
        """The Checks this hit stands for (the deny cache's key, a refund, a fallback)."""
        if len(identities) == 1:
            policy, cost = self.items[0]
            return (_new(Check, (policy, identities[0], cost)),)
        return tuple(_new(Check, (policy, identity, cost)) for (policy, cost), identity
                     in zip(self.items, identities, strict=True))

    def call(self, identities: Sequence[str], now_us: int | None = None,
             token: str | None = None, clock_ms: int = 0, op: str = HIT,
             at_ms: int | str | None = None) -> ScriptCall:
        """The script call of `op` (a hit by default) for these identities, one per check;
        `now_us` overrides Redis's clock (tests), `clock_ms` is the app's clock for a
        calendar's schedule, `token` names a sliding log's members (default: a fresh one for
        a hit), `at_ms` is a booking's time (for a settle's give-back, its charge: see
        lua/main.lua's ARGV[4])."""
        # A give-back or a renewal by its hit's token is the hit's call but for its op (and
        # the time its hit was charged): the slots of a response are given back once per
        # request.
        if (op != HIT and (op not in _BY_TOKEN or not token)) or not self.static:
            if self.log and token is None and op == HIT:
                token = new_token()
            return build(op, self.checks(identities), self.prefix, now_us=now_us,
                         at_ms=at_ms, token=token, clock_ms=clock_ms)
        if self.log and token is None:
            token = new_token()
        key = (self, identities if type(identities) is tuple else tuple(identities))
        kept = _kept.get(key)
        if kept is None:
            kept = self._keep(key)
        common, sent = kept
        if now_us is None and not token and op == HIT:  # Redis's clock, no token: all fixed
            return common
        now: Arg = "" if now_us is None else now_us
        at: Arg = "" if at_ms is None else at_ms
        return _new(ScriptCall, (common.keys, (op, now, token or "", at, *self.tail),
                                 common.layout, op, None, self,
                                 b"".join((sent, _OPS[op], _EMPTY if now == "" else bulk(now),
                                           bulk(token) if token else _EMPTY,
                                           _EMPTY if at == "" else bulk(at),
                                           self.tail_bytes))))

    def _keep(self, key: tuple[Compiled, tuple[str, ...]]) -> tuple[ScriptCall, bytes]:
        """The common hit (Redis's clock, no token) of these identities, one per check, its
        EVALSHA whole, and the bytes of that EVALSHA up to its op: kept where every identity
        is short, as their encoding's cache keeps them (bounded likewise)."""
        identities = key[1]
        prefix = self.prefix
        keys: list[str] = []
        for identity, suffixes in zip(identities, self.key_suffixes, strict=True):
            # encode_identity, its cache asked here: the same clients come back.
            encoded = (encode_short(identity) if len(identity) <= CACHED_LENGTH
                       else encode_identity(identity))
            head = f"{prefix}:{{{encoded}}}:"
            keys += [head + suffix for suffix in suffixes]
        sent = b"".join([self.head, *(b"$%d\r\n%s\r\n" % (len(raw), raw)
                                      for raw in (key.encode() for key in keys))])
        layout = tuple(zip(self.policies, identities, strict=True))
        # A hit that names its entries or slots carries a token each time: never sent whole.
        kept = (_new(ScriptCall, (keys, self._hit_args, layout, HIT, None, self,
                                  None if self.log else sent + self.after_key)), sent)
        if all(len(identity) <= CACHED_LENGTH for identity in identities):
            if len(_kept) >= _CALLS_KEPT:
                _kept.clear()
            _kept[key] = kept
        return kept

    def kept(self, identities: tuple[str, ...]) -> tuple[ScriptCall, bytes]:
        """The common hit of these identities and its bytes up to its op (`_keep`)."""
        key = (self, identities)
        found = _kept.get(key)
        return found if found is not None else self._keep(key)

    @staticmethod
    def spans_slots(identities: Sequence[str]) -> bool:
        """Whether the checks belong to several identities: on a cluster, several slots and
        a call each (the limiter's `_across_slots`); else one call decides them all."""
        return len(identities) > 1 and len(set(identities)) > 1


def refunds(parts: Sequence[tuple[Compiled, tuple[str, ...], str, str]],
            now_us: int | None = None) -> ScriptCall | None:
    """The give-backs (R) of several hits in one call, each `(compiled, identities, token,
    charge)`, its charge "<µs>" or "-" (not known): their kept keys and argument bytes put
    together, the call `codec.build` makes of them (tests/test_compiled.py holds the two to
    one another). None where one is not static, or has no token, or two share one: then
    `codec.build`'s."""
    keys: list[str] = []
    tier_args: list[Arg] = []
    layout: list[tuple[Policy, str]] = []
    tokens: list[str] = []
    charges: list[str] = []
    keys_sent: list[bytes] = []
    tiers_sent: list[bytes] = []
    for compiled, identities, token, charge in parts:
        if not compiled.static or not token or " " in token:
            return None
        common, head_and_keys = compiled.kept(identities)
        keys += common.keys
        keys_sent.append(head_and_keys[len(compiled.head):])
        tier_args += compiled.tail[1:]
        tiers_sent.append(compiled.tier_bytes)
        layout += common.layout
        tokens += [token] * len(common.keys)
        charges += [charge] * len(common.keys)
    if len({token for _, _, token, _ in parts}) != len(parts):
        return None
    token = tokens[0] if len(set(tokens)) == 1 else " ".join(tokens)
    at = ((charges[0] if len(set(charges)) == 1 else " ".join(charges))
          if any(each != "-" for each in charges) else "")
    args: list[Arg] = [REFUND, "" if now_us is None else now_us, token, at, len(keys),
                       *tier_args]
    wire = b"".join((b"*%d\r\n" % (3 + len(keys) + len(args)), _EVALSHA, bulk(scripts.sha1()),
                     bulk(len(keys)), *keys_sent, *map(bulk, args[:5]), *tiers_sent))
    return _new(ScriptCall, (keys, args, tuple(layout), REFUND, None, None, wire))
