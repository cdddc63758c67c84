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
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from ratelimit_mw.core.decision import Booking, Decision, TierState
from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.core.identity import identity_head
from ratelimit_mw.core.policy import CONCURRENCY, Policy
from ratelimit_mw.core.wire import Arg, ban_end, wire

# The ops, ARGV[1] of lua/main.lua (which says what each replies).
HIT = "H"  # decide every tier; record the hit only if every tier admits
PEEK = "P"  # decide as a hit would, recording nothing
REFUND = "R"  # give back what a hit recorded (its slots, for an in-flight tier)
RESET = "X"  # forget the identity's counters and bans
BOOK = "B"  # a hit at a time ahead (reserve)
CANCEL = "C"  # take back a booking
RENEW = "N"  # push an in-flight holder's leases on
CHARGE = "F"  # a hit recorded whether or not admitted: what a settled cost overshot
PAUSE = "Z"  # start (or lengthen) the ban of each check's policy, without a refusal

# Algorithms whose calls name their members by a token: a sliding log's entries, an in-flight
# limit's slots (given back, renewed by the same token).
TOKENED = frozenset(("sl", "cc"))


class Check(NamedTuple):
    """One policy applied to one identity in one call (immutable, hashable: the deny cache's
    key; a NamedTuple because the middleware builds one per request)."""

    policy: Policy
    identity: str
    cost: int = 1


# The (policy, identity) of each check of a call, in its reply's order.
Layout = tuple[tuple[Policy, str], ...]

# What one admitted hit gives back: its checks, the hit's token (None: none), and when it was
# charged (µs on the store's clock, `Decision.at_us`; 0: not known), so that each tier gives
# back only within the window it was charged in.
GiveBack = tuple[Sequence[Check], str | None, int]


class ScriptCall(NamedTuple):
    """What a backend runs: the keys and arguments of lua/main.lua, and how to read the reply.

    A NamedTuple rather than a dataclass: one is built per request, and tuples build fastest.
    """

    keys: list[str]
    args: Sequence[Arg]  # never changed in place: a hit's are shared by its calls
    layout: tuple[tuple[Policy, str], ...]  # (policy, identity) per check, tiers in order
    op: str
    booking: Booking | None = None
    compiled: Any = None  # the `Compiled` that built it: its wire bytes are memoised
    wire: bytes | None = None  # its whole EVALSHA, where `Compiled.call` packed it


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
        self.prefix = secrets.token_urlsafe(6)
        self.counter = itertools.count()


_tokens = _Tokens()


def new_token() -> str:
    """A token unique to one call, for the members it adds to a sliding log."""
    return f"{_tokens.prefix}{next(_tokens.counter):x}"


def validate_cost(cost: int, policy: Policy | None = None, what: str = "cost") -> None:
    """A cost (an estimate, a settle) is a whole number >= 1, and, for `policy`, no larger
    than what its store counts exactly (`Policy.max_cost`): raised before any I/O."""
    if isinstance(cost, bool) or not isinstance(cost, int) or cost < 1:
        raise ConfigurationError(f"{what} must be a whole number >= 1, got {cost!r}; "
                                 "e.g. cost=2")
    if policy is not None and cost > policy.max_cost:
        raise ConfigurationError(cost_bound_message(cost, policy, what))


def cost_bound_message(cost: int, policy: Policy, what: str = "cost") -> str:
    """Why `cost` is refused for `policy`: more than it can count (see `Policy.max_cost`)."""
    if policy.algorithm == "concurrency":
        return (f"{what}={cost} takes more slots than {policy.name!r} has "
                f"({policy.max_cost}): it could never be admitted")
    return (f"{what}={cost:,} is more than {policy.name!r} ({policy.algorithm}) counts "
            f"exactly: at most {policy.max_cost:,}; see docs/guarantees.md (numeric bounds)")


# NamedTuples built once per request skip their generated Python __new__ (a Python-level
# call per build): the fields are given in order, exactly as the class declares them.
_new = tuple.__new__


