"""The local deny cache never changes a decision: it replays the store's exact answer.

Every answer it gives must be the Decision the store would give at that moment (the same
numbers, the same governing tier, the same tiers). The tests hold it to that on a controlled
clock: reproductions of the defects it had (a refusal reused for another cost, stale
`remaining`, a `retry_after` of 0.0, resets elsewhere ignored), and a hypothesis test driving
random sequences through a limiter with the cache and one without, on the memory backend and
on the real Redis.
"""

from __future__ import annotations

import math
import tracemalloc
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ratelimit_mw as rl
from ratelimit_mw.core import codec
from ratelimit_mw.core.codec import Check, Layout
from ratelimit_mw.core.deny_cache import DenyCache
from tests.conftest import FakeClock, StepClock
from tests.test_differential import run_extending

ALGORITHMS = sorted(rl.ALGORITHMS)


class CountingBackend:
    """A MemoryBackend that counts the calls that reach it."""

    is_cluster = False

    def __init__(self, inner: Any = None) -> None:
        self.inner = inner or rl.MemoryBackend()
        self.calls = 0

    def run(self, call: Any, deadline: float | None = None) -> list[int]:
        self.calls += 1
        return self.inner.run(call)  # type: ignore[no-any-return]

    async def arun(self, call: Any, deadline: float | None = None) -> list[int]:
        self.calls += 1
        return self.inner.run(call)  # type: ignore[no-any-return]


class FrozenTtlRedis:
    """The real Redis under a test clock: each call runs with a second script that pushes the
    TTLs it set ten minutes out (as tests/test_differential.py), so keys never vanish by
    Redis's own clock while the test clock stands still."""

    is_cluster = False

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def run(self, call: codec.ScriptCall, deadline: float | None = None) -> list[int]:
        return run_extending(self.client, call)


@pytest.fixture
def counting() -> CountingBackend:
    return CountingBackend()


def make(counting: CountingBackend, clock: Any, **kwargs: Any) -> rl.Limiter:
    return rl.Limiter(counting, prefix="dc", clock=clock, **kwargs)  # type: ignore[arg-type]


class Pair:
    """A limiter with the deny cache and one without, on twin backends and one clock."""

    def __init__(self, clock: StepClock, cached_backend: Any = None, plain_backend: Any = None,
                 **kwargs: Any) -> None:
        self.clock = clock
        self.counting = CountingBackend(cached_backend)
        self.cached = rl.Limiter(self.counting, prefix="c" + uuid.uuid4().hex[:10],  # type: ignore[arg-type]
                                 clock=clock, **kwargs)
        self.plain = rl.Limiter(plain_backend or rl.MemoryBackend(),
                                prefix="p" + uuid.uuid4().hex[:10], clock=clock, deny_cache=0)

    def hit(self, policy: rl.Policy, identity: str, cost: int = 1) -> rl.Decision:
        return self.check([Check(policy, identity, cost)])

    def check(self, checks: list[Check]) -> rl.Decision:
        mine = self.cached.check(checks)
        store = self.plain.check(checks)
        assert mine == store, (mine, store)
        assert mine.tiers == store.tiers
        return mine

    def do(self, method: str, *args: Any) -> None:
        getattr(self.cached, method)(*args)
        getattr(self.plain, method)(*args)


# -- the guarantees it keeps ---------------------------------------------------------------
def test_a_flood_within_the_age_bound_costs_no_backend_call(
    counting: CountingBackend, clock: FakeClock
) -> None:
    limiter = make(counting, clock)
    policy = rl.Policy("3/minute", algorithm="fixed-window")
    results = [limiter.hit(policy, "ip:1").allowed for _ in range(1000)]
    assert results[:3] == [True, True, True] and not any(results[3:])
    assert counting.calls == 4


def test_the_store_is_asked_again_once_the_age_bound_passes(
    counting: CountingBackend, step_clock: StepClock
) -> None:
    limiter = make(counting, step_clock, deny_cache_max_age=0.5)
    policy = rl.Policy("1/minute", algorithm="gcra")
    limiter.hit(policy, "ip:1")
    first = limiter.hit(policy, "ip:1")
    step_clock.advance_ms(499)
    cached = limiter.hit(policy, "ip:1")
    assert counting.calls == 2
    assert cached.retry_after == pytest.approx(first.retry_after - 0.499, abs=1e-9)
    step_clock.advance_ms(1)
    limiter.hit(policy, "ip:1")
    assert counting.calls == 3


