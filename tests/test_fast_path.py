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

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ratelimit_mw as rl
from ratelimit_mw.backends.memory import MemoryBackend
from ratelimit_mw.core import plans
from ratelimit_mw.core.plans import Check
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
