"""The sans-I/O core: policies and identities in, one script call out; reply in, Decision out.

Nothing here touches a socket or a clock. `Limiter` and `AsyncLimiter` feed it the time
when a test asks for one, hand the call to a backend, and hand the reply back.

Wire format (see lua/main.lua): KEYS are one key per tier (the tiers of a sliding-log policy
share one log) followed by ban keys; ARGV is ``op, now_us, token, at_ms, n`` and seven values
per tier. Replies are integers only.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import secrets
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from ratelimit_mw._errors import ConfigurationError, RateLimitExceeded
from ratelimit_mw._keyenc import identity_head
from ratelimit_mw.decision import Booking, Decision, TierState
from ratelimit_mw.policy import Policy

HIT = "H"
PEEK = "P"
REFUND = "R"
RESET = "X"
BOOK = "B"
CANCEL = "C"

Arg = str | int


@dataclass(frozen=True, slots=True)
class Check:
    """One policy applied to one identity in one call."""

    policy: Policy
    identity: str
    cost: int = 1


class ScriptCall(NamedTuple):
    """What a backend runs: the keys and arguments of lua/main.lua, and how to read the reply.

    A NamedTuple rather than a dataclass: one is built per request, and tuples build fastest.
    """

    keys: list[str]
    args: list[Arg]
    layout: tuple[tuple[Policy, str], ...]  # (policy, identity) per check, tiers in order
    op: str
    booking: Booking | None = None


class _Tokens:
    """Short, process-unique tokens for sliding-log members.

    A random prefix per process (renewed after fork, so pre-forked workers never share one)
    and a counter: far cheaper per call than uuid4, and unique across a fleet.
    """

    def __init__(self) -> None:
        self._renew()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._renew)

    def _renew(self) -> None:
        self._prefix = secrets.token_urlsafe(6)
        self._counter = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}{next(self._counter):x}"


_tokens = _Tokens()


def new_token() -> str:
    """A token unique to one call, for the members it adds to a sliding log."""
    return _tokens.next()


def validate_cost(cost: int) -> None:
    if isinstance(cost, bool) or not isinstance(cost, int) or cost < 1:
        raise ConfigurationError(f"cost must be a whole number >= 1, got {cost!r}; e.g. cost=2")


def _tier_suffixes(policy: Policy) -> tuple[str, ...]:
    if policy.code == "sl":
        # One log serves every tier of the policy: the longest period bounds it.
        return tuple(f"{policy.segment}:log" for _ in policy.rates)
    return tuple(f"{policy.segment}:{rate.period_ms}" for rate in policy.rates)


class _Template:
    """What a policy contributes to every call, computed once: key suffixes and the seven
    arguments of each tier for a given cost (when no penalty or calendar makes them vary)."""

    __slots__ = ("by_cost", "policy", "suffixes")

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.suffixes = _tier_suffixes(policy)
        self.by_cost: dict[int, tuple[Arg, ...]] = {}

    def static_args(self, cost: int) -> tuple[Arg, ...]:
        found = self.by_cost.get(cost)
        if found is None:
            policy = self.policy
            found = tuple(
                arg
                for rate in policy.rates
                for arg in (policy.code, rate.limit, rate.period_ms, cost, 0, "", "")
            )
            if len(self.by_cost) < 64:  # costs are few in practice; never grow unbounded
                self.by_cost[cost] = found
        return found


def _template(policy: Policy) -> _Template:
    # Kept on the policy itself: it lives exactly as long as the policy, so policies built
    # on the fly leave nothing behind.
    found = policy.call_template
    if not isinstance(found, _Template):
        found = _Template(policy)
        policy.call_template = found
    return found


def build(
    op: str,
    checks: Sequence[Check],
    prefix: str,
    *,
    now_us: int | None = None,
    at_ms: int | None = None,
    token: str | None = None,
    clock_ms: int | Callable[[], int] = 0,
) -> ScriptCall:
    """Build the one script call deciding every tier of every check.

    ``clock_ms`` is the app's clock (or a callable reading it, called only when needed),
    used only to choose calendar boundaries for ``tz=`` policies; ``now_us`` overrides
    Redis's clock (tests, never production).
    """
    keys: list[str] = []
    tier_args: list[Arg] = []
    layout: list[tuple[Policy, str]] = []
    ban_keys: list[str] = []
    seen: set[tuple[int, str]] = set()
    uses_log = False
    for check in checks:
        policy = check.policy
        identity = check.identity
        if len(checks) > 1:
            marker = (id(policy), identity)
            if marker in seen:
                # The same policy for the same identity twice (a rule and a default that are
                # one object) must count once, not twice.
                continue
            seen.add(marker)
        template = _template(policy)
        head = identity_head(prefix, identity)
        cost = 1 if op == PEEK else check.cost
        if policy.code == "sl":
            uses_log = True
        keys += [head + suffix for suffix in template.suffixes]
        layout.append((policy, identity))
        if policy.penalty is None and policy.tz is None:
            tier_args += template.static_args(cost)
            continue
        ban_index = 0
        ban_end = ""
        if policy.penalty is not None:
            ban_keys.append(f"{head}{policy.segment}:ban")
            ban_index = -len(ban_keys)  # fixed up once the number of tier keys is known
            if op == HIT:
                ban_end = policy.ban_end()
        if callable(clock_ms):
            clock_ms = clock_ms()
        for tier, rate in enumerate(policy.rates):
            calendar = policy.calendar(tier, clock_ms) if policy.tz is not None else ""
            tier_args += (policy.code, rate.limit, rate.period_ms, cost, ban_index, ban_end,
                          calendar)
    n = len(keys)
    if n == 0:
        raise ConfigurationError("a limiter call needs at least one policy")
    if ban_keys:
        for i in range(4, len(tier_args), 7):
            index = tier_args[i]
            if isinstance(index, int) and index < 0:
                tier_args[i] = n - index  # -k -> position n + k in KEYS (1-based)
        keys += ban_keys
    if token is None:
        token = new_token() if uses_log and op in (HIT, BOOK) else ""
    args: list[Arg] = [
        op,
        "" if now_us is None else now_us,
        token,
        "" if at_ms is None else at_ms,
        n,
    ]
    args += tier_args
    booking = None
    if op == BOOK and at_ms is not None and len(checks) == 1:
        check = checks[0]
        booking = Booking(check.policy, check.identity, token, check.cost, at_ms)
    return ScriptCall(keys, args, tuple(layout), op, booking)


def _seconds(ms: int) -> float:
    return math.inf if ms < 0 else ms / 1000


def decide(call: ScriptCall, reply: Sequence[int]) -> Decision:
    """Read the script's reply into a Decision."""
    allowed = reply[0] == 1
    tiers: list[TierState] = []
    governing: TierState | None = None
    best_wait = -2.0
    best_remaining = math.inf
    best_reset = -1.0
    base = 1
    for policy, identity in call.layout:
        for rate in policy.rates:
            tier_ok = reply[base] == 1
            remaining = reply[base + 1]
            if remaining < 0:
                remaining = 0
            retry = 0.0 if tier_ok else _seconds(reply[base + 2])
            reset = reply[base + 3] / 1000
            state = TierState(policy, rate, identity, tier_ok, remaining, retry, reset,
                              reply[base + 4] == 1)
            tiers.append(state)
            base += 5
            if not allowed:
                if not tier_ok and retry > best_wait:
                    governing, best_wait = state, retry
            elif remaining < best_remaining or (
                remaining == best_remaining and reset > best_reset
            ):
                governing, best_remaining, best_reset = state, remaining, reset
    if governing is None:  # refused with every tier admitting: cannot happen, but never crash
        governing = tiers[0]
    return Decision(
        allowed=allowed,
        limit=governing.rate.limit,
        remaining=governing.remaining,
        retry_after=0.0 if allowed else governing.retry_after,
        reset_after=governing.reset_after,
        policy=governing.policy,
        rate=governing.rate,
        identity=governing.identity,
        banned=governing.banned,
        tiers=tuple(tiers),
        booking=call.booking if allowed else None,
    )


