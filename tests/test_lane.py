"""Lanes (core.lane, AsyncLimiter.lane_hit) against the plain path.

A lane precomputes one (policy, cost) hit: its call, its packed bytes, its reply reading.
The limiter posts those bytes on the pipelined connection and awaits the connection's future
itself. Everything it does must be what the plain path (`replay`, then `ask`: `plans.build`,
``hiredis.pack_command``, `plans.decide`, the deny cache's record) does for the same check:

- pure: the lane's call, bytes and Decision against the plain builders on random policies,
  identities, costs, clocks and replies;
- recorded: a random sequence runs through lanes on the real Redis; every command the lane
  sent and every reply it got is recorded, and the same sequence runs through the plain path
  on a backend that answers from the recording, checking that the plain path sends the very
  same bytes at the same steps: identical Decisions, identical deny-cache contents;
- the failures: NOSCRIPT, a dropped connection, the caller's deadline, a cold start.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import hiredis
import pytest
import redis
import redis.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ratelimit_mw as rl
from ratelimit_mw.core import plans, scripts
from ratelimit_mw.core.lane import Lane
from ratelimit_mw.core.plans import Check, ScriptCall
from ratelimit_mw.core.wire import wire
from tests.conftest import REDIS_URL, StepClock
from tests.test_differential import policies

REDIS = REDIS_URL


class _CountedTokens:
    """Sliding-log member tokens from a counter: two runs of one sequence name the same
    members, so their bytes can be compared."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def next(self) -> str:
        return f"t{next(self._counter)}"


def _pack(call: ScriptCall) -> bytes:
    return hiredis.pack_command(  # type: ignore[no-any-return]
        ("EVALSHA", scripts.sha1(), len(call.keys), *call.keys, *call.args))


def _static(policy: rl.Policy) -> bool:
    return wire(policy).static


# -- pure ---------------------------------------------------------------------------------


def _replies(tiers: int) -> st.SearchStrategy[list[int]]:
    values = st.integers(-1, 10**13)
    admitted = st.lists(values, min_size=5 * tiers, max_size=5 * tiers).map(lambda v: [1, *v])
    refused = st.lists(values, min_size=8 * tiers, max_size=8 * tiers).map(lambda v: [0, *v])
    return st.one_of(admitted, refused)


@settings(max_examples=300, deadline=None)
@given(
    policy=policies().filter(_static),
    cost=st.integers(1, 50),
    identity=st.text(min_size=1, max_size=90),
    prefix=st.sampled_from(["rl", "a.b:c", "x-1"]),
    now_us=st.one_of(st.none(), st.integers(0, 2**52)),
    data=st.data(),
)
def test_a_lane_builds_packs_and_reads_as_the_plain_path(
    policy: rl.Policy, cost: int, identity: str, prefix: str, now_us: int | None, data: Any
) -> None:
    lane = Lane(policy, cost, prefix)
    check = Check(policy, identity, cost)
    plain = plans.build(plans.HIT, [check], prefix, now_us=now_us)
    token = str(plain.args[2]) or None  # a sliding log's member token: fresh on every call
    assert lane.check(identity) == check
    assert lane.call(identity, now_us, token) == plain
    assert lane.packed(identity, now_us, token) == _pack(plain)
    # An in-process backend's parts (MemoryBackend.hit_one, hit_tiers): the call's keys and
    # tiers' arguments.
    assert lane.key(identity) == plain.keys[0]
    assert lane.keys(identity) == plain.keys
    assert lane.tiers == tuple(plain.args[5:])
    assert lane.tier == (lane.tiers if len(policy.rates) == 1 else None)
    reply = data.draw(_replies(len(policy.rates)))
    assert lane.decide(identity, reply) == plans.decide(plain, reply)


def test_a_lane_takes_only_policies_whose_arguments_depend_on_the_cost_alone() -> None:
    with pytest.raises(rl.ConfigurationError, match="penalty"):
        Lane(rl.Policy("1/second", penalty=5), 1, "rl")
    with pytest.raises(rl.ConfigurationError, match="tz"):
        Lane(rl.Policy("1/day", algorithm="fixed-window", tz="Europe/Paris"), 1, "rl")
    with pytest.raises(rl.ConfigurationError, match="cost"):
        Lane(rl.Policy("1/second"), 0, "rl")