def test_the_store_is_asked_again_once_the_wait_is_over(
    counting: CountingBackend, step_clock: StepClock
) -> None:
    limiter = make(counting, step_clock)
    policy = rl.Policy("1/second", algorithm="gcra")
    limiter.hit(policy, "ip:1")
    refused = limiter.hit(policy, "ip:1")
    step_clock.advance(refused.retry_after)
    assert limiter.hit(policy, "ip:1").allowed
    assert counting.calls == 3


@pytest.mark.parametrize("undo", ["reset", "refund", "peek"])
def test_reset_refund_and_peek_through_the_limiter_forget_the_refusal(
    counting: CountingBackend, clock: FakeClock, undo: str
) -> None:
    limiter = make(counting, clock)
    policy = rl.Policy("1/minute")
    limiter.hit(policy, "ip:1")
    assert not limiter.hit(policy, "ip:1").allowed
    calls = counting.calls
    getattr(limiter, undo)(policy, "ip:1")
    decision = limiter.hit(policy, "ip:1")
    assert counting.calls == calls + 2  # the undo, then the hit: the store was asked
    assert decision.allowed == (undo != "peek")


def test_a_cancelled_booking_forgets_the_refusal(step_clock: StepClock) -> None:
    import datetime as dt

    pair = Pair(step_clock)
    policy = rl.Policy("1/minute", algorithm="sliding-log")
    at = dt.datetime.fromtimestamp(step_clock() + 10, dt.timezone.utc)
    booked = pair.cached.reserve(policy, "u", at)
    plain = pair.plain.reserve(policy, "u", at)
    assert booked.booking is not None and plain.booking is not None
    assert not pair.hit(policy, "u").allowed
    pair.cached.cancel(booked.booking)
    pair.plain.cancel(plain.booking)
    assert pair.hit(policy, "u").allowed


def test_other_identities_are_not_affected(counting: CountingBackend, clock: FakeClock) -> None:
    limiter = make(counting, clock)
    policy = rl.Policy("1/minute")
    limiter.hit(policy, "ip:1")
    limiter.hit(policy, "ip:1")
    assert limiter.hit(policy, "ip:2").allowed


def test_deny_cache_zero_turns_it_off(counting: CountingBackend, clock: FakeClock) -> None:
    limiter = make(counting, clock, deny_cache=0)
    policy = rl.Policy("1/minute")
    for _ in range(5):
        limiter.hit(policy, "ip:1")
    assert counting.calls == 5


@pytest.mark.parametrize("bad", [-1, 1.5, True, "10"])
def test_a_bad_size_is_a_configuration_error(bad: object) -> None:
    with pytest.raises(rl.ConfigurationError, match="deny_cache"):
        rl.Limiter(deny_cache=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -1, 3601, "1", True, math.nan])
def test_a_bad_age_bound_is_a_configuration_error(bad: object) -> None:
    with pytest.raises(rl.ConfigurationError, match="deny_cache_max_age"):
        rl.Limiter(deny_cache_max_age=bad)  # type: ignore[arg-type]
    with pytest.raises(rl.ConfigurationError, match="deny_cache_max_age"):
        rl.AsyncLimiter(deny_cache_max_age=bad)  # type: ignore[arg-type]


def _refused(limiter: rl.Limiter, policy: rl.Policy, identity: str,
             clock: StepClock) -> tuple[Layout, list[int], int]:
    limiter.hit(policy, identity)
    call = codec.build(codec.HIT, [Check(policy, identity)], "dc", now_us=clock.us)
    return call.layout, limiter.backend.run(call), clock.us


def test_the_cache_is_bounded_in_entries_and_drops_expired_ones_first(
    step_clock: StepClock,
) -> None:
    cache = DenyCache(size=3)
    policy = rl.Policy("1/minute", algorithm="fixed-window")
    limiter = rl.Limiter(prefix="dc", clock=step_clock, deny_cache=0)
    for i in range(5):
        checks = [Check(policy, f"ip:{i}")]
        cache.record(checks, *_refused(limiter, policy, f"ip:{i}", step_clock))
    assert len(cache) == 3
    assert cache.find([Check(policy, "ip:0")], step_clock.us) is None
    assert type(cache.find([Check(policy, "ip:4")], step_clock.us)) is rl.Decision


def test_the_cache_is_bounded_in_bytes_whatever_the_identities(step_clock: StepClock) -> None:
    cache = DenyCache(size=1_000_000, max_bytes=1_000_000)
    policy = rl.Policy("1/minute", algorithm="gcra")
    limiter = rl.Limiter(prefix="dc", clock=step_clock, deny_cache=0)
    for i in range(400):
        identity = f"{i:06d}" + "x" * 8_000
        cache.record([Check(policy, identity)], *_refused(limiter, policy, identity, step_clock))
        assert cache.bytes <= 1_000_000
    assert 0 < len(cache) < 125