def build(
    op: str,
    checks: Sequence[Check],
    prefix: str,
    *,
    now_us: int | None = None,
    at_ms: int | str | None = None,
    token: str | None = None,
    clock_ms: int | Callable[[], int] = 0,
    tokens: Sequence[str] | None = None,
    charges: Sequence[str] | None = None,
) -> ScriptCall:
    """Build the one script call deciding every tier of every check.

    ``tokens``, one per check, makes a batch of give-backs or renewals (R, N) of several
    hits, each check by its own hit's token: the responses that ended in one turn of the
    event loop give back their slots in one call. ``charges``, one per check beside them,
    says when each give-back's hit was charged ("<µs>", or "-": not known; main.lua's
    ARGV[4]), so that each gives back only within the window it was charged in.

    ``clock_ms`` is the app's clock (or a callable reading it, called only when needed),
    used only to choose which stretch of a ``tz=`` policy's UTC-offset schedule to send
    (core.wire; the script picks the window by Redis's clock); ``now_us`` overrides Redis's
    clock (tests, never production). A hit's call is memoised (`core.compiled`); this
    builds every call, hits included (what the compiled one is held to).
    """
    keys: list[str] = []
    tier_args: list[Arg] = []
    layout: list[tuple[Policy, str]] = []
    ban_keys: list[str] = []
    seen: set[tuple[int, str, str]] = set()
    uses_log = False
    tier_tokens: list[str] = []
    tier_charges: list[str] = []
    if tokens is not None and (op not in (REFUND, RENEW) or len(tokens) != len(checks)
                               or not all(tokens) or any(" " in each for each in tokens)):
        raise ValueError("a batch gives back (or renews) each check by its own hit's token")
    if charges is not None and (tokens is None or op != REFUND
                                or len(charges) != len(checks)):
        raise ValueError("a batch's charges are its give-backs', one per check")
    for position, check in enumerate(checks):
        policy = check.policy
        identity = check.identity
        if len(checks) > 1:
            marker = (id(policy), identity, "" if tokens is None else tokens[position])
            if marker in seen:
                # The same policy for the same identity twice (a rule and a default that are
                # one object) must count once, not twice.
                continue
            seen.add(marker)
        form = wire(policy)
        head = identity_head(prefix, identity)
        cost = 1 if op == PEEK else check.cost
        if form.code in TOKENED:
            uses_log = True
        keys += [head + suffix for suffix in form.suffixes]
        if tokens is not None:
            tier_tokens += [tokens[position]] * len(form.suffixes)
            if charges is not None:
                tier_charges += [charges[position]] * len(form.suffixes)
        layout.append((policy, identity))
        if form.static and op != PAUSE:
            tier_args += form.static_args(cost)
            continue
        ban_index = 0
        ban = ""
        if policy.penalty is not None or op == PAUSE:
            # One KEYS entry per ban key: two policies of one name (and algorithm) share
            # their counters and their ban, so a ban one starts must bind the other in the
            # same reply, as it will in every later one (the deny cache replays that reply).
            ban_key = head + form.ban_suffix
            if ban_key not in ban_keys:
                ban_keys.append(ban_key)
            ban_index = -(ban_keys.index(ban_key) + 1)  # fixed up once the tier keys are known
            if op == HIT:
                ban = ban_end(policy)
        if callable(clock_ms):
            clock_ms = clock_ms()
        tier_args += form.tier_args(cost, ban_index, ban, clock_ms)
    n = len(keys)
    if n == 0:
        raise ConfigurationError("a limiter call needs at least one policy")
    if ban_keys:
        for i in range(4, len(tier_args), 7):
            index = tier_args[i]
            if isinstance(index, int) and index < 0:
                tier_args[i] = n - index  # -k -> position n + k in KEYS (1-based)
        keys += ban_keys
    if tokens is not None:  # main.lua's batch: each tier's token (one, if all are one)
        token = tokens[0] if len(set(tokens)) == 1 else " ".join(tier_tokens)
        if charges is not None and any(each != "-" for each in charges):
            at_ms = charges[0] if len(set(charges)) == 1 else " ".join(tier_charges)
    elif token is None:
        token = new_token() if uses_log and op in (HIT, BOOK, CHARGE) else ""
    args: list[Arg] = [
        op,
        "" if now_us is None else now_us,
        token,
        "" if at_ms is None else at_ms,
        n,
    ]
    args += tier_args
    booking = None
    if op == BOOK and isinstance(at_ms, int) and len(checks) == 1:
        check = checks[0]
        booking = Booking(check.policy, check.identity, token, check.cost, at_ms)
    return ScriptCall(keys, args, tuple(layout), op, booking)


def _seconds(ms: int) -> float:
    return math.inf if ms < 0 else ms / 1000


