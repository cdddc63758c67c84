"""MemoryBackend and the Lua script on the real Redis must give identical answers.

Hypothesis draws policies (every algorithm, one to three tiers, with and without a penalty,
calendar days) and a sequence of operations: time advances, hits of several policies at once
under several identities, peeks, refunds, resets, bookings and cancellations. Each operation
is built ONCE (same keys, same explicit `now`, same token) and run on both backends; the raw
replies must be equal, reply for reply. A fresh key prefix per example keeps the shared Redis
clean, and the example's keys are deleted at its end.

The scripts take the fake clock's `now`, but Redis expires keys by its own clock: a key written
with a 1 ms TTL at a standing fake time would vanish between two calls, which never happens in
production (there both clocks are Redis's). So on the Redis side each call runs in a MULTI with
a second script that pushes the TTLs it just set ten minutes out: keys then expire only in the
memory twin, by the fake clock. Agreement thus also proves that expiry is garbage collection
only: every value says itself when it is stale.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.exceptions import NoScriptError

import ratelimit_mw as rl
from ratelimit_mw import core
from ratelimit_mw._scripts import SHA1, SOURCE

START_MS = 1_800_000_000_000
PERIODS = [1_000, 2_000, 5_000, 10_000, 60_000]
IDENTITIES = ["a", "b", "c"]


@dataclass(frozen=True)
class Op:
    advance_ms: int
    kind: str
    picks: tuple[tuple[int, int, int], ...]  # (policy index, identity index, cost)
    offset_ms: int  # a booking's time relative to now


@st.composite
def policies(draw: st.DrawFn) -> rl.Policy:
    algorithm = draw(st.sampled_from(sorted(rl.ALGORITHMS)))
    periods = draw(st.lists(st.sampled_from(PERIODS), min_size=1, max_size=3, unique=True))
    if algorithm == "fixed-window" and draw(st.booleans()):
        periods = [*periods[:2], 86_400_000]  # a calendar day in a zone with an odd offset
        tz = "Asia/Kathmandu"
    else:
        tz = None
    rates = [rl.Rate(draw(st.integers(1, 5)), period) for period in periods]
    penalty = draw(st.sampled_from([None, None, 1, 3.5]))
    return rl.Policy(rates, algorithm=algorithm, penalty=penalty, tz=tz,
                     name=f"p{draw(st.integers(0, 10**6))}")


ops = st.builds(
    Op,
    advance_ms=st.sampled_from([0, 0, 1, 7, 250, 999, 1_000, 1_001, 2_500, 9_999, 61_000,
                                3_600_000, 43_200_000]),
    kind=st.sampled_from(["hit", "hit", "hit", "hit", "peek", "refund", "uncheck", "reset",
                          "book", "cancel"]),
    picks=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2),
                             st.sampled_from([1, 1, 1, 2, 3, 6])),
                   min_size=1, max_size=3).map(tuple),
    offset_ms=st.sampled_from([-5_000, 0, 1, 500, 4_000, 30_000, 120_000]),
)


EXTEND = """
for i = 1, #KEYS do
  local ttl = redis.call('PTTL', KEYS[i])
  if ttl > 0 then redis.call('PEXPIRE', KEYS[i], ttl + 600000) end
end
return 1
"""


class Twin:
    """Runs every call on both backends and insists on equal replies."""

    def __init__(self, client: redis.Redis, prefix: str) -> None:
        self.memory = rl.MemoryBackend()
        self.client = client
        self.prefix = prefix
        self.now_ms = START_MS
        self.log: list[str] = []

    def run_redis(self, call: core.ScriptCall) -> list[int]:
        for attempt in (1, 2):
            pipe = self.client.pipeline(transaction=True)
            pipe.evalsha(SHA1, len(call.keys), *call.keys, *call.args)
            pipe.eval(EXTEND, len(call.keys), *call.keys)
            try:
                reply, _ = pipe.execute()
            except NoScriptError:  # another suite flushed the shared server's scripts
                if attempt == 2:
                    raise
                self.client.script_load(SOURCE)
                continue
            return list(reply)
        raise AssertionError("unreachable")

    def run(self, call: core.ScriptCall) -> list[int]:
        expected = self.memory.run(call)
        actual = self.run_redis(call)
        self.log.append(f"{call.args} -> memory {expected} redis {actual}")
        assert actual == expected, "\n".join(self.log[-12:])
        return actual

    def build(self, op: str, checks: list[core.Check], **kw: object) -> core.ScriptCall:
        return core.build(op, checks, self.prefix, now_us=self.now_ms * 1000,
                          clock_ms=self.now_ms, **kw)  # type: ignore[arg-type]


def _play(client: redis.Redis, pool: list[rl.Policy], sequence: list[Op]) -> None:
    twin = Twin(client, "d" + uuid.uuid4().hex[:12])
    bookings: list[rl.Booking] = []
    admitted: list[list[core.Check]] = []
    try:
        for op in sequence:
            twin.now_ms += op.advance_ms
            checks = [core.Check(pool[p % len(pool)], IDENTITIES[i], cost)
                      for p, i, cost in op.picks]
            single = checks[:1]
            if op.kind == "hit":
                call = twin.build(core.HIT, checks)
                decision = core.decide(call, twin.run(call))
                if decision.allowed:
                    admitted.append(checks)
            elif op.kind == "peek":
                twin.run(twin.build(core.PEEK, single))
            elif op.kind == "refund":
                twin.run(twin.build(core.REFUND, single))
            elif op.kind == "uncheck" and admitted:
                twin.run(twin.build(core.REFUND, admitted.pop()))
            elif op.kind == "reset":
                twin.run(twin.build(core.RESET, single))
            elif op.kind == "book" and single[0].policy.code == "sl":
                call = twin.build(core.BOOK, single, at_ms=twin.now_ms + op.offset_ms)
                decision = core.decide(call, twin.run(call))
                if decision.allowed and call.booking is not None:
                    bookings.append(call.booking)
            elif op.kind == "cancel" and bookings:
                booking = bookings.pop(0)
                check = core.Check(booking.policy, booking.identity, booking.cost)
                twin.run(twin.build(core.CANCEL, [check], token=booking.token))
            # After every step both sides must also agree on the state as it stands.
            for check in checks:
                twin.run(twin.build(core.PEEK, [check]))
    finally:
        stale = list(client.scan_iter(match=f"{twin.prefix}:*", count=1000))
        if stale:
            client.delete(*stale)


@pytest.mark.parametrize("shape", ["one policy", "several policies"])
def test_memory_and_lua_agree_on_every_reply(redis_client: redis.Redis, shape: str) -> None:
    size = 1 if shape == "one policy" else 3

    @settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(pool=st.lists(policies(), min_size=size, max_size=size),
           sequence=st.lists(ops, min_size=8, max_size=50))
    def check(pool: list[rl.Policy], sequence: list[Op]) -> None:
        _play(redis_client, pool, sequence)

    check()


def test_memory_and_lua_agree_on_a_dense_single_identity_stream(
    redis_client: redis.Redis,
) -> None:
    """Many hits on one identity, where the logs grow and the booking sweep matters."""

    @settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(policy=policies(),
           sequence=st.lists(st.builds(Op, advance_ms=st.sampled_from([0, 1, 100, 999]),
                                       kind=st.sampled_from(["hit", "hit", "book", "refund",
                                                             "cancel"]),
                                       picks=st.just(((0, 0, 1),)),
                                       offset_ms=st.integers(-2_000, 20_000)),
                             min_size=30, max_size=100))
    def check(policy: rl.Policy, sequence: list[Op]) -> None:
        _play(redis_client, [policy], sequence)

    check()
