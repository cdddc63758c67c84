"""The sans-I/O core: the call it builds (lua/main.lua's wire format) and how it reads replies."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

import ratelimit_mw as rl
from ratelimit_mw.core import codec
from ratelimit_mw.core.compiled import Compiled
from ratelimit_mw.core.decision import TierState

NOW_US = 1_800_000_000_000_000


def tier_args(call: codec.ScriptCall) -> list[list[object]]:
    n = int(call.args[4])
    rest = call.args[5:]
    assert len(rest) == 7 * n
    return [list(rest[i * 7 : i * 7 + 7]) for i in range(n)]


# -- build ----------------------------------------------------------------------------------
def test_a_hit_carries_op_now_token_and_seven_values_per_tier() -> None:
    policy = rl.Policy("2/second;5/minute", algorithm="gcra", name="api")
    call = codec.build(codec.HIT, [codec.Check(policy, "u", 3)], "rl", now_us=NOW_US)
    assert call.op == codec.HIT
    assert call.args[:5] == [codec.HIT, NOW_US, "", "", 2]
    assert call.keys == ["rl:{u}:api.gc:1000", "rl:{u}:api.gc:60000"]
    assert tier_args(call) == [["gc", 2, 1000, 3, 0, "", ""], ["gc", 5, 60_000, 3, 0, "", ""]]


def test_without_a_clock_the_script_reads_redis_time() -> None:
    call = codec.build(codec.HIT, [codec.Check(rl.Policy("1/second"), "u")], "rl")
    assert call.args[1] == ""


def test_sliding_log_hits_carry_a_fresh_token_and_other_ops_none() -> None:
    log = rl.Policy("3/minute")
    tokens = {codec.build(codec.HIT, [codec.Check(log, "u")], "rl").args[2] for _ in range(100)}
    assert len(tokens) == 100 and "" not in tokens
    assert codec.build(codec.PEEK, [codec.Check(log, "u")], "rl").args[2] == ""
    assert codec.build(codec.HIT, [codec.Check(rl.Policy("3/minute", algorithm="gcra"), "u")],
                      "rl").args[2] == ""


def test_a_peek_asks_about_a_cost_of_one() -> None:
    call = codec.build(codec.PEEK, [codec.Check(rl.Policy("5/minute"), "u", 4)], "rl")
    assert [t[3] for t in tier_args(call)] == [1]


def test_ban_keys_follow_the_tier_keys_and_tiers_point_at_them() -> None:
    plain = rl.Policy("5/minute", name="plain")
    banned = rl.Policy("1/second;9/hour", name="b", penalty=30, algorithm="fixed-window")
    call = codec.build(codec.HIT, [codec.Check(plain, "u"), codec.Check(banned, "v")], "rl",
                      now_us=NOW_US)
    assert call.keys == ["rl:{u}:plain.sl:log", "rl:{v}:b.fw:1000", "rl:{v}:b.fw:3600000",
                         "rl:{v}:b.fw:ban"]
    assert [t[4] for t in tier_args(call)] == [0, 4, 4]
    assert [t[5] for t in tier_args(call)] == ["", "d30000", "d30000"]
    peek = codec.build(codec.PEEK, [codec.Check(banned, "v")], "rl")
    assert [t[4:6] for t in tier_args(peek)] == [[3, ""], [3, ""]]  # reads the ban, starts none


def test_a_calendar_policy_sends_its_zone_s_offset_schedule_for_day_tiers_only() -> None:
    policy = rl.Policy("5/hour;100/day", algorithm="fixed-window", tz="Asia/Shanghai")
    clock_ms = NOW_US // 1000
    call = codec.build(codec.HIT, [codec.Check(policy, "u")], "rl", clock_ms=clock_ms)
    hour, day = tier_args(call)
    assert hour[6] == ""
    assert day[6] == "28800000"  # UTC+8 all along: no boundary, no change of offset
    plain = rl.Policy("100/day", algorithm="fixed-window")
    assert tier_args(codec.build(codec.HIT, [codec.Check(plain, "u")], "rl"))[0][6] == ""


def test_a_batch_gives_back_several_hits_in_one_call_each_tier_with_its_hit_s_token() -> None:
    slots = rl.Policy.in_flight(4, name="export")
    rate = rl.Policy("2/minute;5/hour", algorithm="fixed-window", penalty=60)
    checks = [codec.Check(slots, "u"), codec.Check(rate, "u"), codec.Check(slots, "u")]
    call = codec.build(codec.REFUND, checks, "rl", tokens=["t1", "t1", "t2"])
    # Both hits of the same slots count (the same policy and identity, two tokens); every
    # tier carries its hit's token; the ban key follows the tier keys, as in any call.
    assert call.args[2:5] == ["t1 t1 t1 t2", "", 4]
    assert call.keys[0] == call.keys[3] and len(call.keys) == 5
    assert call.layout == tuple((check.policy, check.identity) for check in checks)
    # One hit's batch is its plain give-back.
    assert codec.build(codec.REFUND, checks[:2], "rl", tokens=["t1", "t1"]).args[2] == "t1"
    for op, tokens in [(codec.HIT, ["t1", "t1", "t2"]), (codec.REFUND, ["t1", "", "t2"]),
                       (codec.REFUND, ["t1", "t1"]), (codec.REFUND, ["t1", "t 1", "t2"])]:
        with pytest.raises(ValueError):
            codec.build(op, checks, "rl", tokens=tokens)


def test_the_lua_source_is_read_at_first_use_not_at_import() -> None:
    code = ("import ratelimit_mw, ratelimit_mw.backends.redis\n"
            "from ratelimit_mw.core import scripts\n"
            "assert scripts.source.cache_info().currsize == 0\n"
            "assert scripts.sha1() == __import__('hashlib').sha1(scripts.source().encode())"
            ".hexdigest()\n"
            "assert scripts.source.cache_info().currsize == 1\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_same_policy_object_for_the_same_identity_counts_once() -> None:
    policy = rl.Policy("5/minute")
    call = codec.build(codec.HIT, [codec.Check(policy, "u"), codec.Check(policy, "u"),
                                 codec.Check(policy, "w")], "rl")
    assert call.args[4] == 2
    assert call.keys == ["rl:{u}:5/minute.sl:log", "rl:{w}:5/minute.sl:log"]


def test_a_booking_call_carries_the_time_and_remembers_its_token() -> None:
    policy = rl.Policy("1/minute")
    call = codec.build(codec.BOOK, [codec.Check(policy, "u", 2)], "rl", at_ms=1_900_000_000_000)
    assert call.args[3] == 1_900_000_000_000
    assert call.booking == rl.Booking(policy, "u", call.args[2], 2, 1_900_000_000_000)
    assert call.args[2]


def test_building_nothing_is_a_configuration_error() -> None:
    with pytest.raises(rl.ConfigurationError):
        codec.build(codec.HIT, [], "rl")


def test_tokens_are_unique_within_a_process_and_renewed_after_fork() -> None:
    tokens = {codec.new_token() for _ in range(10_000)}
    assert len(tokens) == 10_000
    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.write(write, codec.new_token().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 100).decode()
    os.close(read)
    os.close(write)
    parent = codec.new_token()
    assert child and child[:8] != parent[:8]


# -- decide ---------------------------------------------------------------------------------
def _reply(allowed: int, *tiers: tuple[int, int, int, int, int]) -> list[int]:
    return [allowed, *(v for tier in tiers for v in tier)]


def test_decide_reads_an_admitted_reply_governed_by_the_least_remaining() -> None:
    policy = rl.Policy("5/minute;3/hour", algorithm="gcra")
    call = codec.build(codec.HIT, [codec.Check(policy, "u")], "rl")
    decision = codec.decoded(call, _reply(1, (1, 4, 0, 12_000, 0), (1, 2, 0, 1_200_000, 0)))
    assert decision.allowed and bool(decision)
    assert (decision.limit, decision.remaining, decision.reset_after) == (3, 2, 1200.0)
    assert decision.rate == rl.Rate(3, 3_600_000) and decision.retry_after == 0.0
    assert [t.remaining for t in decision.tiers] == [4, 2]


def test_decide_on_equal_remaining_prefers_the_later_reset() -> None:
    policy = rl.Policy("5/minute;5/hour", algorithm="gcra")
    call = codec.build(codec.HIT, [codec.Check(policy, "u")], "rl")
    decision = codec.decoded(call, _reply(1, (1, 4, 0, 12_000, 0), (1, 4, 0, 720_000, 0)))
    assert decision.rate == rl.Rate(5, 3_600_000)


@pytest.mark.parametrize(("algorithms", "governing"), [
    (["fixed-window"], 0),  # one tier governs itself
    (["concurrency"], 0),
    (["fixed-window", "concurrency"], 0),  # one rate among slots: the rate, always
    (["concurrency", "gcra"], 1),
    (["concurrency", "sliding-log", "concurrency"], 1),
    (["fixed-window", "gcra"], None),  # two rates: the remaining counts decide
    (["concurrency", "concurrency"], None),  # slots alone: likewise
])
def test_the_governing_tier_is_fixed_where_the_layout_alone_decides_it(
        algorithms: list[str], governing: int | None) -> None:
    assert codec.governing_tier(algorithms) == governing


def test_a_fixed_governing_tier_decides_as_the_ranking_does() -> None:
    rate, slots = rl.Policy("5/minute"), rl.Policy.in_flight(2)
    call = codec.build(codec.HIT, [codec.Check(rate, "u"), codec.Check(slots, "u")], "rl")
    # The slots have less left than the rate: the rate governs all the same.
    reply = _reply(1, (1, 4, 0, 12_000, 0), (1, 1, 0, 30_000, 0))
    ranked = codec.decoded(call, reply)
    fixed = codec.admitted_decision(ranked.tiers, ranked.at_us, None,
                                    codec.governing_tier(["fixed-window", "concurrency"]))
    assert ranked.policy is rate and fixed == ranked


@pytest.mark.parametrize(("policies", "slotted"), [
    (["5/minute", "in-flight"], True),  # a route's limit with ``concurrency``
    (["5/minute"], False),
    (["in-flight", "5/minute"], False),  # the slots first: read by the loop
    (["5/minute;100/hour", "in-flight"], False),  # two rates: likewise
    (["5/minute", "in-flight", "in-flight"], False),
    (["5/minute", "10/minute"], False),
])
def test_a_rate_and_then_slots_is_known_as_such_when_compiled(policies: list[str],
                                                              slotted: bool) -> None:
    items = [(rl.Policy.in_flight(2, name=f"s{i}") if text == "in-flight"
              else rl.Policy(text, name=f"r{i}"), 1) for i, text in enumerate(policies)]
    assert Compiled(items, "rl").slotted is slotted


@given(remaining=st.integers(-2, 10**9), free=st.integers(-2, 10**9),
       resets=st.tuples(st.integers(0, 10**12), st.integers(0, 10**12)),
       bans=st.tuples(st.booleans(), st.booleans()), at_us=st.none() | st.integers(0, 2**62))
def test_a_rate_and_then_slots_admitted_reply_reads_as_every_reply_does(
        remaining: int, free: int, resets: tuple[int, int], bans: tuple[bool, bool],
        at_us: int | None) -> None:
    """`codec.decoded` reads this shape's admitted reply without the loop: the Decision that
    `decode_generic` reads, the rate governing, with the store's clock or without it."""
    compiled = Compiled([(rl.Policy("5/minute"), 1), (rl.Policy.in_flight(2), 1)], "rl")
    call = compiled.call(("u", "v"))
    reply = _reply(1, (1, remaining, 0, resets[0], int(bans[0])),
                   (1, free, 0, resets[1], int(bans[1])))
    if at_us is not None:
        reply.append(at_us)
    decision = codec.decoded(call, reply)
    assert decision == codec.decode_generic(call.layout, reply, call.booking, compiled.governs)
    assert decision.identity == "u" and decision.tiers[1].identity == "v"


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3), st.sampled_from([1.0, 2.0])),
                min_size=1, max_size=5))