def decoded(call: ScriptCall, reply: Sequence[int]) -> Decision:
    """Read the script's reply into a Decision. (The common reply, one tier, which governs,
    is read here: every request's decision takes this way.)"""
    layout = call.layout
    if len(layout) == 1:
        policy, identity = layout[0]
        rates = policy.rates
        if len(rates) == 1:
            allowed = reply[0] == 1
            rate = rates[0]
            remaining = reply[2]
            if remaining < 0:
                remaining = 0
            tier_ok = reply[1] == 1
            retry = 0.0 if tier_ok else _seconds(reply[3])
            reset = reply[4] / 1000
            banned = reply[5] == 1
            state = _new(TierState, (policy, rate, identity, tier_ok, remaining, retry, reset,
                                     banned))
            return _new(Decision, (allowed, rate.limit, remaining, 0.0 if allowed else retry,
                                   reset, policy, rate, identity, banned, (state,),
                                   call.booking if allowed else None,
                                   reply[6] if allowed and len(reply) > 6 else 0))
    compiled = call.compiled
    if compiled is not None and compiled.slotted and reply[0] == 1:
        # A rate and then an in-flight limit, admitted (every tier admits): the rate governs.
        (policy, identity), (held, holder) = layout
        rate, slots = policy.rates[0], held.rates[0]
        remaining, free = reply[2], reply[7]
        if remaining < 0:
            remaining = 0
        if free < 0:
            free = 0
        reset, banned = reply[4] / 1000, reply[5] == 1
        return _new(Decision, (True, rate.limit, remaining, 0.0, reset, policy, rate, identity,
                               banned, (_new(TierState, (policy, rate, identity, True, remaining,
                                                         0.0, reset, banned)),
                                        _new(TierState, (held, slots, holder, True, free, 0.0,
                                                         reply[9] / 1000, reply[10] == 1))),
                               call.booking, reply[11] if len(reply) > 11 else 0))
    return decode_generic(layout, reply, call.booking,
                          None if compiled is None else compiled.governs)


def decode_generic(
    layout: tuple[tuple[Policy, str], ...], reply: Sequence[int], booking: Booking | None,
    fixed: int | None = None
) -> Decision:
    """Read any reply: every tier's state, and the governing one's numbers on top (`fixed`:
    the admitted tier `governing_tier` found for the layout)."""
    allowed = reply[0] == 1
    tiers: list[TierState] = []
    base = 1
    for policy, identity in layout:
        for rate in policy.rates:
            tier_ok = reply[base] == 1
            remaining = reply[base + 1]
            if remaining < 0:
                remaining = 0
            retry = 0.0 if tier_ok else _seconds(reply[base + 2])
            tiers.append(_new(TierState, (policy, rate, identity, tier_ok, remaining, retry,
                                          reply[base + 3] / 1000, reply[base + 4] == 1)))
            base += 5
    # An admitted reply ends with the store's clock (lua/main.lua).
    if allowed:
        return admitted_decision(tiers, reply[base] if len(reply) > base else 0, booking,
                                 fixed)
    governing: TierState | None = None
    best_wait = -2.0
    for state in tiers:
        if not state.allowed and state.retry_after > best_wait:
            governing, best_wait = state, state.retry_after
    if governing is None:  # refused with every tier admitting: cannot happen, but never crash
        governing = tiers[0]
    return _new(Decision, (False, governing.rate.limit, governing.remaining,
                           governing.retry_after, governing.reset_after, governing.policy,
                           governing.rate, governing.identity, governing.banned, tuple(tiers),
                           None, 0))


def governing_tier(algorithms: Sequence[str]) -> int | None:
    """Which tier governs every admitted decision of tiers of these algorithms, where their
    layout alone decides it (`admitted_decision`'s order: one tier, or one rate among slots
    in flight); None where the remaining counts decide."""
    rates = [i for i, algorithm in enumerate(algorithms) if algorithm != CONCURRENCY]
    if len(algorithms) == 1 or len(rates) == 1:
        return rates[0] if rates else 0
    return None


def admitted_decision(tiers: Sequence[TierState], at_us: int,
                      booking: Booking | None = None, fixed: int | None = None) -> Decision:
    """The Decision of an admitted call from its tiers' states: a rate's tier before slots
    in flight, then the one with the least remaining, the later reset on a tie (`fixed`:
    the tier `governing_tier` found)."""
    governing = tiers[0 if fixed is None else fixed]
    if fixed is None and len(tiers) > 1:
        # Ranked by (slots?, remaining, -reset), first on a tie, compared without a tuple.
        slots = governing.policy.algorithm == CONCURRENCY
        least, latest = governing.remaining, governing.reset_after
        for state in tiers:
            held = state.policy.algorithm == CONCURRENCY
            if held == slots:
                left = state.remaining
                if left > least or (left == least and state.reset_after <= latest):
                    continue
            elif held:
                continue
            governing, slots, least, latest = state, held, state.remaining, state.reset_after
    return _new(Decision, (True, governing.rate.limit, governing.remaining, 0.0,
                           governing.reset_after, governing.policy, governing.rate,
                           governing.identity, governing.banned, tuple(tiers), booking, at_us))


# A refused hit's reply carries, after the five values of each of its n tiers, three more per
# tier (lua/main.lua): how long, in µs from the store's now, every number of the reply stays as
# it is or counts down (0: never reuse; -1: until a write), and the exact µs of retry and reset.
_EXTRA = 3


