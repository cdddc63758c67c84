"""The script's shortcuts (lua/main.lua: a hit on one tier without a penalty; a hit on
epoch-aligned fixed windows without a penalty, of one policy or several) against its general
loop.

The general loop takes a call whose ban index is not the literal "0"; "00" is the same index
(no penalty) written so that the one-tier path does not recognise it. A refused hit's three
trailing values for the deny cache are left out of the comparison: with a ban index other than
"0" the loop declares them unstable (a penalty might start later), by design; the one-tier
path never writes them (a refusal goes on to the loop, which is what is compared here).
Hypothesis draws a one-tier policy of every algorithm and a sequence of hits, peeks and
bookings (entries ahead of now, which the sliding log's one-tier path must see); each call runs
on two fresh fakeredis servers, plainly on one and with "00" on the other, and the replies must
be equal, reply for reply, and so must the servers' keys after every call: values, sorted-set
entries and TTLs (fakeredis's wall clock stands still during the calls, so TTLs compare to the
millisecond). (The memory backend is the reference for both in
tests/test_differential.py; this one pins the shortcut to the loop it shortcuts.)
The several-tier fixed-window path is held to the loop the same way, on hits of one to three
policies at once ("00" as the first tier's ban index sends the call to the loop).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from unittest import mock

import fakeredis
import redis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_differential import EXTEND

import ratelimit_mw as rl
from ratelimit_mw.core import plans, scripts

START_MS = 1_800_000_000_000
BAN_INDEX = 9  # ARGV position (0-based) of tier 1's ban index: 5 head values, then 4 more
DENY_CACHE = 6  # a refused hit's reply: all, 5 values for the tier, then the deny cache's 3


FROZEN_S = 1_700_000_000.0  # fakeredis's wall clock while the calls run (see frozen below)


def frozen() -> AbstractContextManager[object]:
    """fakeredis's wall clock standing still: TTLs set by the two servers compare exactly."""
    return mock.patch("time.time", return_value=FROZEN_S)


def state(client: redis.Redis) -> dict[bytes, tuple[bytes, object, int]]:
    """Every key's type, value (a sorted set's entries with their scores) and TTL."""
    held: dict[bytes, tuple[bytes, object, int]] = {}
    for key in client.scan_iter():
        kind = client.type(key)
        value = client.get(key) if kind == b"string" else client.zrange(key, 0, -1,
                                                                       withscores=True)
        held[key] = (kind, value, client.pttl(key))
    return held


def run(client: redis.Redis, call: plans.ScriptCall, args: list[object]) -> list[int]:
    # As in test_differential: keys expire by the fake clock only (see EXTEND there).
    pipe = client.pipeline(transaction=True)
    pipe.eval(scripts.source(), len(call.keys), *call.keys, *args)
    pipe.eval(EXTEND, len(call.keys), *call.keys)
    reply, _ = pipe.execute()
    return list(reply)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    algorithm=st.sampled_from(sorted(rl.ALGORITHMS)),
    limit=st.sampled_from([1, 2, 3, 5]),
    period=st.sampled_from([1_000, 5_000, 60_000]),
    steps=st.lists(st.tuples(st.sampled_from([0, 0, 1, 300, 999, 1_000, 4_000, 61_000]),
                             st.sampled_from(["hit", "hit", "hit", "peek", "book"]),
                             st.sampled_from([1, 1, 2, 6]),
                             st.sampled_from([0, 500, 3_000])),
                   min_size=5, max_size=40),
)
# A booking ahead, then a hit the one-tier path admits: its reset must reach past the booking.
@example(algorithm="sliding-log", limit=5, period=60_000,
         steps=[(0, "book", 1, 3_000), (0, "hit", 1, 0), (1, "hit", 2, 0)])
# An entry exactly one period old has left the window: counted by neither path, and trimmed.
@example(algorithm="sliding-log", limit=3, period=1_000,
         steps=[(0, "hit", 1, 0), (1_000, "hit", 1, 0), (999, "hit", 1, 0), (1, "hit", 1, 0)])
