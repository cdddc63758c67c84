"""In-flight limits under the ASGI middleware: slots taken with the rates in one call, held
while the response runs (a streamed body, a WebSocket's whole connection), given back once
the last chunk has gone out, when the client goes away or the app raises, and renewed while
a long response runs. Requests are driven at the ASGI level, so that several are in flight
at once and a body can stop half way; on memory and the real Redis (`abackend`)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocket, WebSocketDisconnect

import ratelimit_mw as rl
from ratelimit_mw.asgi import RateLimitMiddleware, Rule
from ratelimit_mw.core.errors import BackendError
from ratelimit_mw.routing import route_limits


@pytest.fixture(autouse=True)
def _swept(prefix: str, redis_client: Any) -> Iterator[None]:
    """What a test wrote to the real Redis goes with it (rates; slots are given back)."""
    yield
    for key in redis_client.scan_iter(f"{prefix}:*"):
        redis_client.delete(key)


class Exchange:
    """One request sent to an ASGI app: the messages it sent back; `leave()` makes the
    client go away (``http.disconnect``)."""

    def __init__(self, app: Any, path: str, client: str = "10.0.0.1") -> None:
        self.messages: list[dict[str, Any]] = []
        self.gone = asyncio.Event()
        self.started = asyncio.Event()
        scope = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(),
                 "root_path": "", "query_string": b"", "headers": [], "scheme": "http",
                 "server": ("t", 80), "client": (client, 1234), "http_version": "1.1",
                 "asgi": {"version": "3.0"}}
        self.task = asyncio.get_running_loop().create_task(self._run(app, scope))

    async def _run(self, app: Any, scope: dict[str, Any]) -> None:
        sent_body = False

        async def receive() -> dict[str, Any]:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": b"", "more_body": False}
            await self.gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            self.messages.append(message)
            self.started.set()

        await app(scope, receive, send)

    def leave(self) -> None:
        self.gone.set()

    @property
    def status(self) -> int:
        return int(self.messages[0]["status"])

    @property
    def headers(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.messages[0]["headers"]}

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages[1:])


async def answered(app: Any, path: str = "/", client: str = "10.0.0.1") -> Exchange:
    exchange = Exchange(app, path, client)
    await exchange.task
    return exchange


def app_of(limiter: rl.AsyncLimiter, routes: list[Any], **options: Any) -> Any:
    app = Starlette(routes=routes)
    app.add_middleware(RateLimitMiddleware, limiter=limiter, **options)
    return app


async def closed(limiter: rl.AsyncLimiter) -> None:
    close = getattr(limiter.backend, "aclose", None)
    if close is not None:
        await close()


def test_a_slot_is_refused_while_held_and_a_refusal_charges_no_rate(
        alimiter: rl.AsyncLimiter) -> None:
    async def main() -> None:
        gate = asyncio.Event()

        @alimiter.limit("100/minute", concurrency=2)
        async def slow(request: Request) -> Response:
            await gate.wait()
            return PlainTextResponse("ok")

        app = app_of(alimiter, [Route("/slow", slow)])
        holders = [Exchange(app, "/slow") for _ in range(2)]
        await asyncio.gather(*(asyncio.sleep(0) for _ in range(20)))
        refused = await answered(app, "/slow")
        assert refused.status == 429
        assert refused.headers["ratelimit"] == '"in flight";r=0;t=1'
        assert refused.headers["retry-after"] == "1"
        assert refused.headers["ratelimit-policy"] == (
            '"minute";q=100;w=60, "in flight";q=2;qu="concurrent-requests"')
        assert json.loads(refused.body) == {
            "detail": "Too Many Requests: 2 requests in flight at most; retry when one has "
                      "ended", "retry_after": 1}
        gate.set()
        await asyncio.gather(*(holder.task for holder in holders))
        again = await answered(app, "/slow")
        # Two admitted before, this one: the refusal took nothing of the 100/minute.
        assert (again.status, again.headers["ratelimit"]) == (200, '"minute";r=97;t=60')
        await closed(alimiter)

    asyncio.run(main())


def test_a_request_refused_by_its_rate_takes_no_slot(alimiter: rl.AsyncLimiter) -> None:
    async def main() -> None:
        async def ok(request: Request) -> Response:
            return PlainTextResponse("ok")

        gate = asyncio.Event()

        async def held(request: Request) -> Response:
            await gate.wait()
            return PlainTextResponse("held")

        app = app_of(alimiter, [Route("/a", ok), Route("/b", held)], concurrency=1,
                     rules=[Rule("/a", "1/minute")])
        assert (await answered(app, "/a")).status == 200
        refused = await answered(app, "/a")
        assert (refused.status, refused.headers["ratelimit"]) == (429, '"minute";r=0;t=60')
        # Had the refusal taken the one slot, this would be refused for it.
        holder = Exchange(app, "/b")
        await asyncio.gather(*(asyncio.sleep(0) for _ in range(20)))
        assert not holder.task.done()
        assert (await answered(app, "/b")).headers["ratelimit"] == '"in flight";r=0;t=1'
        gate.set()
        await holder.task
        assert holder.status == 200
        await closed(alimiter)

    asyncio.run(main())


def test_the_slot_comes_back_after_the_last_chunk_before_background_work(
        alimiter: rl.AsyncLimiter) -> None:
    async def main() -> None:
        background = asyncio.Event()
        calls: list[int] = []

        async def wait() -> None:
            if len(calls) == 1:
                await background.wait()

        @alimiter.limit(concurrency=1)
        async def export(request: Request) -> Response:
            calls.append(1)
            return PlainTextResponse("done", background=BackgroundTask(wait))

        app = app_of(alimiter, [Route("/export", export)])
        first = Exchange(app, "/export")
        while len(first.messages) < 2:
            await asyncio.sleep(0)
        # The response has been sent; its background task still runs, without the slot.
        second = await answered(app, "/export")
        assert (second.status, first.task.done()) == (200, False)
        background.set()
        await first.task
        assert first.status == 200
        await closed(alimiter)

    asyncio.run(main())


def test_the_slots_of_responses_ending_in_one_turn_go_back_in_one_call_or_in_place(
        alimiter: rl.AsyncLimiter, abackend: Any) -> None:
    sent: list[Any] = []
    arun = abackend.arun

    async def spy(call: Any, deadline: float | None = None) -> Any:
        sent.append(call)
        return await arun(call, deadline)

    abackend.arun = spy

    async def main() -> None:
        gate = asyncio.Event()
        waiting: list[int] = []

        @alimiter.limit(concurrency=4)
        async def slow(request: Request) -> Response:
            waiting.append(1)
            await gate.wait()
            return PlainTextResponse("ok")

        app = app_of(alimiter, [Route("/slow", slow)])
        holders = [Exchange(app, "/slow") for _ in range(4)]
        while len(waiting) < 4:  # all four admitted (a round trip each on Redis)
            await asyncio.sleep(0.001)
        sent.clear()
        gate.set()  # all four end in the same turn of the loop
        await asyncio.gather(*(holder.task for holder in holders))
        assert [holder.status for holder in holders] == [200] * 4
        if getattr(abackend, "in_process", False):
            # No round trip to share: each response gave its slot back in place, typed.
            assert sent == []
        else:
            assert [call.op for call in sent] == ["R"]
            assert len(set(sent[0].args[2].split())) == 4  # each response's own token
        # Every slot is free again: four more are admitted at once.
        gate.clear()
        again = [Exchange(app, "/slow") for _ in range(4)]
        while len(waiting) < 8 and not any(exchange.task.done() for exchange in again):
            await asyncio.sleep(0.001)
        gate.set()
        await asyncio.gather(*(exchange.task for exchange in again))
        assert [exchange.status for exchange in again] == [200] * 4
        await closed(alimiter)

    asyncio.run(main())


def test_a_test_client_without_a_with_block_gets_every_slot_back() -> None:
    # Such a client runs each request on an event loop of its own, closed right after it:
    # the give-back, sent after the response, must be done by then.
    limiter = rl.AsyncLimiter(rl.MemoryBackend())

    @limiter.limit(concurrency=1)
    async def one(request: Request) -> Response:
        return PlainTextResponse("ok")

    client = TestClient(app_of(limiter, [Route("/one", one)]))
    assert [client.get("/one").status_code for _ in range(3)] == [200, 200, 200]


def test_the_slot_comes_back_when_the_app_raises(alimiter: rl.AsyncLimiter) -> None:
    async def main() -> None:
        @alimiter.limit(concurrency=1)
        async def broken(request: Request) -> Response:
            raise RuntimeError("boom")

        app = app_of(alimiter, [Route("/broken", broken)])
        for _ in range(3):
            exchange = Exchange(app, "/broken")
            with pytest.raises(RuntimeError):
                await exchange.task
            # The exception went up before any response: the slot is free again.
        await closed(alimiter)

    asyncio.run(main())
    # Three raised, none refused: each gave its slot back.


def test_a_stream_the_client_leaves_half_way_gives_its_slot_back(
        alimiter: rl.AsyncLimiter) -> None:
    async def main() -> None:
        async def chunks() -> AsyncIterator[bytes]:
            while True:
                yield b"x" * 10
                await asyncio.sleep(0)

        @alimiter.limit("100/minute", concurrency=1)
        async def stream(request: Request) -> Response:
            return StreamingResponse(chunks())

        app = app_of(alimiter, [Route("/stream", stream)])
        reader = Exchange(app, "/stream")
        while len(reader.messages) < 5:
            await asyncio.sleep(0)
        assert (await answered(app, "/stream")).status == 429
        reader.leave()
        await reader.task
        again = Exchange(app, "/stream")
        await again.started.wait()
        assert again.status == 200
        again.leave()
        await again.task
        await closed(alimiter)

    asyncio.run(main())


def test_a_streamed_body_renews_its_lease_on_the_test_clock(alimiter: rl.AsyncLimiter,
                                                            clock: Any) -> None:
    async def main() -> None:
        app: Any = None
        seen: list[int] = []

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(6):  # 6 x 1.5 s: three times the lease, renewed on the way
                clock.advance(1.5)
                yield b"x"
            seen.append((await answered(app, "/stream")).status)

        @alimiter.limit(concurrency=rl.Policy.in_flight(1, lease=3))
        async def stream(request: Request) -> Response:
            return StreamingResponse(chunks())

        app = app_of(alimiter, [Route("/stream", stream)])
        first = await answered(app, "/stream")
        assert first.body == b"x" * 6
        assert seen == [429]  # still held, 9 s after a 3 s lease was taken
        assert (await answered(app, "/stream")).status == 200
        await closed(alimiter)

    asyncio.run(main())


def test_without_renewal_a_lease_ends_and_the_slot_is_someone_elses(
        alimiter: rl.AsyncLimiter, clock: Any) -> None:
    async def main() -> None:
        gate = asyncio.Event()

        @alimiter.limit(concurrency=rl.Policy.in_flight(1, lease=3))
        async def stuck(request: Request) -> Response:
            await gate.wait()
            return PlainTextResponse("ok")

        app = app_of(alimiter, [Route("/stuck", stuck)])
        holder = Exchange(app, "/stuck")
        await asyncio.gather(*(asyncio.sleep(0) for _ in range(20)))
        assert (await answered(app, "/stuck")).status == 429
        clock.advance(3.001)  # a holder that sends nothing, on the test clock: its lease ends
        late = Exchange(app, "/stuck")
        await asyncio.gather(*(asyncio.sleep(0) for _ in range(20)))
        assert not late.task.done()  # admitted: it waits at the gate too
        gate.set()
        await asyncio.gather(holder.task, late.task)
        await closed(alimiter)

    asyncio.run(main())


def test_a_silent_response_renews_from_the_event_loop(abackend: Any, prefix: str) -> None:
    async def main() -> None:
        limiter = rl.AsyncLimiter(abackend, prefix=prefix)  # real time: the loop's timer
        gate = asyncio.Event()

        @limiter.limit(concurrency=rl.Policy.in_flight(1, lease=0.3))
        async def quiet(request: Request) -> Response:
            await gate.wait()
            return PlainTextResponse("ok")

        app = app_of(limiter, [Route("/quiet", quiet)])
        holder = Exchange(app, "/quiet")
        loop = asyncio.get_running_loop()
        ends = loop.time() + 1.0  # more than three leases, renewed every 0.1 s
        while loop.time() < ends:
            assert (await answered(app, "/quiet")).status == 429
            await asyncio.sleep(0.05)
        gate.set()
        await holder.task
        assert (await answered(app, "/quiet")).status == 200
        await closed(limiter)

    asyncio.run(main())


def test_a_websocket_holds_its_slot_for_the_whole_connection(alimiter: rl.AsyncLimiter) -> None:
    async def echo(websocket: WebSocket) -> None:
        await websocket.accept()
        async for text in websocket.iter_text():
            await websocket.send_text(text)

    app = app_of(alimiter, [WebSocketRoute("/ws", echo)], concurrency=1)
    with TestClient(app) as client:
        with client.websocket_connect("/ws") as first:
            first.send_text("hi")
            assert first.receive_text() == "hi"
            with pytest.raises(WebSocketDisconnect) as refused, \
                    client.websocket_connect("/ws") as second:
                second.receive_text()
            assert refused.value.status_code == 429  # type: ignore[attr-defined]
        with client.websocket_connect("/ws") as again:
            again.send_text("back")
            assert again.receive_text() == "back"
        assert client.portal is not None
        client.portal.call(closed, alimiter)


def test_a_release_that_fails_never_reaches_the_app(caplog: Any) -> None:
    class NoRelease(rl.MemoryBackend):
        async def arun(self, call: Any, deadline: float | None = None) -> Any:
            if call.op == "R":
                raise BackendError("down")
            return await super().arun(call, deadline)

    async def main() -> None:
        limiter = rl.AsyncLimiter(NoRelease())

        async def ok(request: Request) -> Response:
            return PlainTextResponse("ok")

        app = app_of(limiter, [Route("/", ok)], concurrency=5)
        with caplog.at_level(logging.WARNING, logger="ratelimit_mw"):
            assert (await answered(app)).status == 200
        assert "could not give back" in caplog.text

    asyncio.run(main())


def test_hostile_keys_and_headers_never_raise_with_slots() -> None:
    async def main() -> None:
        limiter = rl.AsyncLimiter()

        async def ok(request: Request) -> Response:
            return PlainTextResponse("ok")

        def key(request: Request) -> str:
            raise ValueError("bad header")

        app = app_of(limiter, [Route("/", ok)], concurrency=1, key=key,
                     rules=[Rule("/", "5/minute", key=lambda request: 42,  # type: ignore[arg-type,return-value]
                                 concurrency=1)])
        for client in ("{x}", "", "\u00e9" * 500, "::ffff:1.2.3.4"):
            assert (await answered(app, "/", client)).status == 200

    asyncio.run(main())


def test_configuration_mistakes_say_what_to_write() -> None:
    limiter = rl.AsyncLimiter()
    with pytest.raises(rl.ConfigurationError, match="concurrency=4"):
        limiter.limit(concurrency=0)
    with pytest.raises(rl.ConfigurationError, match="limit\\(concurrency=4\\)"):
        limiter.limit()
    with pytest.raises(rl.ConfigurationError, match="goes in concurrency="):
        limiter.limit(rl.Policy.in_flight(2))
    with pytest.raises(rl.ConfigurationError, match=r"Policy\.in_flight"):
        Rule("/x", concurrency=rl.Policy("5/minute"))
    with pytest.raises(rl.ConfigurationError, match="concurrency=4"):
        RateLimitMiddleware(Starlette(), limiter, concurrency=2.5)  # type: ignore[arg-type]
    with pytest.raises(rl.ConfigurationError, match="Rule\\('/x', concurrency=4\\)"):
        Rule("/x")


def test_in_flight_counters_are_named_per_route_rule_and_default() -> None:
    limiter = rl.AsyncLimiter()

    @limiter.limit(concurrency=2)
    async def a(request: Request) -> Response:
        return PlainTextResponse("a")

    @limiter.limit("5/minute", concurrency=2)
    async def b(request: Request) -> Response:
        return PlainTextResponse("b")

    @limiter.limit(concurrency=rl.Policy.in_flight(2, lease=300), name="exports")
    async def c(request: Request) -> Response:
        return PlainTextResponse("c")

    names = [route_limits(f)[0].in_flight.name for f in (a, b, c)]  # type: ignore[index,union-attr]
    assert names[0].endswith("a 2 in flight") and names[1].endswith("b 2 in flight")
    assert names[0] != names[1] and names[2] == "exports"
    assert route_limits(c)[0].in_flight.rates[0].period_ms == 300_000  # type: ignore[index,union-attr]
    assert Rule("/x", concurrency=2).in_flight.name == "rule /x 2 in flight"  # type: ignore[union-attr]
    shared = rl.Policy.in_flight(2, name="pool")
    assert Rule("/x", concurrency=shared).in_flight is shared
    config = RateLimitMiddleware(Starlette(), limiter, concurrency=8).config
    assert config.in_flight is not None and config.in_flight.name == "default 8 in flight"


def test_a_guard_serving_two_event_loops_at_once_renews_and_gives_back_on_each() -> None:
    # Two loops (two test clients' threads) on one app: requests held and given back on one
    # loop leave the other's holders alone, so a silent response there stays renewed.
    limiter = rl.AsyncLimiter(rl.MemoryBackend())  # real time: the loops' timers
    entered, release = threading.Event(), threading.Event()

    @limiter.limit(concurrency=rl.Policy.in_flight(1, lease=0.3))
    async def quiet(request: Request) -> Response:
        entered.set()
        while not release.is_set():
            await asyncio.sleep(0.01)
        return PlainTextResponse("ok")

    @limiter.limit(concurrency=5)
    async def quick(request: Request) -> Response:
        return PlainTextResponse("ok")

    app = app_of(limiter, [Route("/quiet", quiet), Route("/quick", quick)])
    # Built on this thread first (Starlette builds its middleware on the first request).
    assert asyncio.run(answered(app, "/quick")).status == 200
    held: list[int] = []

    async def loop_a() -> None:
        holder = await answered(app, "/quiet")
        held.append(holder.status)

    seen: list[int] = []

    async def loop_b() -> None:
        entered.wait(5)
        loop = asyncio.get_running_loop()
        ends = loop.time() + 1.0  # more than three leases of the held response
        while loop.time() < ends:
            assert (await answered(app, "/quick")).status == 200
            seen.append((await answered(app, "/quiet")).status)
            await asyncio.sleep(0.05)
        release.set()

    threads = [threading.Thread(target=lambda run=run: asyncio.run(run()), daemon=True)
               for run in (loop_a, loop_b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)  # a loop that never ends fails the test instead of hanging it
    release.set()
    assert not any(thread.is_alive() for thread in threads)
    assert seen and set(seen) == {429} and held == [200]
    assert asyncio.run(answered(app, "/quiet")).status == 200  # every slot back


def test_under_trio_a_held_slot_is_renewed_on_chunks_and_given_back_in_place() -> None:
    import anyio
    import httpx

    limiter = rl.AsyncLimiter(rl.MemoryBackend())

    @limiter.limit(concurrency=1)
    async def one(request: Request) -> Response:
        return PlainTextResponse("ok")

    app = app_of(limiter, [Route("/one", one)])

    async def main() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [(await client.get("/one")).status_code for _ in range(3)]

    assert anyio.run(main, backend="trio") == [200, 200, 200]