def test_a_sliding_log_lane_names_every_hit_with_a_fresh_token() -> None:
    lane = Lane(rl.Policy("5/minute;9/hour", algorithm="sliding-log"), 1, "rl")
    assert lane.packed("u") != lane.packed("u")
    assert lane.call("u").args[2] != lane.call("u").args[2]


# -- recorded: the lane on the real Redis, the plain path on its recording -------------------


@dataclass(frozen=True)
class Step:
    kind: str  # hit (through the lane / the plain path), reset, refund
    lane: int
    identity: int
    advance_ms: int


steps = st.builds(
    Step,
    kind=st.sampled_from(["hit"] * 8 + ["reset", "refund"]),
    lane=st.sampled_from([0, 0, 1, 1, 2, 3]),  # mostly the two lanes sharing a policy
    identity=st.integers(0, 1),
    advance_ms=st.sampled_from([0, 0, 0, 1, 7, 250, 999, 1_000, 1_001, 9_999, 61_000]),
)


class _Recording:
    """The real backend, recording every command sent to Redis and its reply, in order:
    through `post` (the lane) and through `arun`/`arun_within` (the plain path the lane falls
    back to: a refusal asked about again, a reset, a refund)."""

    is_cluster = False
    in_process = False

    def __init__(self, backend: rl.AsyncRedisBackend) -> None:
        self.backend = backend
        self.sent: list[tuple[bytes, Any]] = []
        self.posted = 0

    def post(self, packed: bytes, give_up: float) -> Any:
        waiter = self.backend.post(packed, give_up)
        if waiter is not None:
            self.posted += 1
            waiter.add_done_callback(lambda done: self.sent.append((packed, done.result())))
        return waiter

    def settle(self, outcome: Any) -> Any:
        return self.backend.settle(outcome)

    async def arun(self, call: ScriptCall) -> list[int]:
        reply = await self.backend.arun(call)
        self.sent.append((_pack(call), reply))
        return reply

    async def arun_within(self, call: ScriptCall, seconds: float) -> list[int]:
        return await self.arun(call)


class _Replaying:
    """A backend for the plain path that answers from the recording, and fails the test if
    the plain path sends anything else, or at another step, than the lane sent."""

    is_cluster = False
    in_process = False

    def __init__(self, sent: list[tuple[bytes, Any]]) -> None:
        self.sent = list(sent)

    async def arun(self, call: ScriptCall) -> list[int]:
        assert self.sent, f"the plain path sent {call} where the lane sent nothing"
        packed, reply = self.sent.pop(0)
        assert _pack(call) == packed
        return reply  # type: ignore[no-any-return]

    async def arun_within(self, call: ScriptCall, seconds: float) -> list[int]:
        return await self.arun(call)


def _deny_state(limiter: rl.AsyncLimiter) -> Any:
    deny = limiter._deny
    if deny is None:
        return None
    return [(key, entry.until, entry.decided, list(entry.reply))
            for key, entry in deny._entries.items()], deny.bytes