def test_a_long_identity_flood_keeps_traced_memory_under_50_mb() -> None:
    """65,536 distinct 8 KB identities (a header a client controls), each refused, through a
    limiter with the deny cache in front of the memory backend (counted: a store the limiter
    calls, as Redis): neither the key-encoding cache nor the deny cache may keep their text
    (before: ~600 MB)."""
    clock = StepClock()
    limiter = rl.Limiter(CountingBackend(rl.MemoryBackend()), clock=clock)  # type: ignore[arg-type]
    policy = rl.Policy("1/second", algorithm="gcra")
    tracemalloc.start()
    try:
        for i in range(65_536):
            identity = f"{i:08d}" + "x" * 8_184
            limiter.hit(policy, identity)
            assert not limiter.hit(policy, identity).allowed
            clock.advance_ms(20)  # the backend's own keys expire as the flood goes on
        current, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert limiter._deny is not None and len(limiter._deny) > 0
    assert current < 50 * 1024 * 1024, f"{current / 1e6:.1f} MB traced"


async def test_the_async_limiter_uses_the_cache_too(
    counting: CountingBackend, clock: FakeClock
) -> None:
    limiter = rl.AsyncLimiter(counting, prefix="dc", clock=clock)  # type: ignore[arg-type]
    policy = rl.Policy("2/minute", algorithm="gcra")
    decisions = [await limiter.hit(policy, "ip:1") for _ in range(50)]
    assert sum(d.allowed for d in decisions) == 2
    assert counting.calls == 3


# -- regressions: each failed before the cache replayed the store's answer ---------------------
def test_a_refusal_is_not_reused_for_a_larger_cost(step_clock: StepClock) -> None:
    pair = Pair(step_clock)
    policy = rl.Policy("4/minute", algorithm="gcra")
    pair.hit(policy, "u", 4)
    step_clock.advance(10)
    assert pair.hit(policy, "u", 1).retry_after == 5.0
    # The old cache answered 5.0 (the cost-1 refusal's): the store says 50.0.
    assert pair.hit(policy, "u", 4).retry_after == 50.0


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_larger_cost_after_a_refusal_gets_the_stores_wait(
    step_clock: StepClock, algorithm: str
) -> None:
    pair = Pair(step_clock)
    policy = rl.Policy("4/minute", algorithm=algorithm)
    for _ in range(4):
        pair.hit(policy, "u")
        step_clock.advance(5)
    pair.hit(policy, "u", 1)
    step_clock.advance(1)
    pair.hit(policy, "u", 3)


def test_remaining_is_not_stale_after_a_smaller_hit_is_admitted(step_clock: StepClock) -> None:
    pair = Pair(step_clock)
    policy = rl.Policy("4/minute", algorithm="fixed-window")
    step_clock.set_ms(1_800_000_000_000 - 1_800_000_000_000 % 60_000)
    pair.hit(policy, "u", 1)
    assert pair.hit(policy, "u", 4).remaining == 3
    pair.hit(policy, "u", 3)
    assert pair.hit(policy, "u", 4).remaining == 0  # the old cache said 3


def test_a_refusal_is_never_served_with_retry_after_zero(step_clock: StepClock) -> None:
    pair = Pair(step_clock)
    policy = rl.Policy("1/second", algorithm="gcra")
    pair.hit(policy, "u")
    step_clock.advance(0.0004)
    assert not pair.hit(policy, "u").allowed
    step_clock.advance(1.0001 - 0.0004)
    assert pair.hit(policy, "u").allowed  # the old cache refused it with retry_after 0.0


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_remaining_grows_while_a_refusal_is_held(step_clock: StepClock, algorithm: str) -> None:
    """Numbers change not only by counting down: sliding-log entries leave the window, GCRA
    drains, a sliding window's previous count fades. Every answer matches the store's."""
    pair = Pair(step_clock, deny_cache_max_age=3600)
    policy = rl.Policy("5/10 seconds", algorithm=algorithm)
    for _ in range(5):
        pair.hit(policy, "u")
        step_clock.advance_ms(1_300)
    for _ in range(400):
        pair.hit(policy, "u", 5)
        step_clock.advance(0.0371)