def replay_window(reply: Sequence[int]) -> int | None:
    """For how many µs after the store decided it a refused hit's reply can be replayed
    exactly (see `replay`), or None: not at all. A reply without the stability values (a
    backend that does not report them) is never replayed."""
    if reply[0] != 0:
        return None
    n, rest = divmod(len(reply) - 1, 5 + _EXTRA)
    if rest or n == 0:
        return None
    window: int | None = None
    extra = 1 + 5 * n
    for i in range(n):
        stable, retry = reply[extra + _EXTRA * i], reply[extra + _EXTRA * i + 1]
        if stable == 0:
            return None
        if stable > 0 and (window is None or stable < window):
            window = stable
        # A refusing tier's retry is when the hit may be admitted: the answer changes there.
        if reply[1 + 5 * i] == 0 and retry > 0 and (window is None or retry < window):
            window = retry
    return -1 if window is None else window


def replay(
    layout: tuple[tuple[Policy, str], ...], reply: Sequence[int], elapsed_us: int
) -> tuple[Decision, int]:
    """The Decision the store would give for the same hit `elapsed_us` after it gave `reply`,
    nothing having been written since, and until which elapsed µs that Decision stays the
    same. While `replay_window` lasts, every number holds except retry and reset, which count
    down with the same rounding up to ms as the store's."""
    n = (len(reply) - 1) // (5 + _EXTRA)
    now = list(reply[: 1 + 5 * n])
    extra = 1 + 5 * n
    same_until = 1 << 62
    for i in range(n):
        for slot in (1, 2):  # retry, reset
            exact = reply[extra + _EXTRA * i + slot]
            if exact > 0:
                ms = -((elapsed_us - exact) // 1000)  # ceil((exact - elapsed) / 1000)
                if ms < 0:
                    ms = 0
                now[2 + slot + 5 * i] = ms
                # It stays `ms` while exact - elapsed > 1000 * (ms - 1).
                changes = exact - 1000 * (ms - 1)
                if changes < same_until:
                    same_until = changes
    return decoded(_new(ScriptCall, ([], [], layout, HIT, None, None, None)), now), same_until


def group_by_slot(checks: Sequence[Check]) -> list[list[Check]]:
    """Checks grouped by identity: on a cluster, each group is one slot and one call."""
    groups: dict[str, list[Check]] = {}
    for check in checks:
        groups.setdefault(check.identity, []).append(check)
    return list(groups.values())


def refund_of(call: ScriptCall) -> ScriptCall:
    """The call that gives back what `call` recorded (same keys, same costs, same token)."""
    return _as(call, REFUND)


def peek_of(call: ScriptCall) -> ScriptCall:
    """`call` as a peek: the same keys, tiers and costs, answered without recording."""
    return _as(call, PEEK)


def _as(call: ScriptCall, op: str) -> ScriptCall:
    args = list(call.args)
    args[0] = op
    return ScriptCall(call.keys, args, call.layout, op)


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
        at_us=chosen.at_us,
    )


def acquire_wait(
    decision: Decision, waited: float, timeout: float | None, rng: random.Random,
    cap: float | None = None, wait_out: bool = False,
) -> float | None:
    """How long `acquire` sleeps before trying again, or None to give up now.

    The wait is the decision's retry_after plus up to 10% (at most 50 ms) of jitter, so that a
    fleet refused together does not retry in lockstep; the jitter never carries the wait past
    the timeout (the retry is admitted by then, and the caller was promised an answer).
    `cap`: the longest wait, for a refusal that may lift sooner than it says. `wait_out`: a
    wait past the timeout sleeps what is left of it instead (then one more try), so that a
    caller given a bound waits that long rather than giving up at once.
    """
    retry = decision.retry_after
    if retry == math.inf:
        return None
    if cap is not None and retry > cap:  # asked again sooner than the refusal says
        retry = cap
    if timeout is not None and waited + retry > timeout:
        left = timeout - waited
        return left if wait_out and left > 0.001 else None
    jitter = rng.uniform(0.0, min(0.05, retry * 0.1 + 0.001))
    if timeout is not None:
        jitter = min(jitter, timeout - waited - retry)
    return retry + jitter


# acquire rides out a backend outage within its timeout: the first retry after ~10 ms, each
# next one twice as late, at most a second apart (a restart takes seconds; hammering a store
# that is down helps nobody), each wait drawn from its upper half so a fleet spreads out.
BACKOFF_FIRST = 0.01
BACKOFF_CAP = 1.0


def backoff_wait(failures: int, left: float | None, rng: random.Random) -> float | None:
    """How long `acquire` sleeps after `failures` backend errors in a row, or None to give up
    (no timeout given, or none of it left); never past the deadline."""
    if left is None or left <= 0:
        return None
    delay = min(BACKOFF_CAP, BACKOFF_FIRST * 2.0 ** min(failures - 1, 30))
    return min(delay * rng.uniform(0.5, 1.0), left)
