"""The limiter's fast path (one policy without penalty or calendar: `Limiter._fast_call`,
`plans.build_static`, the one-tier `plans.decide`) against the generic path.

Random sequences of hits, peeks, refunds, resets, multi-policy checks and clock moves, over
policies of every algorithm, 1-3 tiers, penalties and calendar (tz) tiers, run through a
limiter taking every shortcut and through one taking none (`_GenericLimiter`), each on its own
MemoryBackend under one controlled clock: every Decision must be identical. Whether the deny
cache is on changes which calls may take the shortcut, so both settings are drawn.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

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


def test_the_fast_path_is_taken_only_for_the_common_hit() -> None:
    """What the differential test covers: the shortcut runs for a static policy (so the
    comparison above exercises it) and never where the generic path must decide."""
    limiter = rl.Limiter(MemoryBackend(), deny_cache=0)
    assert limiter._fast_call(rl.Policy("2/second"), "u", 1) is not None
    assert limiter._fast_call(rl.Policy("2/second;9/hour", algorithm="gcra"), "u", 3) is not None
    assert limiter._fast_call(rl.Policy("2/second", penalty=1), "u", 1) is None
    assert limiter._fast_call(rl.Policy("2/day", algorithm="fixed-window", tz="Europe/Paris"),
                              "u", 1) is None
    assert limiter._fast_call(rl.Policy("2/second"), "u", 0) is None
    assert _GenericLimiter(MemoryBackend())._fast_call(rl.Policy("2/second"), "u", 1) is None
    cached = rl.Limiter(MemoryBackend())
    policy = rl.Policy("1/minute")
    cached.hit(policy, "u")
    assert not cached.hit(policy, "u")  # a refusal the deny cache now holds
    assert cached._fast_call(policy, "u", 1) is None


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


@pytest.mark.parametrize("algorithm", sorted(rl.ALGORITHMS))
def test_hits_at_one_instant_fill_the_quota_on_every_in_process_path(algorithm: str) -> None:
    """Many hits in one millisecond, where a sliding log tells its hits apart by their
    tokens alone: the in-process shortcuts (`hit`, `lane_hit`, sync and async) admit up to
    the limit and refuse the rest, as the generic path does. The random sequence above
    rarely puts enough hits of one identity into one window to show this."""
    policy = rl.Policy("4/second", algorithm=algorithm, name="burst")  # type: ignore[arg-type]
    clock = FakeClock()
    generic = _GenericLimiter(MemoryBackend(), clock=clock, deny_cache=0)
    expected = [generic.hit(policy, "u").allowed for _ in range(6)]
    assert expected == [True] * 4 + [False] * 2
    lane = Lane(policy, 1, "rl")
    sync = rl.Limiter(MemoryBackend(), clock=clock, deny_cache=0)
    assert sync._hit_one is not None  # the shortcut under test
    assert [sync.hit(policy, "u").allowed for _ in range(6)] == expected
    assert [sync.lane_hit(lane, "v").allowed for _ in range(6)] == expected
    assert asyncio.run(_async_bursts(policy, lane, clock)) == [expected, expected]


@settings(max_examples=200, deadline=None)
@given(
    pol=policies().filter(lambda p: wire(p).static and len(p.rates) == 1),
    identity=st.text(min_size=1, max_size=80),
    cost=st.integers(1, 50),
    prefix=st.sampled_from(["rl", "a.b:c"]),
)
def test_the_in_process_hit_sends_the_parts_of_the_call_it_stands_for(
    pol: rl.Policy, identity: str, cost: int, prefix: str
) -> None:
    """What `hit` gives MemoryBackend.hit_one is the call `plans.build` builds: its key (an
    identity of any characters, encoded), its tier arguments, its clock, and for a sliding
    log a fresh token per hit (tests/backends/test_memory_perf_equivalence.py holds hit_one
    to `run` of that call)."""
    clock = FakeClock()
    limiter = rl.Limiter(MemoryBackend(), prefix, clock=clock, deny_cache=0)
    given_parts: list[tuple[object, ...]] = []
    run = limiter._hit_one
    assert run is not None

    def recorded(*parts: object) -> list[int]:
        given_parts.append(parts)
        return run(*parts)  # type: ignore[arg-type]

    limiter._hit_one = recorded
    for _ in range(2):
        limiter.hit(pol, identity, cost)
    call = plans.build(plans.HIT, [Check(pol, identity, cost)], prefix,
                       now_us=limiter._now_us())
    for key, tier, token, now in given_parts:
        assert (key, tier, now) == (call.keys[0], tuple(call.args[5:]), call.args[1])
        assert bool(token) == (pol.algorithm == "sliding-log")
    assert len(given_parts) == 2
    if pol.algorithm == "sliding-log":
        assert given_parts[0][2] != given_parts[1][2]
