"""MemoryBackend and the Lua script must give identical answers, on the real Redis and on
fakeredis+lupa (the same script, no server needed).

Hypothesis draws policies (every algorithm, one to three tiers, with and without a penalty,
calendar days and weeks in zones with and without DST, with the app's clock up to 30 days
off the script's; in-flight limits) and a sequence of operations: time advances, hits of
several policies at once under several identities, peeks, refunds (of a hit by its token:
in-flight slots given back; several hits' given back in one batched call), lease renewals,
charges (a hit recorded whether or not admitted), pauses (a ban started without a refusal, as an
upstream's 429 starts one; obeyed by policies whose penalty starts none of its own), resets,
bookings and cancellations, starting
at an ordinary time or hours before a DST change. Each operation is built ONCE (same keys,
same explicit `now`, same token) and run on both backends; the raw replies must be equal,
reply for reply. On the real Redis a fresh key prefix per example keeps the shared server
clean, and the example's keys are deleted at its end; fakeredis gets a fresh FakeServer per
example (in fakeredis 2.40 a script that sets a global breaks every later script on its server).

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

import fakeredis
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.exceptions import NoScriptError

import ratelimit_mw as rl
from ratelimit_mw.core import codec, scripts

START_MS = 1_800_000_000_000
# Starts a few hours before DST changes: New York springs forward on 2027-03-14 at 07:00Z,
# Paris falls back on 2027-10-31 at 01:00Z.
STARTS_MS = [START_MS, 1_805_000_400_000, 1_824_933_600_000]
# How far the app's clock is from the script's `now` (it only picks the zone's schedule).
APP_SKEWS_MS = [0, 0, 48 * 3_600_000, -48 * 3_600_000, 30 * 86_400_000]
ZONES = ["Asia/Kathmandu", "America/New_York", "Europe/Paris"]
PERIODS = [1_000, 2_000, 5_000, 10_000, 60_000]
IDENTITIES = ["a", "b", "c"]


LARGEST = -1  # a pick's cost: the largest its policy accepts (Policy.max_cost)


def _cost(policy: rl.Policy, cost: int) -> int:
    """A drawn cost for `policy`: at most the largest it accepts (in-flight limits take
    small costs as drawn, above their slots too: one member per slot)."""
    if policy.algorithm == "concurrency":
        return 25 if cost == LARGEST else min(cost, 25)
    return policy.max_cost if cost == LARGEST else min(cost, policy.max_cost)


def _no_ban() -> None:
    return None


@dataclass(frozen=True)
class Op:
    advance_ms: int
    kind: str
    picks: tuple[tuple[int, int, int], ...]  # (policy index, identity index, cost)
    offset_ms: int  # a booking's time relative to now


@st.composite
def policies(draw: st.DrawFn) -> rl.Policy:
    algorithm = draw(st.sampled_from(sorted([*rl.ALGORITHMS, "concurrency"])))
    periods = draw(st.lists(st.sampled_from(PERIODS), min_size=1, max_size=3, unique=True))
    if algorithm == "fixed-window" and draw(st.booleans()):
        # Calendar days or weeks (an odd offset, or DST) beside epoch-aligned tiers.
        periods = [*periods[:2], draw(st.sampled_from([86_400_000, 2 * 86_400_000,
                                                       7 * 86_400_000]))]
        tz = draw(st.sampled_from(ZONES))
    else:
        tz = None
    # Mostly small limits; sometimes 40, so that costs of 12 and 25 (members "<token>:10" and
    # up, which sort before "<token>:2" in Redis) are admitted and refunded too.
    rates = [rl.Rate(draw(st.sampled_from([1, 2, 3, 4, 5, 40])), period) for period in periods]
    # Penalties shorter than most periods (0.25, 1, 3.5 s) and longer than every one (90 s).
    # `_no_ban`: a penalty that starts no ban of its own, and obeys pauses.
    penalty = draw(st.sampled_from([None, None, None, 0.25, 1, 3.5, 90, _no_ban]))
    name = f"p{draw(st.integers(0, 10**6))}"
    if algorithm == "concurrency":  # one number of slots, one lease
        return rl.Policy.in_flight(rates[0].limit, lease=periods[0] / 1000, name=name)
    if algorithm == "sliding-log":
        # Namesakes share one log, which each call trims and keeps alive by its own longest
        # window: sharing it needs one longest window (the documented rule, see
        # docs/getting-started.md), so a namesake of another longest window is another name.
        name += f".{max(periods)}"
    return rl.Policy(rates, algorithm=algorithm, penalty=penalty, tz=tz, name=name)


ops = st.builds(
    Op,
    advance_ms=st.sampled_from([0, 0, 1, 7, 250, 999, 1_000, 1_001, 2_500, 9_999, 61_000,
                                3_600_000, 43_200_000]),
    kind=st.sampled_from(["hit", "hit", "hit", "hit", "peek", "refund", "uncheck", "reset",
                          "book", "cancel", "renew", "charge", "release", "settle", "pause"]),
    # Costs up to the largest each policy accepts (`_cost`): the sliding log's one member per
    # hit carrying its cost, the saturation of a window charged deep in debt.
    picks=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2),
                             st.sampled_from([1, 1, 1, 2, 3, 6, 12, 25, 1_000, 10**6,
                                              2**40, LARGEST])),
                   min_size=1, max_size=3).map(tuple),
    offset_ms=st.sampled_from([-5_000, 0, 1, 500, 4_000, 30_000, 120_000]),
)


# Runs in the same MULTI as each call, so Redis's clock cannot move between the two: every
# key the call left with a TTL keeps it (the test's clock is fake, Redis's TTLs are real).
# PTTL answers 0 for a key with less than a millisecond left: that key is extended too.
EXTEND = """
for i = 1, #KEYS do
  local ttl = redis.call('PTTL', KEYS[i])
  if ttl >= 0 then redis.call('PEXPIRE', KEYS[i], ttl + 600000) end