async def _play(limiter: rl.AsyncLimiter, lanes: list[Lane], sequence: list[Step],
                through_lanes: bool) -> list[Any]:
    clock: StepClock = limiter.clock  # type: ignore[assignment]
    answers: list[Any] = []
    for step in sequence:
        clock.advance_ms(step.advance_ms)
        lane, identity = lanes[step.lane], f"u{step.identity}"
        if step.kind == "hit":
            if through_lanes:
                answers.append(await limiter.lane_hit(lane, identity, 5.0))
            else:
                answers.append(await limiter._replay_ask([lane.check(identity)], 5.0))
        elif step.kind == "reset":
            await limiter.reset(lane.policy, identity)
        else:
            await limiter.refund(lane.policy, identity, lane.cost)
        answers.append(_deny_state(limiter))
    return answers


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    pols=st.lists(policies().filter(_static), min_size=4, max_size=4),
    costs=st.lists(st.sampled_from([1, 1, 2, 3, 5]), min_size=4, max_size=4),
    deny_cache=st.sampled_from([0, 100]),
    sequence=st.lists(steps, min_size=1, max_size=40),
)
def test_lane_hits_on_the_real_redis_are_the_plain_paths_answers(
    monkeypatch: pytest.MonkeyPatch, pols: list[rl.Policy], costs: list[int], deny_cache: int,
    sequence: list[Step],
) -> None:
    prefix = f"lanetest-{uuid.uuid4().hex[:8]}"
    # Lanes 0 and 1 share a policy at two costs: a hit through one may write what a refusal
    # held for the other counted, which the deny cache must then forget.
    lanes = [Lane(p, c, prefix) for p, c in zip([pols[0], *pols[:3]], costs, strict=True)]

    async def through_lanes() -> tuple[list[Any], list[tuple[bytes, Any]], int]:
        backend = rl.AsyncRedisBackend(redis.asyncio.Redis.from_url(REDIS))
        recording = _Recording(backend)
        limiter = rl.AsyncLimiter(recording, prefix=prefix, clock=StepClock(),  # type: ignore[arg-type]
                                  deny_cache=deny_cache)
        await backend._pipe.command("PING")  # connected: the lane posts from the first hit
        recording.sent.clear()
        try:
            answers = await _play(limiter, lanes, sequence, True)
        finally:
            await backend.aclose()
        return answers, recording.sent, recording.posted

    async def through_plain_path(sent: list[tuple[bytes, Any]]) -> list[Any]:
        replaying = _Replaying(sent)
        limiter = rl.AsyncLimiter(replaying, prefix=prefix, clock=StepClock(),  # type: ignore[arg-type]
                                  deny_cache=deny_cache)
        answers = await _play(limiter, lanes, sequence, False)
        assert replaying.sent == [], "the lane sent commands the plain path did not"
        return answers

    try:
        monkeypatch.setattr(plans, "_tokens", _CountedTokens())
        lane_answers, sent, posted = asyncio.run(through_lanes())
        monkeypatch.setattr(plans, "_tokens", _CountedTokens())
        assert asyncio.run(through_plain_path(sent)) == lane_answers
        hits = sum(step.kind == "hit" for step in sequence)
        # The lane was taken (not only its fallbacks): every hit the deny cache did not answer.
        assert posted >= (hits if deny_cache == 0 else min(hits, 1))
    finally:
        client = redis.Redis.from_url(REDIS)
        for key in client.scan_iter(match=f"{prefix}:*"):
            client.delete(key)
        client.close()


# -- the failures: what the lane's limiter does when the post brings no plain reply ---------


def _lane(prefix: str, limit: str = "5/minute", algorithm: str = "fixed-window") -> Lane:
    policy = rl.Policy(limit, algorithm=algorithm, name=uuid.uuid4().hex[:8])  # type: ignore[arg-type]
    return Lane(policy, 1, prefix)


@contextlib.asynccontextmanager
async def _connected(prefix: str) -> AsyncIterator[rl.AsyncLimiter]:
    """A limiter on the real Redis whose pipelined connection is open (lanes post at once),
    closed afterwards."""
    backend = rl.AsyncRedisBackend(redis.asyncio.Redis.from_url(REDIS))
    await backend._pipe.command("PING")
    try:
        yield rl.AsyncLimiter(backend, prefix=prefix)
    finally:
        await backend.aclose()


async def test_a_cold_start_connects_through_the_plain_path_then_posts(prefix: str) -> None:
    backend = rl.AsyncRedisBackend(redis.asyncio.Redis.from_url(REDIS))
    limiter = rl.AsyncLimiter(backend, prefix=prefix)
    lane = _lane(prefix)
    posted: list[bytes] = []
    post = limiter._post
    assert post is not None

    def counting(packed: bytes, give_up: float) -> Any:
        waiter = post(packed, give_up)
        if waiter is not None:
            posted.append(packed)
        return waiter

    limiter._post = counting
    try:
        first = await limiter.lane_hit(lane, "ip:1", 1.0)  # no connection yet: not posted
        second = await limiter.lane_hit(lane, "ip:1", 1.0)
        assert (first.remaining, second.remaining) == (4, 3)
        assert posted == [lane.packed("ip:1")]
    finally:
        await backend.aclose()


