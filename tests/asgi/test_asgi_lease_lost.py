"""A holder paused past its lease (issue 43, item 6): the renewal finds its lease ended.

On the test clock, under the ASGI middleware, on memory and the real Redis: a slot still free
is taken again by the renewal (the limit holds: a newcomer is refused); a slot another request
took meanwhile is reported (the ``lease_lost`` metric, one log line) and ``on_lease_lost``
applies: "continue" lets the response finish, "end" raises `LeaseLost` into it at its next
chunk. The pause is the test clock jumping past the lease between two chunks of a stream."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from test_asgi_in_flight import Exchange, answered, app_of, closed

import ratelimit_mw as rl
from ratelimit_mw.asgi import RateLimitMiddleware
from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.http.slots import LeaseLost
from ratelimit_mw.http.verdict import Held


class Events:
    def __init__(self) -> None:
        self.seen: Counter[tuple[str, str]] = Counter()

    def observe(self, event: str, policy: str, seconds: float) -> None:
        self.seen[(event, policy)] += 1


@pytest.fixture(autouse=True)
def _swept(prefix: str, redis_client: Any) -> Iterator[None]:
    yield
    for key in redis_client.scan_iter(f"{prefix}:*"):
        redis_client.delete(key)


async def until(condition: Any) -> None:
    """Wait (real time, a few seconds at most) until `condition()` holds."""
    for _ in range(3000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the condition never held")


class Paused:
    """/stream holds 1 slot (3 s lease): chunk "a", then it waits for `resume` while the
    test clock jumps past the lease (the pause), then "b" (renewed first), then waits for
    `finish`, then "c". /other takes the same slots (name=) and waits for `finish`."""

    def __init__(self, limiter: rl.AsyncLimiter, **options: Any) -> None:
        self.resume, self.finish = asyncio.Event(), asyncio.Event()
        self.sent: list[str] = []
        self.entered: list[str] = []

        async def chunks() -> AsyncIterator[bytes]:
            for part, wait in (("a", self.resume), ("b", self.finish), ("c", None)):
                yield part.encode()
                self.sent.append(part)
                if wait is not None:
                    await wait.wait()

        @limiter.limit(concurrency=rl.Policy.in_flight(1, lease=3), name="stream")
        async def stream(request: Request) -> Response:
            return StreamingResponse(chunks())

        @limiter.limit(concurrency=rl.Policy.in_flight(1, lease=3), name="stream")
        async def other(request: Request) -> Response:
            self.entered.append("other")
            await self.finish.wait()
            return StreamingResponse(iter([b"o"]))

        self.app = app_of(limiter, [Route("/stream", stream), Route("/other", other)],
                          **options)


def test_a_renewal_after_a_pause_takes_the_still_free_slot_again(
        abackend: Any, prefix: str, clock: Any) -> None:
    async def main() -> None:
        events = Events()
        limiter = rl.AsyncLimiter(abackend, prefix=prefix, clock=clock, sleep=clock.asleep,
                                  metrics=events)
        paused = Paused(limiter)
        holder = Exchange(paused.app, "/stream")
        await until(lambda: paused.sent == ["a"])
        clock.advance(4)  # paused past the 3 s lease; nobody came meanwhile
        paused.resume.set()
        # Chunk "b"'s renewal found the lease ended and the slot free: taken again.
        await until(lambda: paused.sent == ["a", "b"])
        late = await answered(paused.app, "/stream")
        assert late.status == 429, "the resumed holder must hold its slot again"
        paused.finish.set()
        await holder.task
        assert holder.body == b"abc"
        assert not [key for key in events.seen if key[0] == "lease_lost"]
        assert (await answered(paused.app, "/stream")).status == 200  # given back at the end
        await closed(limiter)

    asyncio.run(main())


@pytest.mark.parametrize("choice", ["continue", "end"])
def test_a_slot_taken_by_another_while_paused_is_reported_and_on_lease_lost_applies(
        abackend: Any, prefix: str, clock: Any, caplog: Any, choice: str) -> None:
    async def main() -> None:
        events = Events()
        limiter = rl.AsyncLimiter(abackend, prefix=prefix, clock=clock, sleep=clock.asleep,
                                  metrics=events)
        paused = Paused(limiter, on_lease_lost=choice)
        holder = Exchange(paused.app, "/stream")
        await until(lambda: paused.sent == ["a"])
        clock.advance(4)  # paused past its lease: the slot is free ...
        taker = Exchange(paused.app, "/other")  # ... and another request takes it
        await until(lambda: paused.entered == ["other"])
        with caplog.at_level(logging.WARNING, logger="ratelimit_mw"):
            paused.resume.set()  # chunk "b"'s renewal finds the slot gone
            if choice == "end":
                with pytest.raises(LeaseLost):
                    await holder.task
            else:
                await until(lambda: paused.sent == ["a", "b"])
        assert events.seen[("lease_lost", "stream")] == 1
        assert "ended before its renewal" in caplog.text
        assert f"on_lease_lost={choice!r}" in caplog.text
        # The taker holds the slot: a third request is refused (the lost holder's end, if
        # it has ended, gave back nothing of another's).
        assert (await answered(paused.app, "/stream")).status == 429
        paused.finish.set()
        await taker.task
        assert taker.status == 200
        if choice == "continue":
            await holder.task
        # "continue": the body went out whole; "end": nothing after the lost renewal.
        assert holder.body == (b"abc" if choice == "continue" else b"a")
        assert events.seen[("lease_lost", "stream")] == 1  # once per response
        assert (await answered(paused.app, "/stream")).status == 200
        await closed(limiter)

    asyncio.run(main())


def test_the_timer_renewal_of_a_silent_response_finds_its_slot_gone(
        abackend: Any, prefix: str) -> None:
    """A response that sends nothing is renewed by the holders' timer (real time, a 0.3 s
    lease): a slot lost meanwhile (its lease ended in the store, taken by another: here,
    the store's entry replaced by hand) ends it at its next chunk with "end"."""
    async def main() -> None:
        events = Events()
        limiter = rl.AsyncLimiter(abackend, prefix=prefix, metrics=events)
        step = asyncio.Event()

        async def chunks() -> AsyncIterator[bytes]:
            yield b"a"
            await step.wait()
            yield b"b"

        @limiter.limit(concurrency=rl.Policy.in_flight(1, lease=0.3))
        async def quiet(request: Request) -> Response:
            return StreamingResponse(chunks())

        app = app_of(limiter, [Route("/quiet", quiet)], on_lease_lost="end")
        holder = Exchange(app, "/quiet")
        await until(lambda: holder.started.is_set())
        middleware = app.middleware_stack
        while not isinstance(middleware, RateLimitMiddleware):
            middleware = middleware.app
        holding = next(iter(next(iter(middleware.guard.holders.values())).live))
        # The holder is its own Held: every field of one is set (it sets them itself).
        assert [name for name in Held.__slots__ if not hasattr(holding, name)] == []
        # Another request took the slot while this one's lease had ended: in the store,
        # another token holds it.
        check = holding.checks[0]
        await limiter.renew((check,), "x" * 16)  # nothing to renew: no-op
        await limiter._give_back((check,), None, holding.token)
        other = await limiter.hit_compiled(*limiter.compiled_checks((check,)), token="y" * 16)
        assert other.allowed
        # The timer renews (due at 0.1 s, seen by the next tick), before the other's 0.3 s
        # lease ends (it would be free again then, and taken back).
        await until(lambda: holding.lost)
        step.set()
        with pytest.raises(LeaseLost):
            await holder.task
        assert holder.body == b"a"
        assert [n for (event, _), n in events.seen.items() if event == "lease_lost"] == [1]
        await limiter._give_back((check,), None, "y" * 16)
        await closed(limiter)

    asyncio.run(main())


def test_a_renewal_the_timer_asked_for_does_not_take_back_slots_given_back_meanwhile(
) -> None:
    """The holders' timer schedules a renewal; the response ends before it runs (a busy
    loop): its slots, given back in place, stay free (a renewal past its lease takes ended
    slots again where there is room)."""
    async def main() -> None:
        limiter = rl.AsyncLimiter(rl.MemoryBackend())
        step = asyncio.Event()

        async def chunks() -> AsyncIterator[bytes]:
            yield b"a"
            await step.wait()
            yield b"b"

        @limiter.limit(concurrency=rl.Policy.in_flight(1, lease=0.3))
        async def quiet(request: Request) -> Response:
            return StreamingResponse(chunks())

        app = app_of(limiter, [Route("/quiet", quiet)])
        holder = Exchange(app, "/quiet")
        await until(lambda: holder.started.is_set())
        middleware = app.middleware_stack
        while not isinstance(middleware, RateLimitMiddleware):
            middleware = middleware.app
        holding = next(iter(next(iter(middleware.guard.holders.values())).live))
        check = holding.checks[0]  # the route's own in-flight policy
        await until(lambda: limiter.monotonic() >= holding.next)  # a renewal is due
        holding.renew()  # the timer's: a task, not run yet
        assert holding.end() is None  # in place: the store is in this process
        await asyncio.sleep(0)  # the renewal's task runs now
        assert (await limiter.peek(check.policy, check.identity)).remaining == 1
        step.set()
        await holder.task
        assert holder.body == b"ab"
        await closed(limiter)

    asyncio.run(main())


def test_on_lease_lost_is_checked_when_the_middleware_is_built() -> None:
    with pytest.raises(ConfigurationError, match='on_lease_lost must be "continue"'):
        RateLimitMiddleware(app_of, limiter=rl.AsyncLimiter(), concurrency=2,
                            on_lease_lost="stop")
    assert RateLimitMiddleware(app_of, limiter=rl.AsyncLimiter(), concurrency=2
                               ).guard.config.on_lease_lost == "continue"