end
return 1
"""


def run_extending(client: redis.Redis, call: codec.ScriptCall) -> list[int]:
    """Run `call` on the real Redis with EXTEND in the same transaction (see EXTEND)."""
    for attempt in (1, 2):
        pipe = client.pipeline(transaction=True)
        pipe.evalsha(scripts.sha1(), len(call.keys), *call.keys, *call.args)
        pipe.eval(EXTEND, len(call.keys), *call.keys)
        try:
            reply, _ = pipe.execute()
        except NoScriptError:  # another suite flushed the shared server's scripts
            if attempt == 2:
                raise
            client.script_load(scripts.source())
            continue
        return list(reply)
    raise AssertionError("unreachable")


class Twin:
    """Runs every call on both backends and insists on equal replies."""

    def __init__(self, client: redis.Redis, prefix: str, start_ms: int, skew_ms: int) -> None:
        self.memory = rl.MemoryBackend()
        self.client = client
        self.prefix = prefix
        self.now_ms = start_ms
        self.skew_ms = skew_ms
        self.log: list[str] = []

    def run_redis(self, call: codec.ScriptCall) -> list[int]:
        return run_extending(self.client, call)

    def run(self, call: codec.ScriptCall, deadline: float | None = None) -> list[int]:
        expected = self.memory.run(call)
        actual = self.run_redis(call)
        self.log.append(f"{call.args} -> memory {expected} redis {actual}")
        assert actual == expected, "\n".join(self.log[-12:])
        return actual

    def build(self, op: str, checks: list[codec.Check], **kw: object) -> codec.ScriptCall:
        return codec.build(op, checks, self.prefix, now_us=self.now_ms * 1000,
                          clock_ms=self.now_ms + self.skew_ms, **kw)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Setting:
    start_ms: int
    skew_ms: int


settings_ = st.builds(Setting, st.sampled_from(STARTS_MS), st.sampled_from(APP_SKEWS_MS))
STORES = ["redis", "fakeredis"]


def _client(store: str, request: pytest.FixtureRequest) -> redis.Redis:
    if store == "redis":
        client: redis.Redis = request.getfixturevalue("redis_client")
        return client
    return fakeredis.FakeRedis(server=fakeredis.FakeServer())


def _checks(call: codec.ScriptCall) -> list[codec.Check]:
    """The checks a hit's call was built from (its costs are in its tier arguments)."""
    out, b = [], 5
    for policy, identity in call.layout:
        out.append(codec.Check(policy, identity, int(call.args[b + 3])))
        b += 7 * len(policy.rates)
    return out