async def test_a_posted_refusal_is_counted_down_from_the_moment_its_call_was_sent(
    prefix: str
) -> None:
    # The process pauses 100 ms right after the write (a GC pause, a busy loop): the deny
    # cache must still count the refusal from the send, as every other path does, or it
    # refuses a hit that the store would admit.
    clock = StepClock()
    backend = rl.AsyncRedisBackend(redis.asyncio.Redis.from_url(REDIS))
    await backend._pipe.command("PING")
    limiter = rl.AsyncLimiter(backend, prefix=prefix, clock=clock)
    lane = Lane(rl.Policy("1/second", algorithm="gcra", name="pause"), 1, prefix)
    post = limiter._post
    assert post is not None
    pauses: list[int] = []

    def pausing(packed: bytes, give_up: float) -> Any:
        waiter = post(packed, give_up)
        if pauses:
            clock.advance_ms(pauses.pop())
        return waiter

    limiter._post = pausing
    try:
        sent_at = clock.us
        assert (await limiter.lane_hit(lane, "ip:1", 1.0)).allowed
        pauses.append(100)
        refused = await limiter.lane_hit(lane, "ip:1", 1.0)
        assert not refused.allowed and refused.retry_after == 1.0
        assert limiter._deny is not None
        assert [entry.decided for entry in limiter._deny._entries.values()] == [sent_at]
        clock.us = sent_at + 1_000_000  # when the store admits again
        assert (await limiter.lane_hit(lane, "ip:1", 1.0)).allowed
    finally:
        await backend.aclose()


async def test_after_a_script_flush_the_lane_loads_the_script_and_counts_once(
    prefix: str, redis_client: redis.Redis
) -> None:
    lane = _lane(prefix)
    async with _connected(prefix) as limiter:
        assert (await limiter.lane_hit(lane, "ip:1", 1.0)).remaining == 4
        redis_client.script_flush()
        assert (await limiter.lane_hit(lane, "ip:1", 1.0)).remaining == 3
        assert (await limiter.peek(lane.policy, "ip:1")).remaining == 3


async def test_a_dropped_connection_is_reopened_and_the_hit_counted_once(
    prefix: str, redis_client: redis.Redis
) -> None:
    lane = _lane(prefix)
    async with _connected(prefix) as limiter:
        assert (await limiter.lane_hit(lane, "ip:1", 1.0)).remaining == 4
        redis_client.client_kill_filter(_type="normal", skipme=True)
        decisions = await asyncio.gather(*(limiter.lane_hit(lane, "ip:1", 1.0)
                                           for _ in range(3)))
        assert sorted(d.remaining for d in decisions) == [1, 2, 3]
        assert (await limiter.peek(lane.policy, "ip:1")).remaining == 1


async def test_a_call_past_the_deadline_fails_and_is_never_sent_again(
    prefix: str, redis_client: redis.Redis
) -> None:
    lane = _lane(prefix)
    async with _connected(prefix) as limiter:
        try:
            redis_client.execute_command("CLIENT", "PAUSE", 200, "WRITE")
            with pytest.raises(TimeoutError):
                await limiter.lane_hit(lane, "ip:1", 0.05)
            # Redis ran it once the pause ended (a call that gave up may still have been
            # applied); the lane did not send it a second time.
            assert (await limiter.lane_hit(lane, "ip:1", 5.0)).remaining == 3
        finally:
            redis_client.execute_command("CLIENT", "UNPAUSE")


@pytest.mark.parametrize(
    ("outcome", "means"),
    [
        (TimeoutError(), TimeoutError),
        (asyncio.TimeoutError(), TimeoutError),
        (redis.exceptions.ConnectionError("lost"), None),
        (ConnectionResetError(), None),
        (hiredis.ReplyError("NOSCRIPT No matching script"), None),
        (hiredis.ReplyError("OOM command not allowed"), rl.BackendError),
        (redis.exceptions.TimeoutError("Timeout reading from Redis"), rl.BackendError),
        ("not a list", rl.BackendError),
    ],
    ids=["deadline", "asyncio-deadline", "dropped", "reset", "noscript", "oom",
         "socket-timeout", "garbage"],
)
def test_settle_says_which_posts_the_plain_path_sends_again(outcome: Any, means: Any) -> None:
    backend = rl.AsyncRedisBackend(redis.asyncio.Redis.from_url(REDIS))
    if means is None:
        assert backend.settle(outcome) is None
    else:
        with pytest.raises(means):
            backend.settle(outcome)