def test_an_admitted_decision_is_governed_by_its_first_least_ranked_tier(
        drawn: list[tuple[bool, int, float]]) -> None:
    """A rate before slots, then the least remaining, then the later reset; of tiers that
    tie on all three, the first."""
    rate, slots = rl.Policy("5/minute"), rl.Policy.in_flight(5)
    tiers = [TierState(slots if held else rate, (slots if held else rate).rates[0], f"t{i}",
                       True, left, 0.0, reset, False)
             for i, (held, left, reset) in enumerate(drawn)]
    ranks = [(held, left, -reset) for held, left, reset in drawn]
    decision = codec.admitted_decision(tiers, 0)
    assert decision.identity == f"t{ranks.index(min(ranks))}"
    assert decision.tiers == tuple(tiers)


def test_decide_picks_the_refusing_tier_with_the_longest_wait() -> None:
    a = rl.Policy("1/second", name="a")
    b = rl.Policy("2/minute", name="b")
    call = codec.build(codec.HIT, [codec.Check(a, "u"), codec.Check(b, "v")], "rl")
    decision = codec.decoded(call, _reply(0, (0, 0, 400, 400, 0), (0, 0, 30_000, 59_000, 0)))
    assert not decision.allowed and decision.policy is b and decision.identity == "v"
    assert decision.retry_after == 30.0 and decision.reset_after == 59.0
    only_a = codec.decoded(call, _reply(0, (0, 0, 400, 400, 0), (1, 1, 0, 2_000, 0)))
    assert only_a.policy is a and only_a.retry_after == 0.4


