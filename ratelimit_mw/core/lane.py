"""A lane: one (policy, cost) hit with everything but the identity computed once.

The middleware's common request is one check of one policy whose arguments depend on the
cost alone (no penalty, no calendar): `plans.build_static` already builds its call from what
the policy precomputed, but still builds the argument list, and a Redis connection then packs
the whole command again, argument by argument, for every request. A `Lane` keeps what is the
same for every identity:

- the call's keys as a head and suffixes, its argument tail (`call`);
- the call as Redis's wire bytes (RESP): the command header, the script's SHA, the argument
  tail, packed once, so that a request costs one key's bytes and a few concatenations
  (`packed`);
- how to read the reply (`decide`).

Every method gives exactly what the plain path gives for the same check:
``call(identity)`` is ``plans.build(HIT, [Check(policy, identity, cost)], prefix)``,
``packed(identity)`` is that call as ``hiredis.pack_command`` packs it, ``decide(identity,
reply)`` is ``plans.decide(call, reply)`` (tests/test_lane.py holds them to it on random
policies, identities and replies). Pure: no I/O, no clock.
"""

from __future__ import annotations

from ratelimit_mw.core import scripts
from ratelimit_mw.core.decision import Decision
from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.core.identity import encode_identity, identity_head
from ratelimit_mw.core.plans import (
    HIT,
    Check,
    ScriptCall,
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


class Lane:
    """The hit of `cost` on `policy` under the limiter prefix `prefix`, for any identity."""

    __slots__ = ("_after_key", "_after_token", "_head", "_key_tail", "cost",
                 "log", "policy", "prefix", "rate", "suffixes", "tail", "tier", "tiers")

    def __init__(self, policy: Policy, cost: int, prefix: str) -> None:
        validate_cost(cost)
        form = wire(policy)
        if not form.static:
            raise ConfigurationError(
                f"a lane needs a policy whose arguments depend on the cost alone (no penalty, "
                f"no tz=), got {policy!r}; use plans.build for it"
            )
        self.policy = policy
        self.cost = cost
        self.prefix = prefix
        self.rate = policy.rates[0] if len(policy.rates) == 1 else None
        self.suffixes = suffixes = form.suffixes
        self.tail: tuple[Arg, ...] = (len(suffixes), *form.static_args(cost))
        # The tiers' arguments (seven per tier), as the call carries them: what an in-process
        # backend's `hit_tiers` takes with `keys(identity)`, and, for a one-tier lane (`tier`),
        # its `hit_one` with `key(identity)`.
        self.tiers: tuple[Arg, ...] = self.tail[1:]
        self.tier: tuple[Arg, ...] | None = self.tiers if self.rate is not None else None
        # A sliding log names each hit's members by a token unique to the call.
        self.log = form.code == "sl"
        # RESP: *<count> EVALSHA <sha> <number of keys> <keys...> H "" <token> "" <n> <tier args>
        count = 3 + len(suffixes) + 4 + len(self.tail)
        self._head = (b"*%d\r\n" % count + _bulk("EVALSHA") + _bulk(scripts.sha1())
                      + _bulk(len(suffixes)))
        self._key_tail = [s.encode("utf-8") for s in suffixes]
        self._after_token = _bulk("") + b"".join(_bulk(arg) for arg in self.tail)
        # The common request: one key, no token, Redis's clock: three pieces.
        self._after_key = _bulk(HIT) + _bulk("") + _bulk("") + self._after_token

    def __repr__(self) -> str:
        return f"Lane({self.policy!r}, cost={self.cost}, prefix={self.prefix!r})"

    def token(self) -> str | None:
        """A member token for one hit (a sliding log's), None for other algorithms: drawn
        once per request, so that a call sent again is the very same call."""
        return new_token() if self.log else None

    def check(self, identity: str) -> Check:
        """The plain path's Check for this identity (the deny cache's key, refunds)."""
        return _new(Check, (self.policy, identity, self.cost))

    def key(self, identity: str) -> str:
        """The first of the call's keys (a one-tier lane's only one)."""
        return identity_head(self.prefix, identity) + self.suffixes[0]

    def keys(self, identity: str) -> list[str]:
        """The call's keys, one per tier (a sliding log's tiers repeat its key)."""
        head = identity_head(self.prefix, identity)
        return [head + suffix for suffix in self.suffixes]

    def call(self, identity: str, now_us: int | None = None, token: str | None = None
             ) -> ScriptCall:
        """The script call, as `plans.build` builds it: `now_us` overrides Redis's clock
        (tests); a sliding log's members are named by `token` (default: a fresh one)."""
        head = f"{self.prefix}:{{{encode_identity(identity)}}}:"
        suffixes = self.suffixes
        keys = [head + suffixes[0]] if len(suffixes) == 1 else [head + s for s in suffixes]
        if self.log and token is None:
            token = new_token()
        args: list[Arg] = [HIT, "" if now_us is None else now_us, token or "", "", *self.tail]
        return _new(ScriptCall, (keys, args, ((self.policy, identity),), HIT, None))

    def packed(self, identity: str, now_us: int | None = None, token: str | None = None
               ) -> bytes:
        """The EVALSHA of `call(identity, now_us, token)` in Redis's wire format."""
        head = f"{self.prefix}:{{{encode_identity(identity)}}}:".encode()
        key_tail = self._key_tail
        if len(key_tail) == 1 and not self.log and now_us is None:
            key = head + key_tail[0]
            return b"%s$%d\r\n%s\r\n%s" % (self._head, len(key), key, self._after_key)
        parts = [self._head]
        for suffix in key_tail:
            key = head + suffix
            parts.append(b"$%d\r\n%s\r\n" % (len(key), key))
        if self.log and token is None:
            token = new_token()
        parts.append(_bulk(HIT))
        parts.append(_bulk("" if now_us is None else now_us))
        parts.append(_bulk(token or ""))
        parts.append(self._after_token)
        return b"".join(parts)

    def decide(self, identity: str, reply: list[int]) -> Decision:
        """The reply to `call(identity)` as a Decision, as `plans.decide` reads it."""
        rate = self.rate
        if rate is not None:
            return decode_one(self.policy, rate, identity, reply[0] == 1, reply, None)
        return decode_generic(((self.policy, identity),), reply, None)
