"""The limiter's fast path (one policy without penalty or calendar: `Limiter._fast_form`,
`plans.build_static`, the one-tier `plans.decide`, and on MemoryBackend itself the call's
parts given to `hit_one` or `hit_tiers`) against the generic path.

Random sequences of hits, peeks, refunds, resets, multi-policy checks and clock moves, over
policies of every algorithm, 1-3 tiers, penalties and calendar (tz) tiers, run through a
limiter taking every shortcut and through one taking none (`_GenericLimiter`), each on its own
MemoryBackend under one controlled clock: every Decision must be identical. Whether the deny
cache is on changes which calls may take the shortcut, so both settings are drawn.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ratelimit_mw as rl
from ratelimit_mw.backends.memory import MemoryBackend
from ratelimit_mw.core import plans
from ratelimit_mw.core.lane import Lane
from ratelimit_mw.core.plans import Check
from ratelimit_mw.core.wire import wire
from tests.conftest import FakeClock
from tests.test_differential import policies
from tests.test_lane import _deny_state


class _GenericLimiter(rl.Limiter):
    """The plain path everywhere: no hit shortcut, generic call building and reply reading."""

    _fast = False
    _build = staticmethod(plans.build_generic)
    _decide = staticmethod(plans.decide_generic)


@dataclass(frozen=True)
class Step:
    kind: str
    policy: int
    identity: int
    cost: int
    advance_ms: int


steps = st.builds(
    Step,
    kind=st.sampled_from(["hit", "hit", "hit", "hit", "text", "peek", "refund", "reset",
                          "check"]),
    policy=st.integers(0, 3),
    identity=st.integers(0, 2),
    cost=st.sampled_from([1, 1, 1, 2, 3, 41]),
    advance_ms=st.sampled_from([0, 0, 1, 250, 999, 1_000, 1_001, 9_999, 61_000, 3_600_000]),
)

# A string policy is parsed once per text (limiter._policy_from_text): the same object for
# both limiters.
TEXT = "3/second;5/minute"


def _run(limiter: rl.Limiter, pols: list[rl.Policy], step: Step) -> object:
    policy, identity = pols[step.policy], f"u{step.identity}"
    if step.kind == "hit":
        return limiter.hit(policy, identity, step.cost)
    if step.kind == "text":
        return limiter.hit(TEXT, identity, step.cost)
    if step.kind == "peek":
        return limiter.peek(policy, identity)
    if step.kind == "refund":
        return limiter.refund(policy, identity, step.cost)
    if step.kind == "reset":
        return limiter.reset(policy, identity)
    other = pols[(step.policy + 1) % len(pols)]
    return limiter.check((Check(policy, identity, step.cost), Check(other, "u0")))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pols=st.lists(policies(), min_size=4, max_size=4),
    static=st.lists(st.sampled_from(sorted(rl.ALGORITHMS)), min_size=2, max_size=2),
    deny_cache=st.sampled_from([0, 100]),
    sequence=st.lists(steps, min_size=1, max_size=40),
)
def test_the_fast_path_decides_as_the_generic_path(
    pols: list[rl.Policy], static: list[str], deny_cache: int, sequence: list[Step]
) -> None:
    # Two of the four policies are always static (no penalty, no calendar): the fast path's.
    pols[0] = rl.Policy("2/second", algorithm=static[0], name="s0")  # type: ignore[arg-type]
    pols[1] = rl.Policy("3/second;5/minute", algorithm=static[1], name="s1")  # type: ignore[arg-type]
    clock = FakeClock()
    fast = rl.Limiter(MemoryBackend(), clock=clock, deny_cache=deny_cache)
    generic = _GenericLimiter(MemoryBackend(), clock=clock, deny_cache=deny_cache)
    for step in sequence:
        clock.advance(step.advance_ms / 1000)
        assert _run(fast, pols, step) == _run(generic, pols, step), step
        assert _deny_state(fast) == _deny_state(generic), step


def test_the_fast_path_is_taken_only_for_the_common_hit() -> None:
    """What the differential test covers: the shortcut runs for a static policy (so the
    comparison above exercises it) and never where the generic path must decide."""
    limiter = rl.Limiter(MemoryBackend(), deny_cache=0)
    assert limiter._fast_form(rl.Policy("2/second"), "u", 1) is not None
    assert limiter._fast_form(rl.Policy("2/second;9/hour", algorithm="gcra"), "u", 3) is not None
    assert limiter._fast_form(rl.Policy("2/second", penalty=1), "u", 1) is None
    assert limiter._fast_form(rl.Policy("2/day", algorithm="fixed-window", tz="Europe/Paris"),
                              "u", 1) is None
    assert limiter._fast_form(rl.Policy("2/second"), "u", 0) is None
    assert limiter._fast_form("2/second", "u", 1) is None  # text: parsed by `check`
    assert limiter._takes_parts()
    generic = _GenericLimiter(MemoryBackend())
    assert generic._fast_form(rl.Policy("2/second"), "u", 1) is None
    assert generic._takes_parts() is False  # the differential's plain side takes no shortcut
    cached = rl.Limiter(MemoryBackend())
    policy = rl.Policy("1/minute")
    cached.hit(policy, "u")
    assert not cached.hit(policy, "u")  # a refusal the deny cache now holds
    assert cached._fast_form(policy, "u", 1) is None


@settings(max_examples=200, deadline=None)
@given(
    pol=policies(),
    op=st.sampled_from([plans.HIT, plans.PEEK, plans.REFUND, plans.RESET]),
    identity=st.text(min_size=1, max_size=80),
    cost=st.integers(1, 50),
    now_us=st.one_of(st.none(), st.integers(0, 2**50)),
)
def test_build_static_is_build_generic(pol: rl.Policy, op: str, identity: str, cost: int,
                                       now_us: int | None) -> None:
    checks = (Check(pol, identity, cost),)
    fast = plans.build(op, checks, "rl", now_us=now_us, clock_ms=1_800_000_000_000)
    token = str(fast.args[2])  # the sliding log's member token: fresh on every call
    plain = plans.build_generic(op, checks, "rl", now_us=now_us, token=token,
                                clock_ms=1_800_000_000_000)
    assert fast == plain


def test_the_async_fast_path_decides_as_the_generic_path() -> None:
    """AsyncLimiter.hit shares the shortcut; a refusal on it is recorded by the deny cache."""
    clock = FakeClock()
    policy = rl.Policy("3/second;5/minute", algorithm="gcra", name="a")
    generic = _GenericLimiter(MemoryBackend(), clock=clock)
    fast = rl.AsyncLimiter(MemoryBackend(), clock=clock)

    async def run() -> None:
        for step in range(12):
            clock.advance(0.2 * (step % 3))
            assert await fast.hit(policy, "u", 1 + step % 2) == generic.hit(policy, "u",
                                                                            1 + step % 2)

    asyncio.run(run())
    assert fast._deny is not None and len(fast._deny) == 1  # the last refusal, remembered


async def _async_bursts(policy: rl.Policy, lane: Lane, clock: FakeClock) -> list[list[bool]]:
    limiter = rl.AsyncLimiter(MemoryBackend(), clock=clock, deny_cache=0)
    hits = [(await limiter.hit(policy, "u")).allowed for _ in range(6)]
    lanes = [(await limiter.lane_hit(lane, "v")).allowed for _ in range(6)]
    return [hits, lanes]


@pytest.mark.parametrize("rates", ["4/second", "4/second;9/minute"])
@pytest.mark.parametrize("algorithm", sorted(rl.ALGORITHMS))
def test_hits_at_one_instant_fill_the_quota_on_every_in_process_path(algorithm: str,
                                                                     rates: str) -> None:
    """Many hits in one millisecond, where a sliding log tells its hits apart by their
    tokens alone: the in-process shortcuts (`hit`, `lane_hit`, sync and async) admit up to
    the limit and refuse the rest, as the generic path does. The random sequence above
    rarely puts enough hits of one identity into one window to show this."""
    policy = rl.Policy(rates, algorithm=algorithm, name="burst")  # type: ignore[arg-type]
    clock = FakeClock()
    generic = _GenericLimiter(MemoryBackend(), clock=clock, deny_cache=0)
    expected = [generic.hit(policy, "u").allowed for _ in range(6)]
    assert expected == [True] * 4 + [False] * 2
    lane = Lane(policy, 1, "rl")
    sync = rl.Limiter(MemoryBackend(), clock=clock, deny_cache=0)
    assert sync._takes_parts()  # the shortcut under test
    assert [sync.hit(policy, "u").allowed for _ in range(6)] == expected
    assert [sync.lane_hit(lane, "v").allowed for _ in range(6)] == expected
    assert asyncio.run(_async_bursts(policy, lane, clock)) == [expected, expected]


@settings(max_examples=200, deadline=None)
@given(
    pol=policies().filter(lambda p: wire(p).static),
    identity=st.text(min_size=1, max_size=80),
    cost=st.integers(1, 50),
    prefix=st.sampled_from(["rl", "a.b:c"]),
)
def test_the_in_process_hit_sends_the_parts_of_the_call_it_stands_for(
    pol: rl.Policy, identity: str, cost: int, prefix: str
) -> None:
    """What `hit` gives MemoryBackend.hit_one (one tier) or hit_tiers (several) is the call
    `plans.build` builds: its keys (an identity of any characters, encoded), its tiers'
    arguments, its clock, and for a sliding log a fresh token per hit
    (tests/backends/test_memory_perf_equivalence.py holds both to `run` of that call)."""
    clock = FakeClock()
    limiter = rl.Limiter(MemoryBackend(), prefix, clock=clock, deny_cache=0)
    given_parts: list[tuple[object, ...]] = []
    assert limiter._takes_parts()
    backend: MemoryBackend = limiter.backend  # type: ignore[assignment]
    one, many = backend.hit_one, backend.hit_tiers

    def recorded_one(key: str, *rest: object) -> list[int]:
        given_parts.append(([key], *rest))
        return one(key, *rest)  # type: ignore[arg-type]

    def recorded_many(keys: list[str], *rest: object) -> list[int]:
        given_parts.append((keys, *rest))
        return many(keys, *rest)  # type: ignore[arg-type]

    backend.hit_one = recorded_one  # type: ignore[method-assign]
    backend.hit_tiers = recorded_many  # type: ignore[method-assign]
    for _ in range(2):
        limiter.hit(pol, identity, cost)
    call = plans.build(plans.HIT, [Check(pol, identity, cost)], prefix,
                       now_us=limiter._now_us())
    for keys, tiers, token, now in given_parts:
        assert (keys, tiers, now) == (call.keys, tuple(call.args[5:]), call.args[1])
        assert bool(token) == (pol.algorithm == "sliding-log")
    assert len(given_parts) == 2
    if pol.algorithm == "sliding-log":
        assert given_parts[0][2] != given_parts[1][2]


# -- MemoryBackend's parts (`hit_one`, `hit_tiers`): refusals, the deny cache, whole calls -------


async def _async_hits(limiter: rl.AsyncLimiter, policy: rl.Policy, clock: FakeClock,
                      gaps_ms: list[int]) -> list[rl.Decision]:
    answers = []
    for gap in gaps_ms:
        clock.advance(gap / 1000)
        answers.append(await limiter.hit(policy, "u"))
    return answers


@pytest.mark.parametrize("rates", ["2/second", "2/second;3/5 seconds"])
@pytest.mark.parametrize("algorithm", sorted(rl.ALGORITHMS))
def test_refusals_of_the_in_process_hit_are_recorded_as_the_generic_path_records_them(
    algorithm: str, rates: str
) -> None:
    """Hits past the limit, at one instant and a few ms apart, with the deny cache on: the
    refusals it records (its entries, their validity, the Decisions it replays) are the
    generic path's, sync and async, for one tier (`hit_one`) and for two (`hit_tiers`)."""
    policy = rl.Policy(rates, algorithm=algorithm, name="r")  # type: ignore[arg-type]
    gaps_ms = [0, 0, 0, 0, 3, 0, 250, 0, 800, 0, 0]
    clocks = [FakeClock() for _ in range(3)]
    generic = _GenericLimiter(MemoryBackend(), clock=clocks[0])
    sync = rl.Limiter(MemoryBackend(), clock=clocks[1])
    assert sync._takes_parts()
    expected, answers = [], []
    for gap in gaps_ms:
        for clock in clocks[:2]:
            clock.advance(gap / 1000)
        expected.append((generic.hit(policy, "u"), _deny_state(generic)))
        answers.append((sync.hit(policy, "u"), _deny_state(sync)))
    assert answers == expected
    assert not all(d.allowed for d, _ in expected)  # refusals were recorded and replayed
    alimiter = rl.AsyncLimiter(MemoryBackend(), clock=clocks[2])
    decisions = asyncio.run(_async_hits(alimiter, policy, clocks[2], gaps_ms))
    assert decisions == [d for d, _ in expected]
    assert _deny_state(alimiter) == expected[-1][1]