def test_a_reset_elsewhere_takes_effect_within_the_age_bound(step_clock: StepClock) -> None:
    backend = rl.MemoryBackend()
    worker = rl.Limiter(backend, clock=step_clock, deny_cache_max_age=0.25)
    operator = rl.Limiter(backend, clock=step_clock)
    policy = rl.Policy("1/hour", penalty="1 hour")
    worker.hit(policy, "u")
    assert worker.hit(policy, "u").banned
    operator.reset(policy, "u")  # the unban, in another process
    step_clock.advance_ms(249)
    assert not worker.hit(policy, "u").allowed  # still within the bound: the cached ban
    step_clock.advance_ms(1)
    assert worker.hit(policy, "u").allowed


@pytest.mark.parametrize("cached", [True, False])
def test_a_store_in_this_process_decides_every_hit_with_no_cache_before_it(
        step_clock: StepClock, cached: bool) -> None:
    # The memory store's own refusal costs less than the cache's lookup: a reset made by
    # another limiter is seen by the very next hit, and nothing is kept (a breaker's probe,
    # cached=False, alike).
    backend = rl.MemoryBackend()
    worker = rl.Limiter(backend, clock=step_clock)
    operator = rl.Limiter(backend, clock=step_clock, deny_cache=0)
    policy = rl.Policy("1/hour")
    compiled = worker.compile([(policy, 1)])
    assert worker.hit_compiled(compiled, ("u",), cached=cached).allowed
    assert not worker.hit_compiled(compiled, ("u",), cached=cached).allowed
    operator.reset(policy, "u")
    assert worker.hit_compiled(compiled, ("u",), cached=cached).allowed
    assert worker._deny is not None and len(worker._deny) == 0


def test_a_penalty_refusal_that_started_no_ban_is_not_cached(
    counting: CountingBackend, step_clock: StepClock
) -> None:
    import datetime as dt

    ends = [dt.datetime.fromtimestamp(step_clock() - 1, dt.timezone.utc)]
    policy = rl.Policy("1/hour", penalty=lambda: ends[0])
    limiter = make(counting, step_clock)
    limiter.hit(policy, "u")
    assert not limiter.hit(policy, "u").banned  # the end is past: no ban
    ends[0] = dt.datetime.fromtimestamp(step_clock() + 60, dt.timezone.utc)
    assert limiter.hit(policy, "u").banned  # asked the store, which starts the ban now
    assert counting.calls == 3


def test_a_reset_through_another_policy_object_of_the_same_name_forgets_the_refusal(
    step_clock: StepClock,
) -> None:
    pair = Pair(step_clock)
    one = rl.Policy("1/second", algorithm="fixed-window", name="api")
    same = rl.Policy("1/second", algorithm="fixed-window", name="api")  # shares the counters
    pair.hit(one, "u")
    assert not pair.hit(same, "u").allowed
    pair.do("reset", one, "u")
    assert pair.hit(same, "u").allowed


def test_several_policies_in_one_call_are_replayed_whole(step_clock: StepClock) -> None:
    pair = Pair(step_clock)
    narrow = rl.Policy("2/minute", algorithm="gcra", name="narrow")
    wide = rl.Policy("3/10 seconds;100/hour", algorithm="sliding-window", name="wide")
    checks = [Check(wide, "all"), Check(narrow, "u")]
    for _ in range(40):
        pair.check(checks)
        step_clock.advance(0.0173)
    pair.check([Check(wide, "all")])  # another combination writes to `wide`
    for _ in range(10):
        pair.check(checks)
        step_clock.advance(0.0173)
    assert pair.counting.calls < 40


# -- the differential test: with the cache and without, identical decisions --------------------
PERIODS = [1_000, 2_000, 5_000, 60_000]
IDENTITIES = ["a", "b"]


@dataclass(frozen=True)
class Op:
    advance_us: int
    kind: str
    policy: int
    identity: int
    cost: int


@st.composite
def policies(draw: st.DrawFn) -> rl.Policy:
    algorithm = draw(st.sampled_from(ALGORITHMS))
    periods = draw(st.lists(st.sampled_from(PERIODS), min_size=1, max_size=3, unique=True))
    rates = [rl.Rate(draw(st.integers(1, 5)), period) for period in periods]
    # Penalties shorter than most windows' waits (0.25, 1, 3.5 s: the reply's retry is then the
    # window's own) and longer than every period (90 s: the ban's).
    penalty = draw(st.sampled_from([None, None, None, 0.25, 1, 3.5, 90]))
    return rl.Policy(rates, algorithm=algorithm, penalty=penalty,
                     name=f"p{draw(st.integers(0, 10**6))}")


