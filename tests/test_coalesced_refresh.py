"""When a refusal held by the async limiter's deny cache lapses, the requests of that very call
that arrive while one of them asks the store again wait for its answer instead of each sending
their own (`AsyncLimiter._refresh`). The shortcut may change how many calls reach the store,
never an answer: the differential test drives random floods through it and through the store
alone and requires identical decisions."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

import pytest
import redis.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ratelimit_mw as rl
from ratelimit_mw.core.codec import Check
from ratelimit_mw.core.errors import BackendError
from tests.conftest import REDIS_URL, StepClock
from tests.test_deny_cache import policies


class WireBackend:
    """A MemoryBackend reached over a 'wire': each call yields to the loop on the way out and
    on the way back, as a socket would, so that concurrent requests really overlap. Counts
    the calls that reach the store; `fail` makes the next calls raise BackendError; `gate`,
    when set, holds every call until it is opened."""

    is_cluster = False

    def __init__(self) -> None:
        self.inner = rl.MemoryBackend()
        self.calls = 0
        self.fail = 0
        self.gate: asyncio.Event | None = None

    async def arun(self, call: Any, deadline: float | None = None) -> list[int]:
        self.calls += 1
        await asyncio.sleep(0)
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            self.fail -= 1
            raise BackendError("the store went away")
        reply = self.inner.run(call)
        await asyncio.sleep(0)
        return reply  # type: ignore[no-any-return]


def limiter(backend: Any, clock: StepClock, **options: Any) -> rl.AsyncLimiter:
    return rl.AsyncLimiter(backend, prefix="cr", clock=clock, **options)


POLICY = rl.Policy("2/minute", algorithm="gcra")


async def _refused_then_lapsed(backend: WireBackend, clock: StepClock) -> rl.AsyncLimiter:
    """A limiter whose deny cache held a refusal for ip:1 that has just lapsed (age bound)."""
    lim = limiter(backend, clock, deny_cache_max_age=0.5)
    for _ in range(3):
        await lim.hit(POLICY, "ip:1")
    clock.advance_ms(500)
    backend.calls = 0
    return lim


# -- the behaviour ------------------------------------------------------------------------
async def test_a_lapsed_refusal_is_asked_about_once_for_a_concurrent_flood() -> None:
    backend, clock = WireBackend(), StepClock()
    lim = await _refused_then_lapsed(backend, clock)
    decisions = await asyncio.gather(*(lim.hit(POLICY, "ip:1") for _ in range(32)))
    assert backend.calls == 1
    assert not any(d.allowed for d in decisions)
    assert len({(d.retry_after, d.remaining) for d in decisions}) == 1  # one moment, one answer


async def test_without_the_cache_every_request_asks() -> None:
    backend, clock = WireBackend(), StepClock()
    lim = limiter(backend, clock, deny_cache=0)
    for _ in range(3):
        await lim.hit(POLICY, "ip:1")
    backend.calls = 0
    await asyncio.gather(*(lim.hit(POLICY, "ip:1") for _ in range(8)))
    assert backend.calls == 8


async def test_requests_of_another_call_do_not_wait() -> None:
    backend, clock = WireBackend(), StepClock()
    lim = await _refused_then_lapsed(backend, clock)
    backend.gate = asyncio.Event()
    leader = asyncio.ensure_future(lim.hit(POLICY, "ip:1"))
    await asyncio.sleep(0)
    other = asyncio.ensure_future(lim.hit(POLICY, "ip:2"))  # another identity: its own call
    larger = asyncio.ensure_future(lim.hit(POLICY, "ip:1", 2))  # another cost: its own call
    for _ in range(3):
        await asyncio.sleep(0)
    assert backend.calls == 3
    backend.gate.set()
    assert not (await leader).allowed
    assert (await other).allowed
    assert not (await larger).allowed


async def test_when_the_store_admits_again_each_waiting_request_asks_for_itself() -> None:
    backend, clock = WireBackend(), StepClock()
    lim = await _refused_then_lapsed(backend, clock)
    clock.advance(60)  # the refusal's wait is over: the lapsed call will be admitted
    decisions = await asyncio.gather(*(lim.hit(POLICY, "ip:1") for _ in range(4)))
    assert [d.allowed for d in decisions] == [True, True, False, False]
    assert backend.calls == 4  # an admitted answer is not anyone else's to replay


async def test_a_failed_call_fails_only_its_own_request() -> None:
    backend, clock = WireBackend(), StepClock()
    lim = await _refused_then_lapsed(backend, clock)
    backend.fail = 1
    results = await asyncio.gather(*(lim.hit(POLICY, "ip:1") for _ in range(4)),
                                   return_exceptions=True)
    assert isinstance(results[0], BackendError)
    assert all(isinstance(r, rl.Decision) and not r.allowed for r in results[1:])
    assert backend.calls == 2  # the failed one, then one for the three that waited


async def test_a_waiting_request_cancelled_by_its_deadline_leaves_the_others_served() -> None:
    backend, clock = WireBackend(), StepClock()
    lim = await _refused_then_lapsed(backend, clock)
    backend.gate = asyncio.Event()
    leader = asyncio.ensure_future(lim.hit(POLICY, "ip:1"))
    await asyncio.sleep(0)
    impatient = asyncio.ensure_future(lim.hit(POLICY, "ip:1"))
    patient = asyncio.ensure_future(lim.hit(POLICY, "ip:1"))
    await asyncio.sleep(0)
    impatient.cancel()
    backend.gate.set()
    assert not (await leader).allowed
    assert not (await patient).allowed
    with pytest.raises(asyncio.CancelledError):
        await impatient
    assert backend.calls == 1
    assert not lim._flights  # nothing left waiting


async def test_a_cancelled_leader_releases_the_waiting_requests() -> None:
    backend, clock = WireBackend(), StepClock()
    lim = await _refused_then_lapsed(backend, clock)
    backend.gate = asyncio.Event()
    leader = asyncio.ensure_future(lim.hit(POLICY, "ip:1"))
    await asyncio.sleep(0)
    waiting = asyncio.ensure_future(lim.hit(POLICY, "ip:1"))
    await asyncio.sleep(0)
    leader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leader
    backend.gate.set()
    assert not (await waiting).allowed  # asked for itself
    assert backend.calls == 2
    assert not lim._flights


class CountingRedis:
    """The real AsyncRedisBackend, counting the calls sent to it."""

    is_cluster = False

    def __init__(self, client: redis.asyncio.Redis) -> None:
        self.inner = rl.AsyncRedisBackend(client)
        self.calls = 0

    async def arun(self, call: Any, deadline: float | None = None) -> list[int]:
        self.calls += 1
        return await self.inner.arun(call, deadline)


async def test_on_redis_a_flood_costs_one_call_each_time_its_refusal_lapses(prefix: str) -> None:
    client = redis.asyncio.Redis.from_url(REDIS_URL, max_connections=64)
    backend = CountingRedis(client)
    # Library defaults but for a short age bound, so that the test waits 60 ms, not 1 s.
    lim = rl.AsyncLimiter(backend, prefix=prefix, deny_cache_max_age=0.05)  # type: ignore[arg-type]
    policy = rl.Policy("10/hour", algorithm="sliding-window")
    try:
        first = await asyncio.gather(*(lim.hit(policy, "flooder") for _ in range(40)))
        assert sum(d.allowed for d in first) == 10
        for _ in range(3):
            await asyncio.sleep(0.06)  # the refusal lapses (age bound), Redis's clock moves on
            backend.calls = 0
            again = await asyncio.gather(*(lim.hit(policy, "flooder") for _ in range(40)))
            assert not any(d.allowed for d in again)
            assert backend.calls == 1
        assert (await lim.peek(policy, "flooder")).remaining == 0
    finally:
        await lim.reset(policy, "flooder")
        await client.aclose()


# -- the differential test ----------------------------------------------------------------
@dataclass(frozen=True)
class Flood:
    """One round: `advance_us` on the clock, then `size` concurrent requests from each of
    `clients` distinct identities (each identity's requests all the same call), interleaved;
    or a reset of one identity."""

    advance_us: int
    clients: int
    size: int
    cost: int
    both: bool
    reset: bool
    seed: int


floods = st.builds(
    Flood,
    advance_us=st.sampled_from([0, 0, 1, 999, 1_000, 250_000, 500_000, 1_000_000, 61_000_000]),
    clients=st.integers(1, 3),
    size=st.integers(1, 12),
    cost=st.sampled_from([1, 1, 2, 5]),
    both=st.booleans(),
    reset=st.sampled_from([False] * 6 + [True]),
    seed=st.integers(0, 2**16),
)


def _calls(pool: list[rl.Policy], flood: Flood) -> list[list[Check]]:
    calls = []
    for client in range(flood.clients):
        identity = f"ip:{client}"
        checks = [Check(pool[0], identity, flood.cost)]
        if flood.both and len(pool) > 1:
            checks.append(Check(pool[1], identity, 1))
        calls += [checks] * flood.size
    random.Random(flood.seed).shuffle(calls)
    return calls


async def _play(pool: list[rl.Policy], sequence: list[Flood]) -> tuple[int, int]:
    clock = StepClock()
    coalescing_store, plain_store = WireBackend(), WireBackend()
    coalescing = limiter(coalescing_store, clock, deny_cache_max_age=0.5)
    plain = limiter(plain_store, clock, deny_cache=0)
    for flood in sequence:
        clock.us += flood.advance_us
        if flood.reset:
            await coalescing.reset(pool[0], "ip:0")
            await plain.reset(pool[0], "ip:0")
            continue
        calls = _calls(pool, flood)
        mine = await asyncio.gather(*(coalescing.check(c) for c in calls))
        store = await asyncio.gather(*(plain.check(c) for c in calls))
        for m, s in zip(mine, store, strict=True):
            assert m == s, (m, s)
            assert m.tiers == s.tiers
        assert not coalescing._flights
    return coalescing_store.calls, plain_store.calls


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pool=st.lists(policies(), min_size=1, max_size=2),
       sequence=st.lists(floods, min_size=1, max_size=25))
def test_with_and_without_coalescing_every_decision_is_identical(
    pool: list[rl.Policy], sequence: list[Flood]
) -> None:
    mine, store = asyncio.run(_play(pool, sequence))
    assert mine <= store