def _play(client: redis.Redis, pool: list[rl.Policy], sequence: list[Op],
          setting: Setting = Setting(START_MS, 0)) -> None:
    twin = Twin(client, "d" + uuid.uuid4().hex[:12], setting.start_ms, setting.skew_ms)
    bookings: list[rl.Booking] = []
    admitted: list[codec.ScriptCall] = []
    try:
        for op in sequence:
            twin.now_ms += op.advance_ms
            checks = [codec.Check(pool[p % len(pool)], IDENTITIES[i],
                                  _cost(pool[p % len(pool)], cost))
                      for p, i, cost in op.picks]
            single = checks[:1]
            if op.kind == "hit":
                call = twin.build(codec.HIT, checks)
                decision = codec.decoded(call, twin.run(call))
                if decision.allowed:
                    admitted.append(call)
            elif op.kind == "peek":
                twin.run(twin.build(codec.PEEK, single))
            elif op.kind == "refund":
                twin.run(twin.build(codec.REFUND, single))
            elif op.kind == "uncheck" and admitted:
                # A response's give-back: by its token, naming when it was charged (as the
                # middleware's) or not; sometimes an older one's, whose window later hits
                # have filled.
                hit = admitted.pop(-1 - op.picks[0][1] % len(admitted))
                twin.run(twin.build(codec.REFUND, _checks(hit), token=hit.args[2],
                                    at_ms=str(hit.args[1]) if op.picks[0][0] % 2 == 0 else None))
            elif op.kind == "release" and any(hit.args[2] for hit in admitted):
                # The responses that ended in one turn of the loop: their hits (those with a
                # token: a sliding log's, or holding slots) given back in ONE call.
                tokened = [hit for hit in admitted if hit.args[2]][-1 - op.offset_ms % 3:]
                for hit in tokened:
                    admitted.remove(hit)
                twin.run(twin.build(codec.REFUND,
                                    [check for hit in tokened for check in _checks(hit)],
                                    tokens=[hit.args[2] for hit in tokened
                                            for _ in _checks(hit)],
                                    charges=[str(hit.args[1]) if (op.picks[0][1] + j) % 2 else "-"
                                             for j, hit in enumerate(tokened)
                                             for _ in _checks(hit)]))
            elif op.kind == "settle" and admitted:
                # A settle below the estimate: the give-back names its charge (the store's
                # clock when it was admitted, its cost), as a Ticket's does.
                hit = admitted.pop()
                first = _checks(hit)[0]
                back = codec.Check(first.policy, first.identity, max(1, first.cost // 2))
                twin.run(twin.build(codec.REFUND, [back], token=hit.args[2],
                                    at_ms=f"{hit.args[1]}:{first.cost}"))
            elif op.kind == "renew" and admitted:
                hit = admitted[-1]
                twin.run(twin.build(codec.RENEW, _checks(hit), token=hit.args[2]))
            elif op.kind == "charge":
                twin.run(twin.build(codec.CHARGE, checks))
            elif op.kind == "pause":
                # For as long as a booking's offset (a non-positive one: a millisecond).
                twin.run(twin.build(codec.PAUSE, checks, at_ms=max(op.offset_ms, 1)))
            elif op.kind == "reset":
                twin.run(twin.build(codec.RESET, single))
            elif op.kind == "book" and single[0].policy.algorithm == "sliding-log":
                call = twin.build(codec.BOOK, single, at_ms=twin.now_ms + op.offset_ms)
                decision = codec.decoded(call, twin.run(call))
                if decision.allowed and call.booking is not None:
                    bookings.append(call.booking)
            elif op.kind == "cancel" and bookings:
                booking = bookings.pop(0)
                check = codec.Check(booking.policy, booking.identity, booking.cost)
                twin.run(twin.build(codec.CANCEL, [check], token=booking.token))
            # After every step both sides must also agree on the state as it stands.
            for check in checks:
                twin.run(twin.build(codec.PEEK, [check]))
    finally:
        stale = list(client.scan_iter(match=f"{twin.prefix}:*", count=1000))
        if stale:
            client.delete(*stale)


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("shape", ["one policy", "several policies"])
def test_memory_and_lua_agree_on_every_reply(
    request: pytest.FixtureRequest, store: str, shape: str
) -> None:
    size = 1 if shape == "one policy" else 3
    # fakeredis runs the script several times slower than Redis: fewer examples there.
    examples = 250 if store == "redis" else 60

    @settings(max_examples=examples, deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(pool=st.lists(policies(), min_size=size, max_size=size),
           sequence=st.lists(ops, min_size=8, max_size=50), setting=settings_)
    def check(pool: list[rl.Policy], sequence: list[Op], setting: Setting) -> None:
        _play(_client(store, request), pool, sequence, setting)

    check()


@pytest.mark.parametrize("store", STORES)
def test_memory_and_lua_agree_on_a_dense_single_identity_stream(
    request: pytest.FixtureRequest, store: str
) -> None:
    """Many hits on one identity, where the logs grow and the booking sweep matters."""
    examples = 100 if store == "redis" else 30

    @settings(max_examples=examples, deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(policy=policies(),
           sequence=st.lists(st.builds(Op, advance_ms=st.sampled_from([0, 1, 100, 999]),
                                       kind=st.sampled_from(["hit", "hit", "book", "refund",
                                                             "cancel"]),
                                       picks=st.just(((0, 0, 1),)),
                                       offset_ms=st.integers(-2_000, 20_000)),
                             min_size=30, max_size=100))
    def check(policy: rl.Policy, sequence: list[Op]) -> None:
        _play(_client(store, request), [policy], sequence)

    check()
