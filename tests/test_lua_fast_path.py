"""The script's shortcuts against its general loop (lua/main.lua).

The shortcuts answer the common hits without the loop: a hit on one tier without a penalty
(each algorithm's check written out inline), and a hit on epoch-aligned fixed windows and
in-flight slots without a penalty, of one policy or several. The reference is the same script
with both shortcut blocks switched off (`if false and ...`), so the general loop decides every
call.

Hypothesis draws policies and a sequence of hits, peeks and bookings (entries ahead of now,
which the sliding log's shortcut must see); each call runs on two fresh fakeredis servers,
through the script on one and through the reference on the other. The replies must be equal,
value for value (a refusal's deny-cache values included), and so must the servers' keys after
every call: values, sorted-set entries and TTLs. fakeredis's wall clock is held still during
each call, so TTLs compare to the millisecond. Each example runs under one of two clocks:

- a test clock: the call carries `now` (ARGV[2]), as in tests/test_differential.py, and keys
  expire by the fake clock only (EXTEND there);
- Redis's own clock, as in production (ARGV[2] empty): fakeredis's wall clock is set to the
  step's time, so the script's TIME, the keys' expiry and the writes that keep a key's TTL
  (KEEPTTL) all run on it.

(The memory backend is the reference for the whole script in tests/test_differential.py; this
file pins each shortcut to the loop it shortcuts.)
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager
from unittest import mock

import fakeredis
import redis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_differential import EXTEND

import ratelimit_mw as rl
from ratelimit_mw.core import codec, scripts

START_MS = 1_800_000_000_000
# The first line of each shortcut block in lua/main.lua: one tier, then several fixed windows.
SHORTCUTS = ("if n == 1 and op == 'H' and argv[10] == '0' and argv[6] ~= 'cc' then",
            "if op == 'H' and (n > 1 or argv[6] == 'cc') then")


@functools.cache
def without_shortcuts() -> str:
    """The script with its shortcut blocks switched off: the general loop decides every call."""
    source = scripts.source()
    for line in SHORTCUTS:
        if source.count(line) != 1:
            raise AssertionError(f"lua/main.lua has no single shortcut line {line!r}: "
                                 "update SHORTCUTS to the script's shortcut blocks")
        source = source.replace(line, line.replace("if ", "if false and ", 1))
    return source


def wall_clock(now_ms: int) -> AbstractContextManager[object]:
    """fakeredis's wall clock standing at `now_ms` for the duration: TIME, expiry, TTLs."""
    return mock.patch("time.time", return_value=now_ms / 1000)


def state(client: redis.Redis) -> dict[bytes, tuple[bytes, object, int]]:
    """Every key's type, value (a sorted set's entries with their scores) and TTL."""
    held: dict[bytes, tuple[bytes, object, int]] = {}
    for key in client.scan_iter():
        kind = client.type(key)
        value = client.get(key) if kind == b"string" else client.zrange(key, 0, -1,
                                                                       withscores=True)
        held[key] = (kind, value, client.pttl(key))
    return held


def run(client: redis.Redis, source: str, call: codec.ScriptCall, own_clock: bool) -> list[int]:
    pipe = client.pipeline(transaction=True)
    pipe.eval(source, len(call.keys), *call.keys, *call.args)
    if not own_clock:
        # A test clock: keys expire by it only (see EXTEND in test_differential).
        pipe.eval(EXTEND, len(call.keys), *call.keys)
    return list(pipe.execute()[0])


def compare(fast: redis.Redis, loop: redis.Redis, call: codec.ScriptCall, now_ms: int,
            own_clock: bool) -> None:
    """Run `call` through the script and through the reference: same replies, same keys."""
    with wall_clock(now_ms):
        expected = run(loop, without_shortcuts(), call, own_clock)
        actual = run(fast, scripts.source(), call, own_clock)
        assert actual == expected, (call.args, actual, expected)
        assert state(fast) == state(loop), call.args


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    algorithm=st.sampled_from(sorted(rl.ALGORITHMS)),
    limit=st.sampled_from([1, 2, 3, 5]),
    period=st.sampled_from([1_000, 5_000, 60_000]),
    own_clock=st.booleans(),
    steps=st.lists(st.tuples(st.sampled_from([0, 0, 1, 300, 999, 1_000, 4_000, 61_000]),
                             st.sampled_from(["hit", "hit", "hit", "peek", "book"]),
                             st.sampled_from([1, 1, 2, 6]),
                             st.sampled_from([0, 500, 3_000])),
                   min_size=5, max_size=40),
)
# A booking ahead, then a hit the one-tier path admits: its reset must reach past the booking.
@example(algorithm="sliding-log", limit=5, period=60_000, own_clock=False,
         steps=[(0, "book", 1, 3_000), (0, "hit", 1, 0), (1, "hit", 2, 0)])
