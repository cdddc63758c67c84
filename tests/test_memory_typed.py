"""The memory backend's typed hit and give-back (`MemoryBackend.hitter` and `releaser`,
what `Limiter.hit`, the middleware and its give-backs take) and its ARGV adapter (`run`,
what peeks, resets, bookings, the CLI and the Lua differential test take) are one
implementation: hypothesis plays the same operations on two backends, every hit and
give-back through the typed path on one and through `run` on the other; each answer (the
typed hit's Decision, admitted or refused, against `codec.decode_generic` of `run`'s reply,
the general reading rather than `decoded`'s shortcuts) and the state they leave (a peek of
every check after every step) must be equal. `run` itself is held to the Lua by
tests/test_differential.py."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ratelimit_mw as rl
from ratelimit_mw.backends.memory import MemoryBackend
from ratelimit_mw.core import codec
from ratelimit_mw.core.compiled import Compiled
from ratelimit_mw.core.decision import Decision
from tests.test_differential import IDENTITIES, PERIODS, START_MS, Op, _cost, ops, policies


def _play(pool: list[rl.Policy], sequence: list[Op]) -> int:
    typed, adapter = MemoryBackend(), MemoryBackend()
    now_ms = START_MS
    tokens: list[tuple[list[codec.Check], str]] = []
    typed_hits = 0
    now_us = 0

    def clock_us() -> int:  # the typed hit's clock: the step's time, as `run`'s calls carry
        return now_us

    for op in sequence:
        now_ms += op.advance_ms
        now_us = now_ms * 1000 + 137
        checks = [codec.Check(pool[p % len(pool)], IDENTITIES[i],
                              _cost(pool[p % len(pool)], cost)) for p, i, cost in op.picks]
        compiled = Compiled([(check.policy, check.cost) for check in checks], "t")
        identities = [check.identity for check in checks]
        if op.kind in ("hit", "charge", "book", "settle"):
            token = compiled.token() or ""
            call = compiled.call(identities, now_us, token)
            hit = typed.hitter(compiled, clock_us)
            expected = adapter.run(call)
            if hit is None:  # arguments that vary per request: both take `run`
                assert not compiled.static
                assert typed.run(call) == expected
                continue
            typed_hits += 1
            answer = hit(identities, token)
            # Admitted or refused, the Decision the limiter reads from main.lua's reply.
            assert type(answer) is Decision
            assert answer == codec.decode_generic(call.layout, expected, call.booking,
                                                  compiled.governs)
            if expected[0] == 1 and token:
                tokens.append((checks, token, now_us))
        elif op.kind in ("refund", "uncheck", "release", "renew") and tokens:
            held, token, charged_us = tokens.pop() if op.kind != "renew" else tokens[-1]
            # A response's give-back names when its hit was charged (the middleware's), or
            # not (0: from the window as it is).
            if op.kind == "uncheck":
                charged_us = 0
            # "release": a holder's give-back when its response ends, its slots alone, asked
            # of the store by the whole hit (`releaser(..., slots_only=True)`).
            slots = [c for c in held if c.policy.algorithm == "concurrency"]
            alone = op.kind == "release" and bool(slots)
            call = codec.build(codec.REFUND if op.kind != "renew" else codec.RENEW,
                               slots if alone else held, "t", now_us=now_us, token=token,
                               at_ms=str(charged_us) if charged_us and op.kind != "renew"
                               and not alone else None)
            release = (typed.releaser(Compiled([(c.policy, c.cost) for c in held], "t"),
                                      slots_only=alone)
                       if op.kind != "renew" else None)
            if release is None:
                assert typed.run(call) == adapter.run(call)
            else:  # the typed give-back, held to run's by the peeks below
                release([c.identity for c in held], token, now_us, charged_us)
                adapter.run(call)
        elif op.kind == "reset":
            call = codec.build(codec.RESET, checks[:1], "t", now_us=now_us)
            assert typed.run(call) == adapter.run(call)
        for check in checks:
            peek = codec.build(codec.PEEK, [check], "t", now_us=now_us)
            assert typed.run(peek) == adapter.run(peek)
    return typed_hits


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pool=st.lists(policies(), min_size=1, max_size=3),
       sequence=st.lists(ops, min_size=8, max_size=50))
def test_the_typed_hit_and_run_agree(pool: list[rl.Policy], sequence: list[Op]) -> None:
    _play(pool, sequence)


@st.composite
def rate_then_slots(draw: st.DrawFn) -> list[rl.Policy]:
    """A rate of one number (any algorithm, no penalty) and then an in-flight limit."""
    rate = rl.Policy([rl.Rate(draw(st.sampled_from([1, 2, 3, 4, 5, 40])),
                              draw(st.sampled_from(PERIODS)))],
                     algorithm=draw(st.sampled_from(sorted(rl.ALGORITHMS))), name="rate")
    return [rate, rl.Policy.in_flight(draw(st.sampled_from([1, 2, 3, 40])),
                                      lease=draw(st.sampled_from(PERIODS)) / 1000,
                                      name="slots")]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pool=rate_then_slots(), sequence=st.lists(ops, min_size=8, max_size=50))
def test_a_rate_and_then_slots_typed_whole_agree_with_run(pool: list[rl.Policy],
                                                          sequence: list[Op]) -> None:
    """A rate and an in-flight limit, in that order (a route's limit with ``concurrency``),
    are typed as one shape: held to `run` as every other selection is."""
    shape = MemoryBackend().hitter(Compiled([(policy, 1) for policy in pool], "t"))
    assert shape is not None and shape.__qualname__.startswith("MemoryBackend._rate_and_slots")
    _play(pool, sequence)


def test_a_holder_gives_back_its_slots_alone_and_keeps_its_hit() -> None:
    """`releaser(..., slots_only=True)`: the slots of a rate-and-slots hit go back, by the
    whole hit's identities; the rate's count stays (a holder's response ended, charged)."""
    rate, slots = rl.Policy("5/minute"), rl.Policy.in_flight(1, lease=60)
    store = MemoryBackend()
    compiled = Compiled([(rate, 1), (slots, 1)], "t")
    hit = store.hitter(compiled)
    release = store.releaser(compiled, slots_only=True)
    assert hit is not None and release is not None
    first = hit(("u", "u"), "tok1")
    assert first.allowed and first.remaining == 4
    assert not hit(("u", "u"), "tok2").allowed  # its one slot is held
    release(("u", "u"), "tok1", None, 0)
    again = hit(("u", "u"), "tok3")
    assert again.allowed and again.remaining == 3  # the first hit still counts


def test_two_slot_tiers_of_one_key_take_both_slots() -> None:
    """Two in-flight limits of one name on one identity write to one set: the second
    take reads it again, as the script's ZADD does (the first took more members)."""
    one, two = rl.Policy.in_flight(6, lease=60), rl.Policy.in_flight(6, lease=60)
    store, adapter = MemoryBackend(), MemoryBackend()
    compiled = Compiled([(one, 2), (two, 1)], "t")
    now_us = START_MS * 1000
    hit = store.hitter(compiled, lambda: now_us)
    assert hit is not None
    assert compiled.key_suffixes[0] == compiled.key_suffixes[1]  # one set
    for i in range(3):
        call = compiled.call(["u", "u"], now_us, f"tok{i}")
        assert hit(("u", "u"), f"tok{i}") == codec.decoded(call, adapter.run(call))
    key = compiled.call(["u", "u"]).keys[0]
    assert store._data.get(key) == adapter._data.get(key)


def test_of_tiers_tied_on_what_remains_and_its_reset_the_first_governs() -> None:
    """Two policies of one rate, hit alike: every number ties, and the first tier governs,
    as the script's reply is read."""
    first, second = rl.Policy("5/minute", name="first"), rl.Policy("5/minute", name="second")
    compiled = Compiled([(first, 1), (second, 1)], "t")
    now_us = START_MS * 1000
    typed, adapter = MemoryBackend(), MemoryBackend()
    hit = typed.hitter(compiled, lambda: now_us)
    assert hit is not None
    for _ in range(2):
        call = compiled.call(["u", "u"], now_us)
        decision = hit(("u", "u"), None)
        assert decision == codec.decoded(call, adapter.run(call))
        assert decision.policy is first


def test_the_typed_hit_is_taken_for_every_static_selection() -> None:
    """Not vacuous: a plain policy's hits go through the typed path (and refuse there)."""
    policy = rl.Policy("2/second;3/minute", algorithm="sliding-log")
    sequence = [Op(0, "hit", ((0, 0, 1),), 0)] * 4
    assert _play([policy], sequence) == 4


def test_a_cached_hit_follows_the_store() -> None:
    """The limiter's store swapped (as ratelimit_mw.testing does): the next hit is the new
    store's, and the old one is left as it was."""
    limiter = rl.Limiter(deny_cache=0)
    first = limiter.backend
    policy = rl.Policy("1/minute")
    assert limiter.hit(policy, "u").allowed
    assert not limiter.hit(policy, "u").allowed
    limiter.backend = MemoryBackend()
    assert limiter.hit(policy, "u").allowed
    assert len(limiter.backend) == 1
    limiter.backend = first
    assert not limiter.hit(policy, "u").allowed


def test_the_selections_typed_on_one_store_keep_a_bounded_number_of_keys() -> None:
    """Dynamic limits and costs type a selection each: the k-th keeps 16,384 // k clients'
    keys (at least 256), so that together they keep about 16,384 × ln k."""
    store = MemoryBackend()
    bounds = [store._bound() for _ in range(1024)]
    assert bounds[:3] == [16_384, 8_192, 5_461] and bounds[-1] == 256
    assert sum(bounds) < 16_384 * 8 + 256 * 1024


def test_a_typed_hit_past_its_kept_keys_answers_the_same(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ratelimit_mw.backends import memory

    monkeypatch.setattr(memory, "_KEYS_KEPT", 2)
    monkeypatch.setattr(memory, "_KEYS_LEAST", 2)
    limiter = rl.Limiter(MemoryBackend(), deny_cache=0)
    one, several = rl.Policy("3/minute"), rl.Policy("3/minute;5/hour")
    for policy in (one, several):
        answers = [limiter.hit(policy, f"u{i}").allowed for _ in range(4) for i in range(5)]
        assert answers == [True] * 15 + [False] * 5  # five clients, each kept and dropped


@pytest.mark.parametrize("slots_only", [True, False])
def test_two_slot_tiers_of_one_set_are_given_back_as_the_script_does(slots_only: bool) -> None:
    """Two in-flight limits of one name, costs 1 and 2, write to one set; the script's
    refund gives the set back once per token, with the larger cost: the typed give-back
    leaves the same set, none."""
    one, two = rl.Policy.in_flight(3, lease=60, name="a"), rl.Policy.in_flight(2, lease=60,
                                                                            name="a")
    compiled = Compiled([(one, 1), (two, 2)], "t")
    now_us = START_MS * 1000
    typed, adapter = MemoryBackend(), MemoryBackend()
    hit = typed.hitter(compiled, lambda: now_us)
    release = typed.releaser(compiled, slots_only=slots_only)
    assert hit is not None and release is not None
    hit(("u", "u"), "T1")
    adapter.run(compiled.call(("u", "u"), now_us, "T1"))
    release(("u", "u"), "T1", now_us, 0)
    adapter.run(compiled.call(("u", "u"), now_us, "T1", 0, codec.REFUND))
    key = compiled.call(("u", "u"), now_us, "T1").keys[0]
    assert typed._data.get(key) == adapter._data.get(key) is None