def group_by_slot(checks: Sequence[Check]) -> list[list[Check]]:
    """Checks grouped by identity: on a cluster, each group is one slot and one call."""
    groups: dict[str, list[Check]] = {}
    for check in checks:
        groups.setdefault(check.identity, []).append(check)
    return list(groups.values())


def refund_of(call: ScriptCall) -> ScriptCall:
    """The call that gives back what `call` recorded (same keys, same costs)."""
    args = list(call.args)
    args[0] = REFUND
    return ScriptCall(call.keys, args, call.layout, REFUND)


def merge(decisions: Sequence[Decision]) -> Decision:
    """One Decision from the per-slot decisions of a cluster call, by the governing rule."""
    if len(decisions) == 1:
        return decisions[0]
    tiers = tuple(t for d in decisions for t in d.tiers)
    refused = [d for d in decisions if not d.allowed]
    if refused:
        chosen = max(refused, key=lambda d: d.retry_after)
        allowed = False
    else:
        chosen = min(decisions, key=lambda d: (d.remaining, -d.reset_after))
        allowed = True
    return Decision(
        allowed=allowed,
        limit=chosen.limit,
        remaining=chosen.remaining,
        retry_after=chosen.retry_after,
        reset_after=chosen.reset_after,
        policy=chosen.policy,
        rate=chosen.rate,
        identity=chosen.identity,
        banned=chosen.banned,
        tiers=tiers,
    )