def test_one_tier_path_answers_as_the_general_loop(
    algorithm: str, limit: int, period: int, steps: list[tuple[int, str, int, int]]
) -> None:
    policy = rl.Policy([rl.Rate(limit, period)], algorithm=algorithm, name="fast")
    fast = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    loop = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    now_ms = START_MS
    for advance, kind, cost, ahead in steps:
        now_ms += advance
        check = [plans.Check(policy, "a", cost)]
        if kind == "book" and algorithm == "sliding-log":
            call = plans.build(plans.BOOK, check, "f", now_us=now_ms * 1000,
                               at_ms=now_ms + ahead, clock_ms=now_ms)
        else:
            call = plans.build(plans.PEEK if kind == "peek" else plans.HIT, check, "f",
                               now_us=now_ms * 1000, clock_ms=now_ms)
        if call.op == plans.HIT:
            assert call.args[BAN_INDEX] == 0, call.args  # the shape the one-tier path takes
        plain = list(call.args)
        spelled = list(call.args)
        spelled[BAN_INDEX] = "00"
        with frozen():
            expected = run(loop, call, spelled)
            actual = run(fast, call, plain)
            assert state(fast) == state(loop), call.args
        if call.op == plans.HIT and expected[0] == 0:
            del actual[DENY_CACHE:], expected[DENY_CACHE:]
        assert actual == expected, (call.args, actual, expected)


def tier_index_of_ban(tier: int) -> int:
    """ARGV position (0-based) of tier `tier`'s (0-based) ban index."""
    return BAN_INDEX + 7 * tier


FIXED_WINDOW_RATES = st.lists(
    st.tuples(st.sampled_from([1, 2, 3, 5, 40]), st.sampled_from([1_000, 5_000, 60_000])),
    min_size=1, max_size=3, unique_by=lambda rate: rate[1])


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pool=st.lists(FIXED_WINDOW_RATES, min_size=1, max_size=3),
    # The last policy of the pool may be of another algorithm: a call with one such tier must
    # leave the shortcut for the loop on both servers.
    other=st.sampled_from([None, None, "sliding-window", "gcra", "sliding-log"]),
    steps=st.lists(st.tuples(st.sampled_from([0, 0, 1, 300, 999, 1_000, 4_000, 61_000]),
                             st.sampled_from(["hit", "hit", "hit", "peek"]),
                             st.lists(st.tuples(st.integers(0, 2), st.sampled_from("ab"),
                                                st.sampled_from([1, 1, 2, 6])),
                                      min_size=1, max_size=3)),
                   min_size=5, max_size=40),
)
# A policy of two tiers whose second refuses after the first admits: nothing may be written.
@example(pool=[[(5, 1_000), (2, 60_000)]], other=None,
         steps=[(0, "hit", [(0, "a", 1)]), (0, "hit", [(0, "a", 1)]),
                (0, "hit", [(0, "a", 1)]), (1_000, "peek", [(0, "a", 1)])])
def test_several_fixed_window_tiers_answer_as_the_general_loop(
    pool: list[list[tuple[int, int]]], other: str | None,
    steps: list[tuple[int, str, list[tuple[int, str, int]]]],
) -> None:
    policies = [rl.Policy([rl.Rate(limit, period) for limit, period in rates],
                          algorithm="fixed-window", name=f"p{i}")
                for i, rates in enumerate(pool)]
    if other is not None:
        policies[-1] = rl.Policy(policies[-1].rates, algorithm=other, name="other")
    fast = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    loop = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    now_ms = START_MS
    for advance, kind, picks in steps:
        now_ms += advance
        checks = [plans.Check(policies[index % len(policies)], identity, cost)
                  for index, identity, cost in picks]
        call = plans.build(plans.PEEK if kind == "peek" else plans.HIT, checks, "f",
                           now_us=now_ms * 1000, clock_ms=now_ms)
        tiers = int(call.args[4])
        if call.op == plans.HIT:
            # No penalty anywhere: the shape the shortcuts take.
            assert all(call.args[tier_index_of_ban(t)] == 0 for t in range(tiers)), call.args
        plain = list(call.args)
        spelled = list(call.args)
        spelled[BAN_INDEX] = "00"
        with frozen():
            expected = run(loop, call, spelled)
            actual = run(fast, call, plain)
            assert state(fast) == state(loop), call.args
        if call.op == plans.HIT and expected[0] == 0:
            # As above: the loop's deny-cache values differ by design under "00".
            del actual[1 + 5 * tiers:], expected[1 + 5 * tiers:]
        assert actual == expected, (call.args, actual, expected)
