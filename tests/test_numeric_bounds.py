"""Every numeric argument of every public operation at its edges (issue 43, item 2).

A table: for each argument, the smallest and the largest value accepted are run against the
real Redis and against the memory backend, which must answer alike; one past each raises the
documented error in the caller, before any I/O, and nothing is stored. The bounds themselves
(docs/guarantees.md, "Numeric bounds"): costs, estimates and settles at most
`Policy.max_cost` (2**52; GCRA 2**51 µs / its emission interval; in flight the slots),
limits at most 15 digits and limit x period below 2**53 ms, penalties at most 2**52 ms, leases
at most 10**9 s, timeouts not NaN (inf: wait as long as it takes).
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable
from typing import Any

import pytest
import redis

import ratelimit_mw as rl
from ratelimit_mw.core.codec import ScriptCall
from ratelimit_mw.core.policy import MAX_LEASE, MAX_PENALTY_MS
from ratelimit_mw.core.rates import GCRA_SPAN_US, MAX_COST, MAX_LIMIT, emission_us

UTC = dt.timezone.utc
POLICIES = {algorithm: rl.Policy("100/2 seconds", algorithm=algorithm, name=f"b-{algorithm}")
            for algorithm in sorted(rl.ALGORITHMS)}
GCRA_MAX = GCRA_SPAN_US // emission_us(rl.Rate(100, 2_000))
SLOTS = rl.Policy.in_flight(3, name="b-slots")
MOST_SLOTS = (2**53 - 1) // 60_000


class Counting(rl.RedisBackend):
    """The real Redis, counting the calls it is sent."""

    calls = 0

    def run(self, call: ScriptCall, deadline: float | None = None) -> list[int]:
        type(self).calls += 1
        return super().run(call, deadline)


class CountingMemory(rl.MemoryBackend):
    calls = 0

    def run(self, call: ScriptCall, deadline: float | None = None) -> list[int]:
        type(self).calls += 1
        return super().run(call, deadline)


def view(found: Any) -> Any:
    """What an operation answered, comparable across backends."""
    if isinstance(found, rl.Decision):
        return (found.allowed, found.remaining, found.retry_after, found.reset_after)
    return found


# -- each operation: given a limiter and a policy it prepares what it needs (a hit to refund, a
# ticket to settle), then returns the step that takes the value under test.
Step = Callable[[Any], Any]


def hit(limiter: rl.Limiter, policy: rl.Policy) -> Step:
    return lambda value: view(limiter.hit(policy, "u", value))


def acquire(limiter: rl.Limiter, policy: rl.Policy) -> Step:
    def step(value: Any) -> Any:
        try:
            return view(limiter.acquire(policy, "u", value, timeout=0))
        except rl.RateLimitExceeded as exc:  # a cost above the limit: never admitted
            return ("refused", view(exc.decision))
    return step


def acquire_timeout(limiter: rl.Limiter, policy: rl.Policy) -> Step:
    return lambda value: view(limiter.acquire(policy, "u", 1, timeout=value))


def refund(limiter: rl.Limiter, policy: rl.Policy) -> Step:
    limiter.hit(policy, "u", 60)

    def step(value: Any) -> Any:
        limiter.refund(policy, "u", value)
        return view(limiter.peek(policy, "u"))
    return step


def reserve(limiter: rl.Limiter, policy: rl.Policy) -> Step:
    at = dt.datetime.fromtimestamp(limiter.clock() + 1, UTC)  # type: ignore[misc]
    return lambda value: view(limiter.reserve(policy, "u", at, value))


def reserve_at(limiter: rl.Limiter, policy: rl.Policy) -> Step:
    return lambda value: view(limiter.reserve(policy, "u", value, 1))


def charge(limiter: rl.Limiter, policy: rl.Policy) -> Step:
    def step(value: Any) -> Any:
        try:
            return view(limiter.charge(policy, "u", value, timeout=0).decision)
        except rl.RateLimitExceeded as exc:
            return ("refused", view(exc.decision))
    return step


def charge_slots(limiter: rl.Limiter, policy: rl.Policy) -> Step:
    def step(value: Any) -> Any:
        ticket = limiter.charge(policy, "u", 1, concurrency=value, timeout=0)
        ticket.settle(1)
        return view(ticket.decision)
    return step


def settle(limiter: rl.Limiter, policy: rl.Policy) -> Step:
    """A settle; refused, the ticket is not counted as settled (it may settle again)."""
    ticket = limiter.charge(policy, "u", 10)

    def step(value: Any) -> Any:
        try:
            ticket.settle(value)
        except rl.ConfigurationError:
            assert ticket.settled is None
            raise
        return view(limiter.peek(policy, "u"))
    return step


def concurrent_slots(limiter: rl.Limiter, policy: rl.Policy) -> Step:
    def step(value: Any) -> Any:
        with limiter.concurrent("b-sem", value, timeout=0) as decision:
            return view(decision)
    return step


def concurrent_lease(limiter: rl.Limiter, policy: rl.Policy) -> Step:
    def step(value: Any) -> Any:
        with limiter.concurrent("b-lease", 1, lease=value, timeout=0) as decision:
            return view(decision)
    return step


def concurrent_timeout(limiter: rl.Limiter, policy: rl.Policy) -> Step:
    def step(value: Any) -> Any:
        with limiter.concurrent("b-wait", 1, timeout=value) as decision:
            return view(decision)
    return step


def penalty(limiter: rl.Limiter, policy: rl.Policy) -> Step:
    def step(value: Any) -> Any:
        banned = rl.Policy("1/minute", algorithm=policy.algorithm, name="b-ban",
                           penalty=value)
        limiter.hit(banned, "u")
        return view(limiter.hit(banned, "u"))
    return step


Operation = Callable[[rl.Limiter, rl.Policy], Step]
# (operation, policy, smallest accepted, largest accepted, one past each (None: no such value:
# the type itself ends there)).
ROWS: list[tuple[str, Operation, rl.Policy, Any, Any, Any, Any]] = []
for algorithm, policy in POLICIES.items():
    most = GCRA_MAX if algorithm == "gcra" else MAX_COST
    assert policy.max_cost == most
    ROWS += [
        (f"hit cost {algorithm}", hit, policy, 1, most, 0, most + 1),
        (f"acquire cost {algorithm}", acquire, policy, 1, most, 0, most + 1),
        (f"refund cost {algorithm}", refund, policy, 1, most, 0, most + 1),
        (f"charge estimate {algorithm}", charge, policy, 1, most, 0, most + 1),
        (f"settle {algorithm}", settle, policy, 0, most, -1, most + 1),
        (f"penalty {algorithm}", penalty, policy, 0.001, MAX_PENALTY_MS / 1000, 0.0009,
         (MAX_PENALTY_MS + 1) / 1000),
    ]
ROWS += [
    ("hit cost in flight", hit, SLOTS, 1, 3, 0, 4),
    ("reserve cost", reserve, POLICIES["sliding-log"], 1, MAX_COST, 0, MAX_COST + 1),
    ("reserve at", reserve_at, POLICIES["sliding-log"], dt.datetime.min.replace(tzinfo=UTC),
     dt.datetime.max.replace(tzinfo=UTC), None, None),
    ("acquire timeout", acquire_timeout, POLICIES["fixed-window"], 0, math.inf, -0.001,
     math.nan),
    # Slots x the default lease (60 s, in ms) below 2**53.
    ("charge concurrency", charge_slots, POLICIES["fixed-window"], 1, MOST_SLOTS, 0,
     MOST_SLOTS + 1),
    ("concurrent slots", concurrent_slots, SLOTS, 1, MOST_SLOTS, 0, MOST_SLOTS + 1),
    ("concurrent lease", concurrent_lease, SLOTS, 0.01, MAX_LEASE, 0.009, MAX_LEASE + 1),
    ("concurrent lease inf", concurrent_lease, SLOTS, 0.01, MAX_LEASE, math.nan, math.inf),
    ("concurrent timeout", concurrent_timeout, SLOTS, 0, math.inf, -0.001, math.nan),
]


@pytest.fixture
def twins(redis_client: redis.Redis, prefix: str, clock: Any) -> tuple[rl.Limiter, rl.Limiter]:
    """The real Redis and the memory backend, on one fake clock, each counting its calls."""
    Counting.calls = CountingMemory.calls = 0
    on_redis = rl.Limiter(Counting(redis_client), prefix=prefix, clock=clock, deny_cache=0,
                          sleep=clock.sleep)
    in_memory = rl.Limiter(CountingMemory(), prefix=prefix, clock=clock, deny_cache=0,
                           sleep=clock.sleep)
    return on_redis, in_memory


@pytest.mark.parametrize(("name", "operation", "policy", "smallest", "largest", "below",
                          "above"), ROWS, ids=[row[0] for row in ROWS])
def test_each_numeric_argument_at_its_edges(
    twins: tuple[rl.Limiter, rl.Limiter], redis_client: redis.Redis, prefix: str,
    name: str, operation: Operation, policy: rl.Policy, smallest: Any, largest: Any,
    below: Any, above: Any,
) -> None:
    on_redis, in_memory = twins
    try:
        for value in (smallest, largest):
            assert (operation(on_redis, policy)(value)
                    == operation(in_memory, policy)(value)), (name, value)
            clear(redis_client, prefix)
            in_memory._backend.close()
        for value in (below, above):
            if value is None:
                continue
            for limiter in twins:
                step = operation(limiter, policy)
                calls = type(limiter._backend).calls  # type: ignore[attr-defined]
                stored = (sorted(redis_client.scan_iter(match=f"{prefix}:*")),
                          len(in_memory._backend))  # type: ignore[arg-type]
                with pytest.raises(rl.ConfigurationError):
                    step(value)
                # Raised in the caller before any I/O; nothing stored changed.
                assert type(limiter._backend).calls == calls, (name, value)  # type: ignore[attr-defined]
                assert (sorted(redis_client.scan_iter(match=f"{prefix}:*")),
                        len(in_memory._backend)) == stored, (name, value)  # type: ignore[arg-type]
    finally:
        clear(redis_client, prefix)


def clear(client: redis.Redis, prefix: str) -> None:
    stale = list(client.scan_iter(match=f"{prefix}:*"))
    if stale:
        client.delete(*stale)


@pytest.mark.parametrize("algorithm", sorted(rl.ALGORITHMS))
@pytest.mark.parametrize("value", [-1, 10**30, 2**63, 2**53 + 1])
def test_a_refused_settle_changes_nothing_and_leaves_the_ticket_unsettled(
    twins: tuple[rl.Limiter, rl.Limiter], algorithm: str, value: int
) -> None:
    policy = POLICIES[algorithm]
    if 0 <= value <= policy.max_cost:
        pytest.skip("accepted for this algorithm")
    for limiter in twins:
        before = view(limiter.peek(policy, "u"))
        step = settle(limiter, policy)
        calls = type(limiter._backend).calls  # type: ignore[attr-defined]
        with pytest.raises(rl.ConfigurationError):
            step(value)
        assert type(limiter._backend).calls == calls  # type: ignore[attr-defined]
        # The estimate stands (10 of 100), as for a ticket never settled.
        assert view(limiter.peek(policy, "u"))[1] == 90 and before[1] == 100
        limiter.reset(policy, "u")


def test_rate_and_policy_bounds() -> None:
    """Rate: a limit of 1 to 15 digits, limit x period below 2**53 ms; GCRA: a tolerance
    (limit x emission interval) of at most 2**51 µs."""
    assert rl.Rate(1, 1) and rl.Rate(MAX_LIMIT, 9)
    for limit, period in ((0, 1), (1, 0), (MAX_LIMIT + 1, 1), (MAX_LIMIT, 10), (1, 2**53)):
        with pytest.raises(rl.ConfigurationError):
            rl.Rate(limit, period)
    longest = GCRA_SPAN_US // 1000
    assert rl.Policy([rl.Rate(1, longest)], algorithm="gcra").max_cost == 1
    with pytest.raises(rl.ConfigurationError):
        rl.Policy([rl.Rate(1, longest + 1)], algorithm="gcra")
    for bad in (math.inf, math.nan, -1.0, "9" * 400, dt.timedelta(days=999_999_999)):
        with pytest.raises(rl.ConfigurationError):
            rl.Policy("1/minute", penalty=bad)
    for lease in (math.inf, math.nan):
        with pytest.raises(rl.ConfigurationError):
            rl.Policy.in_flight(1, lease=lease)