async def test_without_a_connection_that_posts_the_lane_is_the_plain_path(prefix: str) -> None:
    # The memory backend, a cluster, redis-py's own client: nothing to post on.
    for backend in (rl.MemoryBackend(),
                    rl.AsyncRedisBackend(redis.asyncio.Redis.from_url(REDIS, protocol=3))):
        limiter = rl.AsyncLimiter(backend, prefix=prefix)  # type: ignore[arg-type]
        assert limiter._post is None or limiter._post(b"", 0.0) is None
        lane = _lane(prefix, "2/minute")
        answers = [await limiter.lane_hit(lane, "ip:1", 1.0) for _ in range(3)]
        assert [d.allowed for d in answers] == [True, True, False]
        await limiter.reset(lane.policy, "ip:1")


# -- in process, and the sync limiter: lane_hit against check on twin memory backends -------


@settings(max_examples=150, deadline=None)
@given(
    pols=st.lists(policies().filter(_static), min_size=3, max_size=3),
    costs=st.lists(st.sampled_from([1, 1, 2, 3, 5]), min_size=4, max_size=4),
    deny_cache=st.sampled_from([0, 100]),
    sequence=st.lists(steps, min_size=1, max_size=40),
)
def test_lane_hits_in_process_and_sync_are_checks(
    pols: list[rl.Policy], costs: list[int], deny_cache: int, sequence: list[Step]
) -> None:
    """Four limiters on four MemoryBackends under one clock: the sync Limiter through
    lane_hit and through check, the AsyncLimiter through lane_hit (its in-process path) and
    through replay and ask. Every answer and every deny cache must be the same."""
    lanes = [Lane(p, c, "rl") for p, c in zip([pols[0], *pols], costs, strict=True)]
    clock = StepClock()
    sync_lane, sync_plain = (rl.Limiter(rl.MemoryBackend(), clock=clock, deny_cache=deny_cache)
                             for _ in range(2))
    async_lane, async_plain = (rl.AsyncLimiter(rl.MemoryBackend(), clock=clock,
                                               deny_cache=deny_cache) for _ in range(2))

    async def play() -> None:
        for step in sequence:
            clock.advance_ms(step.advance_ms)
            lane, identity = lanes[step.lane], f"u{step.identity}"
            if step.kind == "hit":
                answers = [sync_lane.lane_hit(lane, identity),
                           sync_plain.check([lane.check(identity)]),
                           await async_lane.lane_hit(lane, identity),
                           await async_plain._replay_ask([lane.check(identity)], None)]
                assert answers.count(answers[0]) == 4, (step, answers)
            else:
                for limiter in (sync_lane, sync_plain):
                    getattr(limiter, step.kind)(lane.policy, identity)
                for alimiter in (async_lane, async_plain):
                    await getattr(alimiter, step.kind)(lane.policy, identity)
            states = [_deny_state(limiter) for limiter in  # type: ignore[arg-type]
                      (sync_lane, sync_plain, async_lane, async_plain)]
            assert states.count(states[0]) == 4, step

    asyncio.run(play())


def test_lanes_take_the_plain_path_under_a_metrics_hook() -> None:
    seen: list[tuple[str, str]] = []

    class Hook:
        def observe(self, event: str, policy: str, seconds: float) -> None:
            seen.append((event, policy))

    limiter = rl.Limiter(rl.MemoryBackend(), metrics=Hook())
    lane = Lane(rl.Policy("1/minute", name="m"), 1, "rl")
    assert [limiter.lane_hit(lane, "u").allowed for _ in range(2)] == [True, False]
    assert seen == [("admitted", "m"), ("refused", "m")]


async def test_an_admitted_lane_hit_forgets_the_refusals_held_for_its_identity(
    prefix: str
) -> None:
    """A hit of cost 1 admitted while a refusal of cost 3 is held for the same policy and
    identity wrote what that refusal counted: the deny cache must drop it (as `record` does
    on the plain path), on every way a lane reaches a store."""
    policy = rl.Policy("3/minute", algorithm="fixed-window", name=uuid.uuid4().hex[:8])
    big, small = Lane(policy, 3, prefix), Lane(policy, 1, prefix)

    sync = rl.Limiter(rl.MemoryBackend(), prefix=prefix)
    assert sync.lane_hit(small, "u").remaining == 2
    assert not sync.lane_hit(big, "u").allowed
    assert sync._deny is not None and len(sync._deny) == 1
    assert sync.lane_hit(small, "u").remaining == 1
    assert len(sync._deny) == 0

    backend = rl.AsyncRedisBackend(redis.asyncio.Redis.from_url(REDIS))
    await backend._pipe.command("PING")
    try:
        for limiter in (rl.AsyncLimiter(rl.MemoryBackend(), prefix=prefix),
                        rl.AsyncLimiter(backend, prefix=prefix)):
            assert (await limiter.lane_hit(small, "u", 1.0)).remaining == 2
            assert not (await limiter.lane_hit(big, "u", 1.0)).allowed
            assert limiter._deny is not None and len(limiter._deny) == 1
            assert (await limiter.lane_hit(small, "u", 1.0)).remaining == 1
            assert len(limiter._deny) == 0
            await limiter.reset(policy, "u")
    finally:
        await backend.aclose()