# An entry exactly one period old has left the window: counted by neither path, and trimmed.
@example(algorithm="sliding-log", limit=3, period=1_000, own_clock=False,
         steps=[(0, "hit", 1, 0), (1_000, "hit", 1, 0), (999, "hit", 1, 0), (1, "hit", 1, 0)])
# Writes inside one window on Redis's clock keep the key's TTL (KEEPTTL).
@example(algorithm="sliding-window", limit=5, period=5_000, own_clock=True,
         steps=[(0, "hit", 1, 0), (300, "hit", 1, 0), (4_000, "hit", 2, 0), (999, "hit", 1, 0),
                (1, "hit", 1, 0)])
def test_one_tier_path_answers_as_the_general_loop(
    algorithm: str, limit: int, period: int, own_clock: bool,
    steps: list[tuple[int, str, int, int]],
) -> None:
    policy = rl.Policy([rl.Rate(limit, period)], algorithm=algorithm, name="fast")
    fast = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    loop = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    now_ms = START_MS
    for advance, kind, cost, ahead in steps:
        now_ms += advance
        check = [codec.Check(policy, "a", cost)]
        now_us = None if own_clock else now_ms * 1000
        if kind == "book" and algorithm == "sliding-log":
            call = codec.build(codec.BOOK, check, "f", now_us=now_us, at_ms=now_ms + ahead,
                               clock_ms=now_ms)
        else:
            call = codec.build(codec.PEEK if kind == "peek" else codec.HIT, check, "f",
                               now_us=now_us, clock_ms=now_ms)
        compare(fast, loop, call, now_ms, own_clock)


FIXED_WINDOW_RATES = st.lists(
    st.tuples(st.sampled_from([1, 2, 3, 5, 40]), st.sampled_from([1_000, 5_000, 60_000])),
    min_size=1, max_size=3, unique_by=lambda rate: rate[1])


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pool=st.lists(FIXED_WINDOW_RATES, min_size=1, max_size=3),
    # The last policy of the pool may be of another algorithm: a call with one such tier must
    # leave the shortcut for the loop on both servers.
    other=st.sampled_from([None, None, "sliding-window", "gcra", "sliding-log", "concurrency",
                           "concurrency"]),
    # Namesakes: policies of one name whose tiers of one period share a key.
    namesakes=st.booleans(),
    own_clock=st.booleans(),
    steps=st.lists(st.tuples(st.sampled_from([0, 0, 1, 300, 999, 1_000, 4_000, 61_000]),
                             st.sampled_from(["hit", "hit", "hit", "peek", "release"]),
                             st.lists(st.tuples(st.integers(0, 2), st.sampled_from("ab"),
                                                st.sampled_from([1, 1, 2, 6])),
                                      min_size=1, max_size=3)),
                   min_size=5, max_size=40),
)
# A policy of two tiers whose second refuses after the first admits: nothing may be written.
@example(pool=[[(5, 1_000), (2, 60_000)]], other=None, namesakes=False, own_clock=False,
         steps=[(0, "hit", [(0, "a", 1)]), (0, "hit", [(0, "a", 1)]),
                (0, "hit", [(0, "a", 1)]), (1_000, "peek", [(0, "a", 1)])])
def test_several_fixed_window_tiers_answer_as_the_general_loop(
    pool: list[list[tuple[int, int]]], other: str | None, namesakes: bool, own_clock: bool,
    steps: list[tuple[int, str, list[tuple[int, str, int]]]],
) -> None:
    policies = [rl.Policy([rl.Rate(limit, period) for limit, period in rates],
                          algorithm="fixed-window", name="p" if namesakes else f"p{i}")
                for i, rates in enumerate(pool)]
    if other == "concurrency":  # in-flight slots: the shortcut takes them beside the windows
        limit, period = pool[-1][0]
        policies[-1] = rl.Policy.in_flight(limit, lease=period / 1000, name="other")
    elif other is not None:
        policies[-1] = rl.Policy(policies[-1].rates, algorithm=other, name="other")
    fast = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    loop = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    now_ms = START_MS
    held: list[tuple[codec.ScriptCall, list[codec.Check]]] = []  # hits that hold slots
    for advance, kind, picks in steps:
        now_ms += advance
        now_us = None if own_clock else now_ms * 1000
        if kind == "release":
            if held:
                hit, checks = held.pop()
                compare(fast, loop, codec.build(codec.REFUND, checks, "f", now_us=now_us,
                                                token=hit.args[2]), now_ms, own_clock)
            continue
        checks = [codec.Check(policies[index % len(policies)], identity, cost)
                  for index, identity, cost in picks]
        call = codec.build(codec.PEEK if kind == "peek" else codec.HIT, checks, "f",
                           now_us=now_us, clock_ms=now_ms)
        compare(fast, loop, call, now_ms, own_clock)
        if kind == "hit" and call.args[2]:
            held.append((call, checks))