def test_decide_reads_never_as_infinity_and_clamps_remaining() -> None:
    call = codec.build(codec.HIT, [codec.Check(rl.Policy("3/minute"), "u", 9)], "rl")
    decision = codec.decoded(call, _reply(0, (0, -2, -1, 0, 0)))
    assert decision.retry_after == math.inf and decision.remaining == 0


def test_decide_reports_a_ban() -> None:
    call = codec.build(codec.HIT, [codec.Check(rl.Policy("3/minute", penalty=60), "u")], "rl")
    decision = codec.decoded(call, _reply(0, (0, 0, 60_000, 60_000, 1)))
    assert decision.banned and decision.retry_after == 60.0


# -- several slots (cluster) ----------------------------------------------------------------
def test_checks_are_grouped_by_identity_in_first_seen_order() -> None:
    p, q = rl.Policy("1/second"), rl.Policy("2/second")
    checks = [codec.Check(p, "a"), codec.Check(q, "b"), codec.Check(q, "a")]
    assert codec.group_by_slot(checks) == [[checks[0], checks[2]], [checks[1]]]


def test_refund_of_a_call_keeps_its_keys_costs_and_token() -> None:
    call = codec.build(codec.HIT, [codec.Check(rl.Policy("3/minute"), "u", 2)], "rl",
                      now_us=NOW_US)
    refund = codec.refund_of(call)
    assert refund.op == codec.REFUND and refund.args[0] == codec.REFUND
    assert refund.keys == call.keys and refund.args[1:] == call.args[1:]