# A plan yields what the shell must do — a ScriptCall to run (it sends back the reply) or a
# float of seconds to sleep — and returns the Decision. The shells hold no logic beyond that.
Plan = Generator["ScriptCall | float", Any, Decision]


class DenyCacheLike(Protocol):
    def lookup(self, checks: Sequence[Check], now: float) -> Decision | None: ...

    def remember(self, checks: Sequence[Check], decision: Decision, now: float) -> None: ...


def plan_hit(calls: Sequence[ScriptCall]) -> Plan:
    """Run the calls in order; if one refuses, give back what the earlier ones admitted.

    One call is the normal case (one atomic script). Several happen only on a Redis Cluster
    when one request is limited under several identities, which live in different slots; the
    compensation keeps "a refused request consumes nothing" as nearly as two slots allow.
    """
    decisions: list[Decision] = []
    for call in calls:
        reply: Sequence[int] = yield call
        decision = decide(call, reply)
        decisions.append(decision)
        if not decision.allowed:
            for earlier in calls[: len(decisions) - 1]:
                yield refund_of(earlier)
            break
    return merge(decisions)


def plan_check(
    checks: Sequence[Check],
    calls: Callable[[], list[ScriptCall]],
    deny: DenyCacheLike | None,
    now: Callable[[], float],
) -> Plan:
    """A hit of several checks: answered from the deny cache when a refusal is in force,
    otherwise by the backend (and a refusal is remembered)."""
    if deny is not None:
        cached = deny.lookup(checks, now())
        if cached is not None:
            return cached
    decision = yield from plan_hit(calls())
    if deny is not None and not decision.allowed:
        deny.remember(checks, decision, now())
    return decision


def acquire_wait(
    decision: Decision, waited: float, timeout: float | None, rng: random.Random
) -> float | None:
    """How long `acquire` sleeps before trying again, or None to give up now.

    The wait is the decision's retry_after plus up to 10% (at most 50 ms) of jitter, so that a
    fleet refused together does not retry in lockstep.
    """
    retry = decision.retry_after
    if retry == math.inf:
        return None
    if timeout is not None and waited + retry > timeout:
        return None
    return retry + rng.uniform(0.0, min(0.05, retry * 0.1 + 0.001))


def plan_acquire(
    hit: Callable[[], Plan],
    now: Callable[[], float],
    timeout: float | None,
    rng: random.Random,
) -> Plan:
    """Hit until admitted, sleeping retry_after (with jitter) between tries."""
    if timeout is not None and (isinstance(timeout, bool) or timeout < 0):
        raise ConfigurationError(f"timeout must be None or >= 0 seconds, got {timeout!r}")
    started = now()
    while True:
        decision = yield from hit()
        if decision.allowed:
            return decision
        wait = acquire_wait(decision, now() - started, timeout, rng)
        if wait is None:
            raise RateLimitExceeded(decision)
        yield wait
