"""What the ASGI adapters send, with no framework imported (Starlette's and Litestar's share it).

`serve_admitted` runs an admitted request with the rate-limit headers added and gives back
what its status gives back; `Answers` sends the default 429 or 503; `deny_handshake` answers a
refused WebSocket handshake before ``accept``; `serve_connection` runs an admitted one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

from ratelimit_mw.core.plans import Check
from ratelimit_mw.http.guard import Admit, Guard, Held, Refuse, Unavailable
from ratelimit_mw.http.headers import RawHeaders, encode_raw
from ratelimit_mw.limiter import AsyncLimiter

# Every framework's own ASGI types are narrower; these take them all.
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]
App = Callable[[Any, Any, Any], Awaitable[None]]


def is_preflight(scope: Scope) -> bool:
    """Whether an OPTIONS request is a CORS preflight (it names the method it asks about)."""
    return any(name == b"access-control-request-method" for name, _ in scope.get("headers", ()))


async def serve_admitted(guard: Guard, limiter: AsyncLimiter, verdict: Admit, app: App,
                         scope: Scope, receive: Receive, send: Send) -> None:
    """Run the app for an admitted request: its headers added to the response, and the hits
    its status gives back given back once it has been sent."""
    refund = verdict.refund
    if refund is None:
        if verdict.raw is None:
            await app(scope, receive, send)
            return
    elif refund.token is not None:  # it holds in-flight slots
        await serve_holding(guard, limiter, Held(verdict, limiter._monotonic), app, scope,
                            receive, send)
        return
    watch = Watch(send, verdict.raw)
    try:
        await app(scope, receive, watch.send)
    finally:
        # Asked only where a status may give hits back: a 405, or a count_when somewhere.
        if refund is not None and (watch.status == 405 or refund.whens is not None
                                   or guard.count_when is not None):
            back = guard.given_back(verdict, watch.status)
            if back:
                await guard.refund_async(limiter, back)


async def serve_connection(guard: Guard, limiter: AsyncLimiter, verdict: Admit | None,
                           app: App, scope: Scope, receive: Receive, send: Send) -> None:
    """Run the app for an admitted (or unlimited) WebSocket: the slots it holds, if any,
    held for its whole connection."""
    held = None if verdict is None else guard.holding(verdict)
    if held is None:
        await app(scope, receive, send)
    else:
        await serve_holding(guard, limiter, held, app, scope, receive, send)


async def serve_holding(guard: Guard, limiter: AsyncLimiter, held: Held, app: App,
                        scope: Scope, receive: Receive, send: Send) -> None:
    """Run the app for a request that holds in-flight slots (an HTTP response, or a
    WebSocket's whole connection): they are given back once the last body chunk has been
    sent, else when the app returns or raises (a client that went away, an error), with
    whatever an HTTP response's status gives back, in one call; renewed while it runs."""
    watch = Holding(guard, limiter, held, send, scope["type"] == "http")
    try:
        await app(scope, receive, watch.send)
    finally:
        await watch.end()


class Answers:
    """The default 429 or 503, as JSON. The guard hands a flood the same verdict while its
    numbers hold: its headers are encoded once (the last verdict's are kept)."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: tuple[Refuse | Unavailable, RawHeaders] | None = None

    async def send(self, verdict: Refuse | Unavailable, send: Send,
                   kind: str = "http.response") -> None:
        last = self._last
        if last is not None and last[0] is verdict:
            raw = last[1]
        else:
            raw = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(verdict.body)).encode()),
                   *encode_raw([item for item in verdict.headers if item[0] != "Content-Type"])]
            self._last = (verdict, raw)
        # A copy: a server or an outer middleware may add to the list it is given.
        await send({"type": f"{kind}.start", "status": verdict.status, "headers": [*raw]})
        await send({"type": f"{kind}.body", "body": verdict.body})


async def deny_handshake(verdict: Refuse | Unavailable, scope: Scope, receive: Receive,
                         send: Send, answers: Answers) -> None:
    """A refused WebSocket handshake, answered before ``accept``: the 429 (or 503) with its
    headers through the ASGI denial response where the server offers it, else a close whose
    reason says when to retry."""
    message = await receive()
    if message.get("type") != "websocket.connect":
        return  # the client has gone already
    if "websocket.http.response" in (scope.get("extensions") or {}):
        await answers.send(verdict, send, "websocket.http.response")
        return
    retry = next((value for name, value in verdict.headers if name == "Retry-After"), "1")
    refused = isinstance(verdict, Refuse)
    # 1008: policy violation; 1013: try again later (the store is out, "deny").
    await send({"type": "websocket.close", "code": 1008 if refused else 1013,
                "reason": f"{'rate limited' if refused else 'unavailable'}; "
                          f"retry after {retry} s"})


class Watch:
    """The ``send`` of a response the limiter adds headers to (`fill`: only those it lacks):
    remembers the status, for a response that may give its hit back."""

    __slots__ = ("extra", "fill", "send_on", "status")

    def __init__(self, send: Send, extra: RawHeaders | None, fill: bool = False) -> None:
        self.send_on = send
        self.extra = extra
        self.fill = fill
        self.status = 500  # an exception before the response starts will be a server error

    async def send(self, message: Any) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            extra = self.extra
            if extra is not None:
                headers = message.get("headers", ())
                if self.fill:
                    present = {name.lower() for name, _ in headers}
                    extra = [item for item in extra if item[0] not in present]
                # A new message and list: a Response's own header list must not grow.
                message = {**message, "headers": [*headers, *extra]}
        await self.send_on(message)


class Holding(Watch):
    """The ``send`` of a response that holds in-flight slots: right after its last body
    chunk it hands them (with what its status gives back) to the guard's `Releases`, and
    `end` waits for that call once the app has returned; it renews their lease on a chunk
    sent a third of a lease after the last renewal, and, for a response (or a WebSocket)
    that sends nothing for that long, from a timer on the event loop (a timer, not a task:
    most responses end long before it fires)."""

    __slots__ = ("guard", "held", "http", "limiter", "renewal", "sent", "timer")

    def __init__(self, guard: Guard, limiter: AsyncLimiter, held: Held, send: Send,
                 http: bool = True) -> None:
        super().__init__(send, held.admit.raw if http else None)
        self.http = http  # a WebSocket gives back its slots only (as it never gives back hits)
        self.guard = guard
        self.limiter = limiter
        self.held = held
        self.renewal: asyncio.Task[None] | None = None
        self.sent: asyncio.Task[None] | None = None
        self.timer = asyncio.get_running_loop().call_later(held.every, self._tick)

    async def send(self, message: Any) -> None:
        await super().send(message)
        if message["type"] == "http.response.body":
            if not message.get("more_body", False):
                self.finish()
            elif self.held.due():
                await self.guard.renew_async(self.limiter, self.held)

    def _tick(self) -> None:
        held = self.held
        if held.done:
            return
        if held.due() and (self.renewal is None or self.renewal.done()):
            # Kept here: the loop holds only a weak reference to a task.
            self.renewal = asyncio.get_running_loop().create_task(
                self.guard.renew_async(self.limiter, held))
        self.timer = asyncio.get_running_loop().call_later(held.every, self._tick)

    def finish(self) -> None:
        """Hand the slots (once) to this turn's give-back call, with what the response's
        status gives back; not awaited here, so the response is never held up by it."""
        held = self.held
        if held.done:
            return
        held.done = True
        self.timer.cancel()
        guard = self.guard
        checks = guard.released(held.admit, self.status) if self.http else held.checks
        releases = guard.releases
        if releases is None:
            releases = guard.releases = Releases(guard)
        self.sent = releases.add(self.limiter, checks, held.token)

    async def end(self) -> None:
        """Once the app has returned (or raised): its slots given back, if its last chunk
        did not already hand them over, and the give-back call waited for."""
        self.finish()
        sent = self.sent
        if sent is not None and not sent.done():
            # Shielded: a request cancelled while it waits must not cancel the call that
            # gives back the other responses' slots too.
            await asyncio.shield(sent)


class Releases:
    """The give-backs of the responses that end in one turn of the event loop, sent in one
    call after the turn (per limiter; on a cluster, per identity's slot). Each of those
    requests waits for it once its app has returned, after its response has gone out, so
    that none is lost when a loop closes after its last request (a test client's)."""

    __slots__ = ("guard", "hits", "task")

    def __init__(self, guard: Guard) -> None:
        self.guard = guard
        self.hits: list[tuple[AsyncLimiter, Sequence[Check], str | None]] = []
        self.task: asyncio.Task[None] | None = None

    def add(self, limiter: AsyncLimiter, checks: Sequence[Check], token: str | None
            ) -> asyncio.Task[None]:
        """Give back `checks` (by the hit's `token`) in the call of this turn."""
        if not self.hits:
            # It starts on the loop's next turn, with every give-back of this one.
            self.task = asyncio.get_running_loop().create_task(self._send())
        self.hits.append((limiter, checks, token))
        return self.task  # type: ignore[return-value]

    async def _send(self) -> None:
        hits, self.hits = self.hits, []
        limiter = hits[0][0]
        if all(each is limiter for each, _, _ in hits):
            await self.guard.refund_all_async(limiter, [(checks, token)
                                                        for _, checks, token in hits])
            return
        for each, checks, token in hits:  # limiters swapped under a live app (a test's)
            await self.guard.refund_async(each, checks, token)
