"""A compiled check: what the hit of a set of limits sends, for any identities, built once.

Whatever applies to a request (one policy or several, each with its cost) is compiled once
into a `Compiled`: the limiter's one way to decide a hit, on every backend and transport.
It holds what does not depend on the request:

- the keys' shapes (a head per identity, a suffix per tier) and the argument tail, so that
  a call costs a few concatenations (`call`);
- the call as Redis's wire bytes (RESP): the command header, the script's SHA and the
  argument tail, packed once, so that a request costs its keys' bytes (`packed`);
- how to read the reply (`decide`), and the deny cache's key (`checks`).

A policy whose arguments vary per request (a penalty's end, a calendar's schedule), or a
policy given twice (a default that is also a rule: one count per identity), is compiled
too; its call is then `plans.build`'s, packed as hiredis packs it. Every method
gives exactly what `plans.build` and `plans.decide` give for the same checks
(tests/core/test_compiled.py holds them to it on random selections). Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence

from ratelimit_mw.core import scripts
from ratelimit_mw.core.decision import Decision
from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.core.identity import encode_identity
from ratelimit_mw.core.plans import (
    HIT,
    Check,
    Layout,
    ScriptCall,
    build,
    decode_generic,
    decode_one,
    new_token,
    validate_cost,
)
from ratelimit_mw.core.policy import Policy
from ratelimit_mw.core.wire import Arg, wire

_new = tuple.__new__


def _bulk(value: Arg) -> bytes:
    """One RESP bulk string, as hiredis packs a str or an int argument."""
    raw = value.encode("utf-8") if isinstance(value, str) else str(value).encode("ascii")
    return b"$%d\r\n%s\r\n" % (len(raw), raw)


def pack(call: ScriptCall) -> bytes:
    """The EVALSHA of `call` in Redis's wire format."""
    parts = ("EVALSHA", scripts.sha1(), len(call.keys), *call.keys, *call.args)
    return b"*%d\r\n" % len(parts) + b"".join(map(_bulk, parts))


class Compiled:
    """The hit of `items` ((policy, cost) pairs, in the call's order) under `prefix`."""

    __slots__ = ("_after_key", "_after_token", "_head", "_key_suffixes", "_suffixes", "costs",
                 "items", "log", "policies", "prefix", "rate", "static", "tail")

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
        # A sliding log names each hit's members by a token unique to the call.
        self.log = any(form.code == "sl" for form in forms)
        only = self.policies[0]
        self.rate = only.rates[0] if len(items) == 1 and len(only.rates) == 1 else None
        # Arguments fixed by the costs alone, each policy once: the call is assembled here.
        self.static = (all(form.static for form in forms)
                       and len(set(map(id, self.policies))) == len(items))
        suffixes = [s for form in forms for s in form.suffixes]
        self._key_suffixes = tuple(form.suffixes for form in forms)
        self._suffixes = tuple(tuple(s.encode() for s in form.suffixes) for form in forms)
        args = [arg for form, cost in zip(forms, self.costs, strict=True)
                for arg in (form.static_args(cost) if self.static else ())]
        self.tail: tuple[Arg, ...] = (len(suffixes), *args)
        # RESP: *<count> EVALSHA <sha> <number of keys> <keys...> H <now> <token> "" <tail>
        count = 3 + len(suffixes) + 4 + len(self.tail)
        self._head = (b"*%d\r\n" % count + _bulk("EVALSHA") + _bulk(scripts.sha1())
                      + _bulk(len(suffixes)))
        self._after_token = _bulk("") + b"".join(_bulk(arg) for arg in self.tail)
        # The common request: no token, Redis's clock, so everything after the keys is fixed.
        self._after_key = _bulk(HIT) + _bulk("") + _bulk("") + self._after_token

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
             token: str | None = None, clock_ms: int = 0) -> ScriptCall:
        """The script call; `now_us` overrides Redis's clock (tests), `clock_ms` is the
        app's clock for a calendar's schedule, `token` names a sliding log's members
        (default: a fresh one)."""
        if self.log and token is None:
            token = new_token()
        if not self.static:
            return build(HIT, self.checks(identities), self.prefix, now_us=now_us,
                                 token=token if token is not None else "",
                                 clock_ms=clock_ms)
        prefix = self.prefix
        if len(identities) == 1:  # one check: its identity's head before each suffix
            head = f"{prefix}:{{{encode_identity(identities[0])}}}:"
            suffixes = self._key_suffixes[0]
            keys = [head + suffixes[0]] if len(suffixes) == 1 else [head + s for s in suffixes]
            layout: Layout = ((self.policies[0], identities[0]),)
        else:
            keys = []
            for identity, suffixes in zip(identities, self._key_suffixes, strict=True):
                head = f"{prefix}:{{{encode_identity(identity)}}}:"
                keys += [head + suffix for suffix in suffixes]
            layout = tuple(zip(self.policies, identities, strict=True))
        args: list[Arg] = [HIT, "" if now_us is None else now_us, token or "", "", *self.tail]
        return _new(ScriptCall, (keys, args, layout, HIT, None))

    def packed(self, identities: Sequence[str], now_us: int | None = None,
               token: str | None = None, clock_ms: int = 0) -> bytes:
        """`call(...)` as the EVALSHA in Redis's wire format."""
        if self.log and token is None:
            token = new_token()
        if not self.static:
            return pack(self.call(identities, now_us, token, clock_ms))
        prefix = self.prefix
        parts = [self._head]
        for identity, suffixes in zip(identities, self._suffixes, strict=True):
            head = f"{prefix}:{{{encode_identity(identity)}}}:".encode()
            for suffix in suffixes:
                key = head + suffix
                parts.append(b"$%d\r\n%s\r\n" % (len(key), key))
        if now_us is None and token is None:
            parts.append(self._after_key)
        else:
            parts += (_bulk(HIT), _bulk("" if now_us is None else now_us), _bulk(token or ""),
                      self._after_token)
        return b"".join(parts)

    def layout(self, identities: Sequence[str]) -> Layout:
        """The (policy, identity) of each check in the reply's order: a policy given twice
        for one identity counts once (`plans.build`)."""
        if len(identities) == 1:
            return ((self.policies[0], identities[0]),)
        if self.static:
            return tuple(zip(self.policies, identities, strict=True))
        return tuple(dict.fromkeys(zip(self.policies, identities, strict=True)))

    def decide(self, identities: Sequence[str], reply: list[int]) -> Decision:
        """The reply to `call(identities)` as a Decision, as `plans.decide` reads it."""
        rate = self.rate
        if rate is not None:
            return decode_one(self.policies[0], rate, identities[0], reply[0] == 1, reply,
                              None)
        return decode_generic(self.layout(identities), reply, None)

    @staticmethod
    def spans_slots(identities: Sequence[str]) -> bool:
        """Whether the checks belong to several identities: on a cluster, several slots and
        a call each (`plans.plan_hit`); else one call decides them all."""
        return len(identities) > 1 and len(set(identities)) > 1