ops = st.builds(
    Op,
    advance_us=st.sampled_from([0, 0, 0, 1, 399, 1_000, 1_001, 7_250, 250_000, 999_999,
                                1_000_000, 2_500_000, 61_000_000]),
    kind=st.sampled_from(["hit"] * 8 + ["both", "both", "peek", "reset", "refund"]),
    policy=st.integers(0, 1),
    identity=st.integers(0, 1),
    cost=st.sampled_from([1, 1, 1, 2, 3, 6]),
)


def _play(pair: Pair, pool: list[rl.Policy], sequence: list[Op]) -> None:
    for op in sequence:
        pair.clock.us += op.advance_us
        policy, identity = pool[op.policy % len(pool)], IDENTITIES[op.identity]
        if op.kind == "hit":
            pair.hit(policy, identity, op.cost)
        elif op.kind == "both":
            pair.check([Check(pool[0], identity, op.cost), Check(pool[-1], "shared", 1)])
        elif op.kind == "peek":
            assert pair.cached.peek(policy, identity) == pair.plain.peek(policy, identity)
        else:
            args = (policy, identity) if op.kind == "reset" else (policy, identity, op.cost)
            pair.do(op.kind, *args)


_HEALTH = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]


@settings(max_examples=300, deadline=None, suppress_health_check=_HEALTH)
@given(pool=st.lists(policies(), min_size=1, max_size=2),
       sequence=st.lists(ops, min_size=1, max_size=60))
def test_with_and_without_the_cache_every_decision_is_identical_in_memory(
    pool: list[rl.Policy], sequence: list[Op]
) -> None:
    _play(Pair(StepClock(), deny_cache_max_age=3600), pool, sequence)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=_HEALTH)
@given(pool=st.lists(policies(), min_size=1, max_size=2),
       sequence=st.lists(ops, min_size=1, max_size=40))
def test_with_and_without_the_cache_every_decision_is_identical_on_redis(
    redis_client: redis.Redis, pool: list[rl.Policy], sequence: list[Op]
) -> None:
    backend = FrozenTtlRedis(redis_client)
    pair = Pair(StepClock(), backend, backend, deny_cache_max_age=3600)
    try:
        _play(pair, pool, sequence)
    finally:
        for prefix in (pair.cached.prefix, pair.plain.prefix):
            keys = list(redis_client.scan_iter(match=f"{prefix}:*", count=1000))
            if keys:
                redis_client.delete(*keys)


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_a_ban_started_by_one_policy_binds_its_namesake_in_the_same_reply(
    store: str, redis_client: redis.Redis, prefix: str
) -> None:
    """Two policy objects of one name share counters and ban. A call whose first check
    starts the ban must report the second one banned too: that is what the store answers
    from then on, and the reply is what the deny cache replays (found by
    test_coalesced_refresh's differential test: the cache had replayed the second check as
    admitted)."""
    pair = [rl.Policy("1/second", algorithm="sliding-log", name="twin", penalty=1)
            for _ in range(2)]
    checks = [Check(pair[0], "ip:0", 2), Check(pair[1], "ip:0", 1)]
    clock = StepClock()

    def backend() -> Any:
        return rl.MemoryBackend() if store == "memory" else rl.RedisBackend(redis_client)

    cached = rl.Limiter(backend(), prefix=prefix + "c", clock=clock)
    plain = rl.Limiter(backend(), prefix=prefix + "p", clock=clock, deny_cache=0)
    for _ in range(3):
        answer = cached.check(checks)
        assert answer == plain.check(checks)
        assert [(t.allowed, t.banned) for t in answer.tiers] == [(False, True), (False, True)]
    call = codec.build(codec.HIT, checks, "rl")
    assert call.keys.count(call.keys[-1]) == 1  # one KEYS entry for the shared ban key
    for limiter in (cached, plain):
        limiter.reset(pair[0], "ip:0")


def test_no_refusal_with_slots_is_kept(step_clock: StepClock) -> None:
    # A slot frees whenever a response ends: a refusal whose call holds slots is never
    # kept, so a holder giving its slots back (`give_back_held`) has no entry to forget.
    limiter = rl.Limiter(rl.MemoryBackend(), clock=step_clock)
    slots = rl.Policy.in_flight(2, lease=60)
    daily = rl.Policy("1/day", algorithm="fixed-window", tz="UTC")  # not typed: cached
    alone, other = limiter.compile([(daily, 1)]), limiter.compile([(daily, 1), (slots, 1)])
    assert limiter.hit_compiled(other, ("u", "u")).allowed
    assert not limiter.hit_compiled(other, ("u", "u")).allowed  # the day's one is spent
    deny = limiter._deny
    assert deny is not None and len(deny) == 0
    assert not limiter.hit_compiled(alone, ("u",)).allowed
    assert len(deny) == 1  # the same refusal without slots is kept