async def test_a_refusal_recorded_while_a_hit_was_out_is_forgotten_by_its_admission(
    prefix: str
) -> None:
    """Found in review: the deny cache must be asked after the reply. A cost-5 hit refused
    and recorded while a cost-1 hit of the same identity is out; the cost-1 hit is admitted
    and wrote what the refusal counted, so the refusal must go: the next cost-5 hit asks the
    store (remaining 2), as the plain path does, rather than replaying remaining 3."""
    policy = rl.Policy("6/hour", algorithm="fixed-window", name=uuid.uuid4().hex[:8])

    async def play(through_lanes: bool, tag: str) -> list[tuple[bool, int]]:
        backend = rl.AsyncRedisBackend(redis.asyncio.Redis.from_url(REDIS))
        limiter = rl.AsyncLimiter(backend, prefix=prefix + tag)
        small, big = Lane(policy, 1, prefix + tag), Lane(policy, 5, prefix + tag)

        async def hit(lane: Lane) -> rl.Decision:
            if through_lanes:
                return await limiter.lane_hit(lane, "u", 1.0)
            return await limiter._replay_ask([lane.check("u")], 1.0)

        try:
            for _ in range(3):
                await hit(small)
            refused, admitted = await asyncio.gather(hit(big), hit(small))
            again = await hit(big)
            return [(d.allowed, d.remaining) for d in (refused, admitted, again)]
        finally:
            await limiter.reset(policy, "u")
            await backend.aclose()

    assert await play(True, "l") == await play(False, "p") == [(False, 3), (True, 2), (False, 2)]


async def test_a_sliding_log_hit_sent_again_after_a_drop_is_the_same_call(
    prefix: str, monkeypatch: pytest.MonkeyPatch, redis_client: redis.Redis
) -> None:
    """Found in review: the connection drops after the bytes were written (Redis ran the
    call, its reply is lost). The call sent again must be the very same one (same token), so
    the log holds one entry per request, as on the plain path, not two."""
    from ratelimit_mw.backends import pipeline

    write = pipeline._Protocol._write
    armed = [False]

    def write_then_drop(self: Any, data: bytes) -> None:
        write(self, data)
        if armed[0]:
            armed[0] = False
            self.close(redis.exceptions.ConnectionError("dropped after the write"))

    monkeypatch.setattr(pipeline._Protocol, "_write", write_then_drop)
    lane = _lane(prefix, "10/hour", "sliding-log")
    async with _connected(prefix) as limiter:
        await limiter.lane_hit(lane, "u", 1.0)
        armed[0] = True
        decision = await limiter.lane_hit(lane, "u", 1.0)
        # The copy sent again saw the first copy's entry (remaining 7, as the plain path
        # answers too), and wrote the same member over it: two entries for two requests.
        assert decision.allowed and decision.remaining == 7
        (key,) = redis_client.scan_iter(match=f"{prefix}:*")
        assert redis_client.zcard(key) == 2


async def test_a_memory_backend_with_an_arun_of_its_own_is_asked_through_it() -> None:
    asked: list[ScriptCall] = []

    class Watched(rl.MemoryBackend):
        async def arun(self, call: ScriptCall) -> list[int]:
            asked.append(call)
            return await super().arun(call)

    limiter = rl.AsyncLimiter(Watched())
    lane = Lane(rl.Policy("2/minute"), 1, "rl")
    assert (await limiter.lane_hit(lane, "u")).remaining == 1
    assert len(asked) == 1
    assert rl.AsyncLimiter(rl.MemoryBackend())._inline() is not None