class Scripted:
    """A cluster backend answering each call with the next reply given (a refund: [1]) and
    recording the operations it was asked."""

    is_cluster = True

    def __init__(self, replies: Sequence[list[int]]) -> None:
        self.replies = iter(replies)
        self.asked: list[str] = []

    def run(self, call: codec.ScriptCall, deadline: float | None = None) -> list[int]:
        self.asked.append(call.op)
        return [1] if call.op == codec.REFUND else next(self.replies)


def _across(checks: Sequence[codec.Check], replies: Sequence[list[int]]
            ) -> tuple[rl.Decision, list[str]]:
    """A hit of `checks`, one identity per cluster slot: its decision and the ops asked."""
    backend = Scripted(replies)
    return rl.Limiter(backend, deny_cache=0).check(checks), backend.asked  # type: ignore[arg-type]


def test_a_refusal_in_one_slot_gives_back_what_the_others_recorded() -> None:
    p = rl.Policy("5/minute", name="p")
    decision, asked = _across([codec.Check(p, identity) for identity in "abc"],
                              [_reply(1, (1, 4, 0, 60_000, 0)), _reply(0, (0, 0, 9_000, 60_000, 0)),
                               _reply(1, (1, 2, 0, 60_000, 0))])
    # Every slot is asked, as one script asks every tier, but after the refusal as a peek,
    # which records nothing: only the first slot has a hit to give back.
    assert asked == [codec.HIT, codec.HIT, codec.PEEK, codec.REFUND]
    assert not decision.allowed and decision.identity == "b" and decision.retry_after == 9.0
    assert len(decision.tiers) == 3


def test_slots_that_refuse_after_the_first_refusal_still_govern_the_retry() -> None:
    # Stopping at the first refusal answered its 1 s wait where a later slot refused for an
    # hour: a client obeying Retry-After was refused again.
    short, long = rl.Policy("5/second", name="short"), rl.Policy("5/hour", name="long")
    decision, asked = _across([codec.Check(short, "a"), codec.Check(long, "b")],
                              [_reply(0, (0, 0, 1_000, 1_000, 0)),
                               _reply(0, (0, 0, 3_600_000, 3_600_000, 0))])
    assert asked == [codec.HIT, codec.PEEK]  # nothing recorded, nothing to give back
    assert decision.retry_after == 3600.0 and decision.policy is long


