"""The pipelined connection keeps the middleware's deadline without a timer per call.

A caller's give-up time goes into one heap per connection, served by one timer: past it the
call fails with TimeoutError and the connection stays, its reply read in turn and dropped.
These tests hold it to what ``asyncio.timeout`` around the call did: the same error, the
same replies for everyone else, nothing left behind.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest
import redis
import redis.asyncio

import ratelimit_mw as rl
from ratelimit_mw.backends import pipeline as _pipeline
from ratelimit_mw.backends.base import LOOK, TURNS
from ratelimit_mw.backends.protocol import RedisProtocol
from ratelimit_mw.core import codec
from ratelimit_mw.core.codec import Check
from tests.conftest import REDIS_URL


class _Loop:
    """The running loop, but for the clock and timers, which the test drives: `time()` is
    `now`, and `call_at` records what the protocol schedules instead of scheduling it."""

    def __init__(self) -> None:
        self.real = asyncio.get_running_loop()
        self.now = 1000.0
        self.timers: list[tuple[float, Any]] = []

    def time(self) -> float:
        return self.now

    def create_future(self) -> asyncio.Future[Any]:
        return self.real.create_future()

    def call_soon(self, callback: Any, *args: Any) -> Any:
        return self.real.call_soon(callback, *args)

    def call_at(self, when: float, callback: Any, *args: Any) -> Any:
        handle = asyncio.TimerHandle(when, callback, args, self.real)
        self.timers.append((when, handle))
        return handle

    async def fire(self) -> None:
        """Run the live timers that are due, as the loop would, and the turns of the real
        loop that a deadline waits for after its time (see base.Later)."""
        due = [(w, h) for w, h in self.timers if w <= self.now and not h.cancelled()]
        self.timers = [(w, h) for w, h in self.timers if (w, h) not in due]
        for _, handle in due:
            handle._run()
        for _ in range(TURNS + 1):
            await asyncio.sleep(0)

    def live(self) -> list[float]:
        return sorted(w for w, h in self.timers if not h.cancelled())


class _Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def close(self) -> None:
        pass


def _protocol(loop: _Loop, timeout: float | None = None) -> RedisProtocol:
    protocol = RedisProtocol(loop, timeout)  # type: ignore[arg-type]
    protocol.connection_made(_Transport())  # type: ignore[arg-type]
    return protocol


LOOKED = 1000.05 + LOOK  # the one look after a give-up time of 1000.05


async def test_each_call_gives_up_at_its_own_time_whatever_the_order_they_were_sent() -> None:
    loop = _Loop()
    protocol = _protocol(loop)
    late = protocol.send(b"a", give_up=1000.2)
    early = protocol.send(b"b", give_up=1000.05)
    never = protocol.send(b"c")
    await asyncio.sleep(0)  # the batch of the two last is written
    assert loop.live() == [1000.05]  # one timer, at the earliest give-up
    loop.now = 1000.05
    await loop.fire()
    assert not early.done() and loop.live() == [LOOKED]  # the loop looks once more first
    loop.now = LOOKED
    await loop.fire()
    assert isinstance(early.exception(), TimeoutError)
    assert not late.done() and not never.done()
    assert loop.live() == [1000.2]
    # Replies come in order: the first answers `late`, the second is `early`'s, dropped.
    protocol.data_received(b":1\r\n:2\r\n:3\r\n")
    assert late.result() == 1 and never.result() == 3
    loop.now = 1000.2
    await loop.fire()  # nothing left to give up: the answered entry is dropped, no timer re-armed
    assert protocol.give_ups == [] and loop.live() == []


async def test_an_answer_read_during_the_look_is_the_calls_answer() -> None:
    """The give-up time passed while the loop was busy; the reply was read at the poll that
    the look waits for: the call has it, and nothing is left to time out."""
    loop = _Loop()
    protocol = _protocol(loop)
    waiter = protocol.send(b"x", give_up=1000.05)
    loop.now = 1000.2  # the loop comes to its timers 150 ms late
    await loop.fire()
    assert not waiter.done() and loop.live() == [pytest.approx(1000.2 + 0.15)]
    protocol.data_received(b":5\r\n")
    loop.now = loop.live()[0]
    await loop.fire()
    assert waiter.result() == 5 and protocol.give_ups == [] and loop.live() == []


async def test_a_batched_call_counts_its_time_from_its_write() -> None:
    """A call made while another is in flight leaves with the next turn's batch: a loop
    saturated with ready work writes it a long turn later. Its give-up and the connection's
    deadline count from the write: the time before it was the loop's, not Redis's."""
    loop = _Loop()
    protocol = _protocol(loop, timeout=0.1)
    first = protocol.send(b"a", give_up=1000.1)  # written at once
    batched = protocol.send(b"b", give_up=1000.1)
    loop.now = 1000.08  # the turn that writes the batch comes 80 ms later
    await asyncio.sleep(0)
    assert protocol.transport.written == [b"a", b"b"]  # type: ignore[union-attr]
    assert sorted(entry[0] for entry in protocol.give_ups) == [1000.1,
                                                               pytest.approx(1000.18)]
    assert list(protocol.deadlines) == [1000.1, pytest.approx(1000.18)]
    protocol.data_received(b":1\r\n")
    for now in (1000.11, 1000.15, 1000.17):  # past a give-up counted from the send
        loop.now = now
        await loop.fire()
    assert first.result() == 1 and not batched.done()  # the batched call is within its time
    assert protocol.lost is None
    protocol.data_received(b":2\r\n")
    assert batched.result() == 2


@pytest.mark.parametrize(("late", "looks"), [(0.0, LOOK), (0.0005, LOOK), (0.15, 0.15)])
async def test_a_late_timer_gives_the_server_as_long_again_and_then_fails_the_call(
    late: float, looks: float,
) -> None:
    """A timer that runs late tells of a busy loop (a blocking call in the app): the look
    lasts as long as the timer was late, 1 ms at the least. A server still silent after it
    is failed: a hung Redis is found, one stall later."""
    loop = _Loop()
    protocol = _protocol(loop)
    waiter = protocol.send(b"x", give_up=1000.05)
    loop.now = 1000.05 + late
    await loop.fire()
    assert not waiter.done() and loop.live() == [pytest.approx(1000.05 + late + looks)]
    loop.now = loop.live()[0]
    await loop.fire()
    assert isinstance(waiter.exception(), TimeoutError) and loop.live() == []


async def test_each_overdue_call_gets_one_look_not_more() -> None:
    """A call overdue at a look fails at the next firing; one whose time came during the
    look gets a look of its own."""
    loop = _Loop()
    protocol = _protocol(loop)
    first = protocol.send(b"a", give_up=1000.05)
    second = protocol.send(b"b", give_up=1000.0505)
    await asyncio.sleep(0)  # the second is written
    loop.now = 1000.05
    await loop.fire()  # first overdue: a look
    loop.now = LOOKED
    await loop.fire()  # first has had its look; second's time came meanwhile: its own look
    assert isinstance(first.exception(), TimeoutError) and not second.done()
    assert loop.live() == [pytest.approx(LOOKED + LOOK)]
    loop.now = LOOKED + LOOK
    await loop.fire()
    assert isinstance(second.exception(), TimeoutError) and loop.live() == []


async def test_an_earlier_give_up_sent_during_a_look_neither_cuts_it_short_nor_restarts_it(
) -> None:
    """`send` re-arms the timer for an earlier give-up: the look under way still ends at
    its own time, and a stream of such calls cannot keep an overdue call looking forever."""
    loop = _Loop()
    protocol = _protocol(loop)
    overdue = protocol.send(b"a", give_up=1000.05)
    loop.now = 1000.05
    await loop.fire()  # a look, until LOOKED
    stream = []
    for step in range(1, 6):  # calls whose give-up comes before the look ends
        loop.now = 1000.05 + step * LOOK / 10
        stream.append(protocol.send(b"x", give_up=loop.now))
        await loop.fire()
        assert not overdue.done()  # its look is not over
    loop.now = LOOKED
    await loop.fire()
    assert isinstance(overdue.exception(), TimeoutError)
    assert not any(call.done() for call in stream)  # due during the look: one of their own
    loop.now = LOOKED + LOOK
    await loop.fire()
    assert all(isinstance(call.exception(), TimeoutError) for call in stream)
    assert loop.live() == []


async def test_the_connection_deadline_looks_once_before_it_hangs_up() -> None:
    """`socket_timeout` on the connection: the oldest reply overdue, then a look; a reply
    read meanwhile keeps the connection; none read, and the connection is given up."""
    loop = _Loop()
    kept = _protocol(loop, timeout=0.05)
    answered = kept.send(b"x")
    loop.now = 1000.05
    await loop.fire()
    kept.data_received(b":1\r\n")
    loop.now = LOOKED
    await loop.fire()
    assert answered.result() == 1 and kept.lost is None
    dropped = _protocol(loop, timeout=0.05)
    silent = dropped.send(b"y")
    loop.now = LOOKED + 0.05
    await loop.fire()
    assert not silent.done() and dropped.lost is None
    loop.now = LOOKED + 0.05 + LOOK
    await loop.fire()
    assert isinstance(silent.exception(), redis.exceptions.TimeoutError)
    assert dropped.lost is not None


async def test_answered_calls_cost_the_timer_nothing() -> None:
    loop = _Loop()
    protocol = _protocol(loop)
    waiters = [protocol.send(b"x", give_up=1000.1 + i / 1000) for i in range(100)]
    assert len(loop.live()) == 1  # later give-ups never re-arm it
    protocol.data_received(b":7\r\n" * 100)
    assert all(w.result() == 7 for w in waiters)
    loop.now = 1000.1
    await loop.fire()
    assert protocol.give_ups == [] and loop.live() == []


async def test_a_lost_connection_fails_the_calls_and_clears_the_give_ups() -> None:
    loop = _Loop()
    protocol = _protocol(loop)
    waiter = protocol.send(b"x", give_up=1000.1)
    protocol.connection_lost(None)
    assert isinstance(waiter.exception(), redis.exceptions.ConnectionError)
    assert protocol.give_ups == [] and loop.live() == []


# -- on the real server ----------------------------------------------------------------------
def _call(prefix: str, identity: str) -> codec.ScriptCall:
    policy = rl.Policy("10/minute", algorithm="gcra", name="give-up")
    return codec.build(codec.HIT, [Check(policy, identity)], prefix)


async def test_a_call_past_its_time_fails_and_the_connection_keeps_serving(
    prefix: str, redis_client: redis.Redis
) -> None:
    backend = rl.AsyncRedisBackend(redis.asyncio.Redis.from_url(REDIS_URL))
    try:
        await backend.arun(_call(prefix, "warm"))  # connected: the give-up path applies
        pipe = backend._pipe
        protocol = pipe.ready()
        assert protocol is not None
        redis_client.execute_command("CLIENT", "PAUSE", 300, "ALL")
        with pytest.raises(TimeoutError):
            await backend.arun(_call(prefix, "slow"), 0.05)
        # Answered once the pause ends: its own reply, not the dropped one before it.
        reply = await backend.arun(_call(prefix, "next"), 5.0)
        assert reply[:3] == [1, 1, 9]
        assert pipe.ready() is protocol  # the same connection, never dropped
        assert protocol.give_ups == [] or all(w.done() for _, _, w in protocol.give_ups)
    finally:
        redis_client.execute_command("CLIENT", "UNPAUSE")
        await backend.aclose()


async def test_the_middleware_deadline_through_the_limiter_says_timed_out(prefix: str,
                                                                          redis_client: redis.Redis
                                                                          ) -> None:
    backend = rl.AsyncRedisBackend(redis.asyncio.Redis.from_url(REDIS_URL))
    limiter = rl.AsyncLimiter(backend, prefix=prefix)
    compiled = limiter.compile([(rl.Policy("10/minute", name=uuid.uuid4().hex[:8]), 1)])
    try:
        await limiter.hit_compiled(compiled, ("ip:1",))
        redis_client.execute_command("CLIENT", "PAUSE", 300, "ALL")
        outcomes = await asyncio.gather(*(limiter.hit_compiled(compiled, ("ip:1",), 0.05)
                                          for _ in range(5)), return_exceptions=True)
        assert all(type(o) is TimeoutError and not str(o) for o in outcomes)
    finally:
        redis_client.execute_command("CLIENT", "UNPAUSE")
        await backend.aclose()


async def test_a_cold_connect_on_a_loop_busy_past_the_connect_timeout_still_connects(
    prefix: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A cold worker meeting a burst (Django under ASGI has no lifespan to connect first): the
    # loop is busy for 300 ms once the socket is connected, three times the connect timeout,
    # before the set-up's round trip. The connect follows the deadline rule of every call:
    # the server is given its look (a plain timer failed it: "Timeout connecting").
    made = RedisProtocol.connection_made

    def busy_after(self: Any, transport: Any) -> None:
        made(self, transport)
        time.sleep(0.3)

    monkeypatch.setattr(RedisProtocol, "connection_made", busy_after)
    backend = rl.AsyncRedisBackend.from_url(REDIS_URL)
    assert backend._pipe.settings.connect_timeout == pytest.approx(0.1)
    try:
        reply = await backend.arun(_call(prefix, "cold"))
        assert reply[0] == 1
    finally:
        await backend.aclose()


async def test_a_cold_call_gets_its_whole_deadline_once_the_connection_is_open(
    prefix: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Setting up takes 200 ms (a cold worker's long loop turns under a burst, stood in for by a
    # slow set-up), past the call's 100 ms but within the connect timeout and three times the
    # call's deadline: the call's own time starts once the connection is open.
    handshake = _pipeline.PipelinedConnection._handshake

    async def slow(self: Any, protocol: Any) -> None:
        await asyncio.sleep(0.2)
        await handshake(self, protocol)

    monkeypatch.setattr(_pipeline.PipelinedConnection, "_handshake", slow)
    backend = rl.AsyncRedisBackend.from_url(REDIS_URL, socket_connect_timeout=1.0)
    try:
        reply = await backend.arun(_call(prefix, "cold-slow"), 0.1)
        assert reply[0] == 1
    finally:
        await backend.aclose()


async def test_a_connect_past_the_connect_timeout_is_a_backend_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def hung(self: Any, protocol: Any) -> None:
        await asyncio.Event().wait()

    monkeypatch.setattr(_pipeline.PipelinedConnection, "_handshake", hung)
    backend = rl.AsyncRedisBackend.from_url(REDIS_URL, socket_connect_timeout=0.05)
    try:
        with pytest.raises(rl.BackendError, match="Timeout connecting"):
            await backend.arun(_call("unused", "never"), 0.1)
    finally:
        await backend.aclose()


async def test_a_call_waits_for_an_opening_it_did_not_start_only_a_few_of_its_deadlines(
    prefix: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The start-up check opens the connection with the client's 5 s connect timeout, on a
    # server whose handshake does not answer yet: a request meanwhile waits three times its
    # own deadline for it, not the 5 s, and the opening goes on for the calls after it.
    gate = asyncio.Event()
    handshake = _pipeline.PipelinedConnection._handshake

    async def held(self: Any, protocol: Any) -> None:
        await gate.wait()
        await handshake(self, protocol)

    monkeypatch.setattr(_pipeline.PipelinedConnection, "_handshake", held)
    backend = rl.AsyncRedisBackend(redis.asyncio.Redis.from_url(
        REDIS_URL, socket_timeout=5, socket_connect_timeout=5))
    opening = asyncio.ensure_future(backend.aping())
    try:
        await asyncio.sleep(0)
        with pytest.raises(rl.BackendError, match="Timeout connecting"):
            await backend.arun(_call(prefix, "joined"), 0.05)
        assert not opening.done()
        gate.set()
        await opening
        reply = await backend.arun(_call(prefix, "after"), 0.1)
        assert reply[0] == 1
    finally:
        opening.cancel()
        await backend.aclose()


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "after-a-drop"])
async def test_a_call_that_joined_an_opening_which_timed_out_dials_once_more_itself(
    prefix: str, monkeypatch: pytest.MonkeyPatch, warm: bool,
) -> None:
    # An opening begun while the server was frozen (SIGSTOP, a failover) times out after the
    # server answers again: the call that joined it, with time left, dials afresh and is
    # answered (it failed on the old opening's behalf, and the breaker stayed open a
    # cool-down more: found by tests/reliability/test_memory_fallback.py under load).
    handshake = _pipeline.PipelinedConnection._handshake
    frozen = asyncio.Event()
    dials: list[bool] = []

    async def as_then(self: Any, protocol: Any) -> None:
        dials.append(frozen.is_set())
        if frozen.is_set():
            await asyncio.Event().wait()  # that opening never hears back
        await handshake(self, protocol)

    monkeypatch.setattr(_pipeline.PipelinedConnection, "_handshake", as_then)
    backend = rl.AsyncRedisBackend.from_url(REDIS_URL, socket_connect_timeout=0.2)
    try:
        if warm:
            assert (await backend.arun(_call(prefix, "before"), 0.1))[0] == 1
            backend._pipe.protocol.close(redis.ConnectionError("dropped"))
        frozen.set()
        # Cold, the call waits for the opening and names it; warm, its own deadline passes.
        with pytest.raises((rl.BackendError, TimeoutError)):
            await backend.arun(_call(prefix, "frozen"), 0.05)
        frozen.clear()  # the server answers again; the frozen opening is still pending
        reply = await backend.arun(_call(prefix, "thawed"), 0.3)
        assert reply[0] == 1
        assert dials[-2:] == [True, False]  # the frozen opening, then the call's own
    finally:
        await backend.aclose()