def test_a_refusal_recorded_while_the_in_process_hit_ran_is_forgotten_by_its_admission() -> None:
    """Another thread may record a refusal for the same (policy, identity) while a hit is in
    the backend: the admitted hit must forget it (the cache is asked after the reply), as
    on the generic path."""
    policy = rl.Policy("3/minute", name="w")
    limiter = rl.Limiter(MemoryBackend())
    assert limiter._takes_parts() and limiter._deny is not None
    hit_one = limiter.backend.hit_one  # type: ignore[attr-defined]
    deny = limiter._deny

    def meanwhile(*parts: object) -> list[int]:
        reply = hit_one(*parts)  # type: ignore[arg-type]
        big = Check(policy, "u", 3)  # a refusal of cost 3, as another thread records it
        deny.record((big,), plans.build(plans.HIT, [big], "rl"),
                    [0, 0, 2, 60_000, 60_000, 0, 60_000_000, 60_000_000, 60_000_000],
                    limiter._cache_now())
        return reply

    limiter.backend.hit_one = meanwhile  # type: ignore[method-assign]
    assert limiter.hit(policy, "u").remaining == 2
    assert len(deny) == 0


def test_a_backend_that_runs_calls_its_own_way_is_given_whole_calls() -> None:
    """A MemoryBackend subclass with a `run` of its own, or a `run` set on the instance (a
    test injecting a failure), sees every hit as a call: the parts go to MemoryBackend
    itself only."""
    calls: list[str] = []

    class Watched(MemoryBackend):
        def run(self, call: plans.ScriptCall) -> list[int]:
            calls.append(call.op)
            return super().run(call)

    policy = rl.Policy("5/minute", name="s")
    lane = Lane(policy, 1, "rl")
    limiter = rl.Limiter(Watched())
    assert limiter._takes_parts() is False
    limiter.hit(policy, "u")
    limiter.lane_hit(lane, "u")
    asyncio.run(rl.AsyncLimiter(Watched()).hit(policy, "u"))
    assert calls == ["H", "H", "H"]

    plain = rl.Limiter(MemoryBackend())
    assert plain.hit(policy, "u").allowed
    with mock.patch.object(plain.backend, "run", side_effect=rl.BackendError("down")):
        assert plain._takes_parts() is False
        with pytest.raises(rl.BackendError):
            plain.hit(policy, "u")
        with pytest.raises(rl.BackendError):
            plain.lane_hit(lane, "u")
    assert plain._takes_parts()
    aplain = rl.AsyncLimiter(MemoryBackend())
    with mock.patch.object(aplain.backend, "run", side_effect=rl.BackendError("down")):
        with pytest.raises(rl.BackendError):
            asyncio.run(aplain.hit(policy, "u"))
        with pytest.raises(rl.BackendError):
            asyncio.run(aplain.lane_hit(lane, "u"))