def _short_then_banning() -> list[codec.Check]:
    """Two slots: a 5/second policy refusing for 1 s, then a 5/hour one with a penalty."""
    short = rl.Policy("5/second", name="short")
    banning = rl.Policy("5/hour", name="banning", penalty="2 hours")
    return [codec.Check(short, "a"), codec.Check(banning, "b")]


def test_a_later_slot_refusing_under_a_penalty_is_hit_to_start_its_ban() -> None:
    decision, asked = _across(_short_then_banning(), [
        _reply(0, (0, 0, 1_000, 1_000, 0)), _reply(0, (0, 0, 3_600_000, 3_600_000, 0)),
        _reply(0, (0, 0, 7_200_000, 7_200_000, 1))])
    assert asked == [codec.HIT, codec.PEEK, codec.HIT]
    assert decision.banned and decision.retry_after == 7200.0


def test_a_later_slot_that_admits_its_penalty_hit_after_all_gives_it_back() -> None:
    decision, asked = _across(_short_then_banning(), [
        _reply(0, (0, 0, 1_000, 1_000, 0)), _reply(0, (0, 0, 3_600_000, 3_600_000, 0)),
        _reply(1, (1, 0, 0, 3_600_000, 0))])  # a refund elsewhere came in between
    assert asked == [codec.HIT, codec.PEEK, codec.HIT, codec.REFUND]
    assert not decision.allowed and decision.retry_after == 1.0


def test_merged_slots_are_governed_like_tiers() -> None:
    p = rl.Policy("5/minute", name="p")
    decision, asked = _across([codec.Check(p, identity) for identity in "ab"],
                              [_reply(1, (1, 4, 0, 60_000, 0)), _reply(1, (1, 1, 0, 30_000, 0))])
    assert asked == [codec.HIT, codec.HIT]
    assert decision.allowed and decision.identity == "b" and decision.remaining == 1


# -- acquire --------------------------------------------------------------------------------
def _refused(retry: float) -> rl.Decision:
    return rl.Decision(allowed=False, limit=1, remaining=0, retry_after=retry, reset_after=retry)


@pytest.mark.parametrize("retry", [0.001, 0.3, 5.0, 120.0])
def test_acquire_waits_retry_after_plus_a_little_jitter(retry: float) -> None:
    rng = random.Random(1)
    waits = [codec.acquire_wait(_refused(retry), 0.0, None, rng) for _ in range(200)]
    assert all(w is not None and retry <= w <= retry + min(0.05, retry * 0.1 + 0.001)
               for w in waits)
    assert len(set(waits)) > 1


def test_acquire_gives_up_on_never_and_past_its_timeout() -> None:
    rng = random.Random(1)
    assert codec.acquire_wait(_refused(math.inf), 0.0, None, rng) is None
    assert codec.acquire_wait(_refused(3.0), 8.0, 10.0, rng) is None
    assert codec.acquire_wait(_refused(2.0), 8.0, 10.0, rng) is not None


@pytest.mark.parametrize("timeout", [-1, True])
def test_acquire_rejects_a_bad_timeout(timeout: object) -> None:
    with pytest.raises(rl.ConfigurationError, match="timeout"):
        rl.Limiter().acquire("1/second", "u", timeout=timeout)  # type: ignore[arg-type]


@pytest.mark.parametrize(("retry", "waited", "timeout"),
                         [(1.0, 0.0, 1.0), (0.5, 0.49, 1.0), (0.3, 0.0, 0.31), (2.0, 8.0, 10.0)])
def test_acquire_jitter_never_carries_a_wait_past_the_timeout(
    retry: float, waited: float, timeout: float
) -> None:
    # A retry due just inside the timeout is still taken, and the jitter (up to 50 ms) that
    # spreads a fleet out is cut to what is left: acquire(timeout=1.0) answered after 1.025 s.
    rng = random.Random(7)
    waits = [codec.acquire_wait(_refused(retry), waited, timeout, rng) for _ in range(200)]
    assert all(w is not None and retry <= w <= timeout - waited for w in waits)
