"""The compiled calls (core.compiled) against the plain builder, and the limiter's one way.

Whatever applies to a request is compiled once into a `Compiled`, which memoises the fixed
parts of its call and of its bytes on the wire. `Limiter.decide` and `AsyncLimiter.decide`
take it for every hit, on every backend; the pipelined connection writes its bytes at once
and the backend awaits the connection's future itself. So:

- pure: the compiled call and its bytes against `codec.build` and hiredis's packing on
  random selections (several policies, penalties, calendars, a policy given twice),
  identities, costs and clocks;
- the failures of a call sent on an open connection: NOSCRIPT, a dropped connection, the
  caller's deadline, a cold start, a pause after the write;
- the deny cache's records on every backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import hiredis
import pytest
import redis
import redis.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st

import ratelimit_mw as rl
from ratelimit_mw.backends.redis import pack
from ratelimit_mw.core import codec, scripts
from ratelimit_mw.core.codec import Check, ScriptCall
from ratelimit_mw.core.compiled import Compiled
from ratelimit_mw.core.compiled import refunds as compiled_refunds
from tests.conftest import REDIS_URL, StepClock
from tests.test_differential import policies

REDIS = REDIS_URL


def _pack(call: ScriptCall) -> bytes:
    return hiredis.pack_command(  # type: ignore[no-any-return]
        ("EVALSHA", scripts.sha1(), len(call.keys), *call.keys, *call.args))


# -- pure ---------------------------------------------------------------------------------


def _fields(call: codec.ScriptCall) -> tuple[object, ...]:
    """What a call says (a memoised hit's arguments are a shared tuple, the plain builder's a
    list: compared as values)."""
    return (call.keys, list(call.args), *call[2:5])


@settings(max_examples=300, deadline=None)
@given(
    pool=st.lists(policies(), min_size=1, max_size=3),
    picks=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 50), st.integers(0, 2)),
                   min_size=1, max_size=3),
    names=st.lists(st.text(min_size=1, max_size=90), min_size=3, max_size=3),
    prefix=st.sampled_from(["rl", "a.b:c", "x-1"]),
    now_us=st.one_of(st.none(), st.integers(0, 2**52)),
    clock_ms=st.integers(1_600_000_000_000, 1_900_000_000_000),
)
def test_a_compiled_call_builds_and_packs_as_the_plain_builder(
    pool: list[rl.Policy], picks: list[tuple[int, int, int]], names: list[str], prefix: str,
    now_us: int | None, clock_ms: int
) -> None:
    """Any selection: one policy or several, the same policy twice (for one identity or
    two), penalties and calendars among them."""
    items = [(pool[p % len(pool)], cost) for p, cost, _ in picks]
    identities = tuple(names[i] for _, _, i in picks)
    compiled = Compiled(items, prefix)
    checks = tuple(Check(policy, identity, cost)
                   for (policy, cost), identity in zip(items, identities, strict=True))
    assert compiled.checks(identities) == checks
    token = codec.new_token() if compiled.log else None
    plain = codec.build(codec.HIT, checks, prefix, now_us=now_us, clock_ms=clock_ms,
                        token=token or "")
    call = compiled.call(identities, now_us, token, clock_ms)
    assert _fields(call) == _fields(plain)
    assert pack(call) == pack(plain) == _pack(plain)
    for op in (codec.PEEK, codec.REFUND, codec.RESET):
        assert compiled.call(identities, now_us, None, clock_ms, op) == codec.build(
            op, checks, prefix, now_us=now_us, clock_ms=clock_ms)
    for op in (codec.REFUND, codec.RENEW):  # by a hit's token: the hit's call, memoised
        made = compiled.call(identities, now_us, "tok", clock_ms, op)
        built = codec.build(op, checks, prefix, now_us=now_us, clock_ms=clock_ms, token="tok")
        assert _fields(made) == _fields(built)
        assert pack(made) == pack(built) == _pack(built)


@st.composite
def static_policies(draw: st.DrawFn) -> rl.Policy:
    """A policy whose calls are fixed by their costs (no penalty, no calendar): what a batch
    of give-backs puts together from kept bytes."""
    name = f"s{draw(st.integers(0, 10**6))}"
    if draw(st.booleans()):
        return rl.Policy.in_flight(draw(st.sampled_from([1, 3, 40])), name=name)
    periods = draw(st.lists(st.sampled_from([1_000, 60_000, 3_600_000]), min_size=1,
                            max_size=2, unique=True))
    return rl.Policy([rl.Rate(draw(st.sampled_from([1, 5, 40])), period) for period in periods],
                     algorithm=draw(st.sampled_from(sorted(rl.ALGORITHMS))), name=name)


@settings(max_examples=300, deadline=None)
@given(
    pool=st.lists(static_policies(), min_size=1, max_size=3)
    | st.lists(policies(), min_size=1, max_size=3),
    hits=st.lists(st.tuples(
        st.lists(st.tuples(st.integers(0, 2), st.integers(1, 5), st.integers(0, 2)),
                 min_size=1, max_size=2),
        st.sampled_from(["t1", "t2", "t3", "t4", "t5", "t6"]),
        st.sampled_from(["-", "-", "1700000000000000", "1700000000000001"]),
    ), min_size=2, max_size=4),
    names=st.lists(st.text(min_size=1, max_size=90), min_size=3, max_size=3),
    prefix=st.sampled_from(["rl", "a.b:c"]),
    now_us=st.one_of(st.none(), st.integers(0, 2**52)),
)
def test_a_batch_of_give_backs_is_the_plain_builders_call(
    pool: list[rl.Policy], hits: list[tuple[list[tuple[int, int, int]], str, str]],
    names: list[str], prefix: str, now_us: int | None
) -> None:
    """Several hits given back in one call (the responses that ended in one turn), each by
    its token and charge, from their compiled selections (one per selection, as a limiter
    keeps them): the call `codec.build` makes of them, bytes and all; or None (then
    `codec.build`'s) where one selection is not static or two hits share a token."""
    parts, checks, tokens, charges = [], [], [], []
    selections: dict[tuple[tuple[rl.Policy, int], ...], Compiled] = {}
    for picks, token, charge in hits:
        items = tuple((pool[p % len(pool)], cost) for p, cost, _ in picks)
        identities = tuple(names[i] for _, _, i in picks)
        compiled = selections.setdefault(items, Compiled(items, prefix))
        parts.append((compiled, identities, token, charge))
        for (policy, cost), identity in zip(items, identities, strict=True):
            checks.append(Check(policy, identity, cost))
            tokens.append(token)
            charges.append(charge)
    made = compiled_refunds(parts, now_us)
    if made is None:
        assert (not all(compiled.static for compiled, _, _, _ in parts)
                or len({token for _, token, _ in hits}) < len(hits))
        return
    built = codec.build(codec.REFUND, checks, prefix, now_us=now_us, tokens=tokens,
                        charges=charges)
    assert _fields(made) == _fields(built)
    assert pack(made) == _pack(built)


def test_a_batch_of_give_backs_falls_back_where_a_token_is_missing_or_shared() -> None:
    slots = Compiled([(rl.Policy.in_flight(3), 1)], "rl")
    assert compiled_refunds([(slots, ("u",), "t1", "-"), (slots, ("v",), "t2", "-")])
    for tokens in (("t1", "t1"), ("t1", ""), ("t 1", "t2")):
        assert compiled_refunds([(slots, ("u",), tokens[0], "-"),
                                 (slots, ("v",), tokens[1], "-")]) is None


async def test_a_limiter_gives_back_a_turns_slots_in_one_call(prefix: str) -> None:
    """Three responses' slots given back together (a loop turn's): one call to the real
    Redis frees all three; a give-back without a token among them (a count_when's hit)
    takes the call `codec.build` makes, and frees the others all the same."""
    rate, slots = rl.Policy("100/minute", name="r"), rl.Policy.in_flight(3, name="s")
    backend = rl.AsyncRedisBackend.from_url(REDIS)
    limiter = rl.AsyncLimiter(backend, prefix=prefix, deny_cache=0)
    sent: list[codec.ScriptCall] = []
    arun = backend.arun

    async def counted(call: codec.ScriptCall, deadline: float | None = None) -> list[int]:
        sent.append(call)
        return await arun(call, deadline)

    backend.arun = counted  # type: ignore[method-assign]
    compiled = limiter.compile([(rate, 1), (slots, 1)])
    held = (Check(slots, "u", 1),)
    try:
        for round_ in range(2):
            for i in range(3):
                assert (await limiter.hit_compiled(compiled, ("u", "u"),
                                                   token=f"r{round_}t{i}")).allowed
            assert not (await limiter.hit_compiled(compiled, ("u", "u"),
                                                   token=f"r{round_}full")).allowed
            sent.clear()
            given = [(held, f"r{round_}t{i}", 0) for i in range(3)]
            if round_:  # a hit given back without a token: each its own call
                given.append(((Check(rate, "u", 1),), None, 0))
            await limiter.give_back_all(given)
            if round_:  # the tokenless hit's call, then the batch, both built by codec
                assert len(sent) == 2 and all(call.wire is None for call in sent)
            else:  # one call, its bytes put together from the kept ones
                assert len(sent) == 1 and sent[0].wire is not None
            assert (await limiter.peek(slots, "u")).remaining == 3
        # Six hits charged (the refused ones never were), one given back.
        assert (await limiter.peek(rate, "u")).remaining == 95
    finally:
        await limiter.reset(rate, "u")
        await limiter.reset(slots, "u")
        await backend.aclose()


def test_a_compiled_hit_takes_policies_and_whole_costs_only() -> None:
    with pytest.raises(rl.ConfigurationError, match="cost"):
        Compiled([(rl.Policy("1/second"), 0)], "rl")
    with pytest.raises(rl.ConfigurationError, match="Policy"):
        Compiled([("1/second", 1)], "rl")  # type: ignore[list-item]
    with pytest.raises(rl.ConfigurationError, match="at least one"):
        Compiled([], "rl")


def test_a_sliding_log_hit_is_named_by_a_fresh_token_each_time() -> None:
    compiled = Compiled([(rl.Policy("5/minute;9/hour", algorithm="sliding-log"), 1)], "rl")
    assert pack(compiled.call(("u",))) != pack(compiled.call(("u",)))
    assert compiled.call(("u",)).args[2] != compiled.call(("u",)).args[2]


def test_a_returning_client_gets_the_same_call_and_bytes() -> None:
    policy = rl.Policy("5/minute", algorithm="fixed-window")
    compiled = Compiled([(policy, 1)], "rl")
    first = compiled.call(("u",))
    assert compiled.call(("u",)) is first  # kept: built once per client
    plain = codec.build(codec.HIT, [Check(policy, "u", 1)], "rl")
    assert first.keys == plain.keys and pack(first) == pack(plain) == _pack(plain)
    # Only the common hit is kept: the app's clock, or a token, is a call of its own.
    assert compiled.call(("u",), now_us=1) is not compiled.call(("u",), now_us=1)
    long = "x" * 65  # past the identity encoding's cache: not kept either
    assert compiled.call((long,)) is not compiled.call((long,))


def test_the_kept_calls_are_bounded() -> None:
    from ratelimit_mw.core import compiled as module

    # One bound for every compiled hit at once: dynamic costs make a Compiled each.
    first = Compiled([(rl.Policy("5/minute", algorithm="fixed-window"), 1)], "rl")
    kept = first.call(("u0",))
    for cost in range(1, 5):
        compiled = Compiled([(rl.Policy("5/minute", algorithm="fixed-window"), cost)], "rl")
        for i in range(module._CALLS_KEPT // 4 + 1):
            compiled.call((f"u{i}",))
            assert len(module._kept) <= module._CALLS_KEPT
    assert first.call(("u0",)) is not kept  # emptied whole when full, then built again


def test_a_limiter_compiles_each_set_once() -> None:
    limiter = rl.Limiter()
    policy = rl.Policy("1/second")
    assert limiter.compile([(policy, 1)]) is limiter.compile([(policy, 1)])
    assert limiter.compile([(policy, 2)]) is not limiter.compile([(policy, 1)])


@pytest.mark.parametrize("rates", ["4/second", "4/second;9/minute"])
@pytest.mark.parametrize("algorithm", sorted(rl.ALGORITHMS))
def test_hits_at_one_instant_fill_the_quota_sync_and_async(algorithm: str, rates: str) -> None:
    clock = StepClock()
    policy = rl.Policy(rates, algorithm=algorithm)  # type: ignore[arg-type]
    sync = rl.Limiter(clock=clock)
    assert [sync.hit(policy, "u").allowed for _ in range(5)] == [True] * 4 + [False]

    async def play() -> list[bool]:
        limiter = rl.AsyncLimiter(clock=clock)
        return [(await limiter.hit(policy, "u")).allowed for _ in range(5)]

    assert asyncio.run(play()) == [True] * 4 + [False]


# -- a call sent on an open connection: its failures on the real Redis ---------------------


def _compiled(prefix: str, limit: str = "5/minute", algorithm: str = "fixed-window"
          ) -> Compiled:
    policy = rl.Policy(limit, algorithm=algorithm, name=uuid.uuid4().hex[:8])  # type: ignore[arg-type]
    return Compiled([(policy, 1)], prefix)


@contextlib.asynccontextmanager
async def _connected(prefix: str) -> AsyncIterator[rl.AsyncLimiter]:
    """A limiter on the real Redis whose pipelined connection is open (hits are written at
    once), closed afterwards."""
    backend = rl.AsyncRedisBackend(redis.asyncio.Redis.from_url(REDIS))
    await backend._pipe.command("PING")
    try:
        yield rl.AsyncLimiter(backend, prefix=prefix)
    finally:
        await backend.aclose()


def _on_send(backend: rl.AsyncRedisBackend, then: Any) -> None:
    """Call `then(packed)` after each call the open connection writes at once."""
    protocol = backend._pipe.ready()
    assert protocol is not None
    send = protocol.send

    def sending(packed: bytes, *args: Any, **options: Any) -> Any:
        waiter = send(packed, *args, **options)
        then(packed)
        return waiter

    protocol.send = sending


async def test_a_cold_start_connects_then_writes_at_once(prefix: str) -> None:
    backend = rl.AsyncRedisBackend(redis.asyncio.Redis.from_url(REDIS))
    limiter = rl.AsyncLimiter(backend, prefix=prefix)
    hit = _compiled(prefix)
    sent: list[bytes] = []
    try:
        first = await limiter.hit_compiled(hit, ("ip:1",), 1.0)  # no connection yet: it connects
        _on_send(backend, sent.append)
        second = await limiter.hit_compiled(hit, ("ip:1",), 1.0)
        assert (first.remaining, second.remaining) == (4, 3)
        assert sent == [pack(hit.call(("ip:1",)))]
    finally:
        await backend.aclose()


async def test_a_refusal_is_counted_down_from_the_moment_its_call_was_sent(
    prefix: str
) -> None:
    # The process pauses 100 ms right after the write (a GC pause, a busy loop): the deny
    # cache must still count the refusal from the send, as every other path does, or it
    # refuses a hit that the store would admit.
    clock = StepClock()
    backend = rl.AsyncRedisBackend(redis.asyncio.Redis.from_url(REDIS))
    await backend._pipe.command("PING")
    limiter = rl.AsyncLimiter(backend, prefix=prefix, clock=clock)
    hit = Compiled([(rl.Policy("1/second", algorithm="gcra", name="pause"), 1)], prefix)
    pauses: list[int] = []

    def pausing(packed: bytes) -> None:
        if pauses:
            clock.advance_ms(pauses.pop())

    _on_send(backend, pausing)
    try:
        sent_at = clock.us
        assert (await limiter.hit_compiled(hit, ("ip:1",), 1.0)).allowed
        pauses.append(100)
        refused = await limiter.hit_compiled(hit, ("ip:1",), 1.0)
        assert not refused.allowed and refused.retry_after == 1.0
        assert limiter._deny is not None
        assert [entry.decided for entry in limiter._deny.entries.values()] == [sent_at]
        clock.us = sent_at + 1_000_000  # when the store admits again
        assert (await limiter.hit_compiled(hit, ("ip:1",), 1.0)).allowed
    finally:
        await backend.aclose()


async def test_after_a_script_flush_the_script_is_loaded_and_the_hit_counted_once(
    prefix: str, redis_client: redis.Redis
) -> None:
    hit = _compiled(prefix)
    async with _connected(prefix) as limiter:
        assert (await limiter.hit_compiled(hit, ("ip:1",), 1.0)).remaining == 4
        redis_client.script_flush()
        assert (await limiter.hit_compiled(hit, ("ip:1",), 1.0)).remaining == 3
        assert (await limiter.peek(hit.policies[0], "ip:1")).remaining == 3


async def test_a_dropped_connection_is_reopened_and_the_hit_counted_once(
    prefix: str, redis_client: redis.Redis
) -> None:
    hit = _compiled(prefix)
    async with _connected(prefix) as limiter:
        assert (await limiter.hit_compiled(hit, ("ip:1",), 1.0)).remaining == 4
        redis_client.client_kill_filter(_type="normal", skipme=True)
        decisions = await asyncio.gather(*(limiter.hit_compiled(hit, ("ip:1",), 1.0)
                                           for _ in range(3)))
        assert sorted(d.remaining for d in decisions) == [1, 2, 3]
        assert (await limiter.peek(hit.policies[0], "ip:1")).remaining == 1


async def test_a_call_past_the_deadline_fails_and_is_never_sent_again(
    prefix: str, redis_client: redis.Redis
) -> None:
    hit = _compiled(prefix)
    async with _connected(prefix) as limiter:
        try:
            redis_client.execute_command("CLIENT", "PAUSE", 200, "WRITE")
            with pytest.raises(TimeoutError):
                await limiter.hit_compiled(hit, ("ip:1",), 0.05)
            # Redis ran it once the pause ended (a call that gave up may still have been
            # applied); the limiter did not send it a second time.
            assert (await limiter.hit_compiled(hit, ("ip:1",), 5.0)).remaining == 3
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
def test_which_outcomes_of_a_written_call_send_it_again_whole(outcome: Any,
                                                              means: Any) -> None:
    backend = rl.AsyncRedisBackend(redis.asyncio.Redis.from_url(REDIS))
    if means is None:
        assert backend._settle(outcome) is None
    else:
        with pytest.raises(means):
            backend._settle(outcome)


async def test_every_backend_answers_the_compiled_hit(prefix: str) -> None:
    for backend in (rl.MemoryBackend(),
                    rl.AsyncRedisBackend(redis.asyncio.Redis.from_url(REDIS, protocol=3))):
        limiter = rl.AsyncLimiter(backend, prefix=prefix)  # type: ignore[arg-type]
        hit = _compiled(prefix, "2/minute")
        answers = [await limiter.hit_compiled(hit, ("ip:1",), 1.0) for _ in range(3)]
        assert [d.allowed for d in answers] == [True, True, False]
        await limiter.reset(hit.policies[0], "ip:1")



# -- the deny cache's records, on every backend ----------------------------------------------


def test_a_metrics_hook_sees_each_compiled_hit() -> None:
    seen: list[tuple[str, str]] = []

    class Hook:
        def observe(self, event: str, policy: str, seconds: float) -> None:
            seen.append((event, policy))

    limiter = rl.Limiter(rl.MemoryBackend(), metrics=Hook())
    hit = Compiled([(rl.Policy("1/minute", name="m"), 1)], "rl")
    assert [limiter.hit_compiled(hit, ("u",)).allowed for _ in range(2)] == [True, False]
    assert seen == [("admitted", "m"), ("refused", "m")]


async def test_an_admitted_hit_forgets_the_refusals_held_for_its_identity(
    prefix: str
) -> None:
    """A hit of cost 1 admitted while a refusal of cost 3 is held for the same policy and
    identity wrote what that refusal counted: the deny cache must drop it (as `record` does
    on the plain path), on both limiters. (The memory store decides every hit itself: no
    refusal is held in front of it.)"""
    policy = rl.Policy("3/minute", algorithm="fixed-window", name=uuid.uuid4().hex[:8])
    big, small = Compiled([(policy, 3)], prefix), Compiled([(policy, 1)], prefix)

    sync = rl.Limiter(rl.RedisBackend.from_url(REDIS), prefix=prefix)
    try:
        assert sync.hit_compiled(small, ("u",)).remaining == 2
        assert not sync.hit_compiled(big, ("u",)).allowed
        assert sync._deny is not None and len(sync._deny) == 1
        assert sync.hit_compiled(small, ("u",)).remaining == 1
        assert len(sync._deny) == 0
        sync.reset(policy, "u")
    finally:
        sync.backend.close()

    backend = rl.AsyncRedisBackend(redis.asyncio.Redis.from_url(REDIS))
    await backend._pipe.command("PING")
    try:
        for limiter in (rl.AsyncLimiter(rl.MemoryBackend(), prefix=prefix),
                        rl.AsyncLimiter(backend, prefix=prefix)):
            held = 0 if limiter.local_store else 1
            assert (await limiter.hit_compiled(small, ("u",), 1.0)).remaining == 2
            assert not (await limiter.hit_compiled(big, ("u",), 1.0)).allowed
            assert limiter._deny is not None and len(limiter._deny) == held
            assert (await limiter.hit_compiled(small, ("u",), 1.0)).remaining == 1
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
    store (remaining 2) rather than replaying remaining 3; written at once on an open
    connection or sent the complete way (a RESP3 client's) alike."""
    policy = rl.Policy("6/hour", algorithm="fixed-window", name=uuid.uuid4().hex[:8])

    async def play(protocol: int, tag: str) -> list[tuple[bool, int]]:
        backend = rl.AsyncRedisBackend(redis.asyncio.Redis.from_url(REDIS, protocol=protocol))
        limiter = rl.AsyncLimiter(backend, prefix=prefix + tag)
        small, big = Compiled([(policy, 1)], prefix + tag), Compiled([(policy, 5)], prefix + tag)

        async def hit(compiled: Compiled) -> rl.Decision:
            return await limiter.hit_compiled(compiled, ("u",), 1.0)

        try:
            for _ in range(3):
                await hit(small)
            refused, admitted = await asyncio.gather(hit(big), hit(small))
            again = await hit(big)
            return [(d.allowed, d.remaining) for d in (refused, admitted, again)]
        finally:
            await limiter.reset(policy, "u")
            await backend.aclose()

    assert await play(2, "l") == await play(3, "p") == [(False, 3), (True, 2), (False, 2)]


async def test_a_sliding_log_hit_sent_again_after_a_drop_is_the_same_call(
    prefix: str, monkeypatch: pytest.MonkeyPatch, redis_client: redis.Redis
) -> None:
    """Found in review: the connection drops after the bytes were written (Redis ran the
    call, its reply is lost). The call sent again must be the very same one (same token), so
    the log holds one entry per request, not two."""
    from ratelimit_mw.backends.protocol import RedisProtocol

    write = RedisProtocol._write
    armed = [False]

    def write_then_drop(self: Any, data: bytes) -> None:
        write(self, data)
        if armed[0]:
            armed[0] = False
            self.close(redis.exceptions.ConnectionError("dropped after the write"))

    monkeypatch.setattr(RedisProtocol, "_write", write_then_drop)
    hit = _compiled(prefix, "10/hour", "sliding-log")
    async with _connected(prefix) as limiter:
        await limiter.hit_compiled(hit, ("u",), 1.0)
        armed[0] = True
        decision = await limiter.hit_compiled(hit, ("u",), 1.0)
        # The copy sent again saw the first copy's entry (remaining 7), and wrote the same
        # member over it: two entries for two requests.
        assert decision.allowed and decision.remaining == 7
        (key,) = redis_client.scan_iter(match=f"{prefix}:*")
        assert redis_client.zcard(key) == 2


async def test_a_memory_backend_with_an_arun_of_its_own_is_asked_through_it() -> None:
    asked: list[ScriptCall] = []

    class Watched(rl.MemoryBackend):
        async def arun(self, call: ScriptCall, deadline: float | None = None) -> list[int]:
            asked.append(call)
            return await super().arun(call, deadline)

    limiter = rl.AsyncLimiter(Watched())
    hit = Compiled([(rl.Policy("2/minute"), 1)], "rl")
    assert (await limiter.hit_compiled(hit, ("u",))).remaining == 1
    assert len(asked) == 1
