"""What the ASGI adapters send, with no framework imported (Starlette's and Litestar's share it).

`serve_admitted` runs an admitted request with the rate-limit headers added and gives back
what its status gives back; `DefaultResponses` sends the default 429 or 503;
`deny_handshake` answers a refused WebSocket handshake before ``accept``;
`serve_connection` runs an admitted one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ratelimit_mw._async import slots as slots_async
from ratelimit_mw.core.codec import GiveBack
from ratelimit_mw.http.guard import Guard
from ratelimit_mw.http.headers import Headers, RawHeaders, encode_raw
from ratelimit_mw.http.slots import LeaseLost, given_back_here
from ratelimit_mw.http.verdict import Admit, Held, Refuse, Unavailable
from ratelimit_mw.limiter import AsyncLimiter

# Every framework's own ASGI types are narrower; these take them all.
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]
App = Callable[[Any, Any, Any], Awaitable[None]]
# The messages of a response (or a WebSocket) after its start: a lost slot ends it there.
_LATER = frozenset({"http.response.body", "websocket.send"})


def is_preflight(scope: Scope) -> bool:
    """Whether an OPTIONS request is a CORS preflight (it names the method it asks about)."""
    return any(name == b"access-control-request-method" for name, _ in scope.get("headers", ()))


async def serve_admitted(guard: Guard, limiter: AsyncLimiter, verdict: Admit, app: App,
                         scope: Scope, receive: Receive, send: Send) -> None:
    """Run the app for an admitted request: its headers added to the response, and the hits
    its status gives back given back once it has been sent. The send is wrapped only where
    there are headers to add or a status to read."""
    plan, raw = verdict.plan, verdict.raw
    if plan is None:
        if raw is None:
            await app(scope, receive, send)
            return
    elif plan.token is not None:  # it holds in-flight slots
        await serve_holding(guard, limiter, verdict, app, scope, receive, send)
        return
    status = 500  # an exception before the response starts will be a server error

    # No coroutine of its own: the app awaits what `send` returns. What it reads and does
    # not change is bound as defaults: a closure's cell each would cost more.
    def watched(message: Any, raw: RawHeaders | None = raw, send: Send = send
                ) -> Awaitable[None]:
        if message["type"] == "http.response.start":
            nonlocal status
            status = message["status"]
            if raw is not None:
                # A new message and list: a Response's own header list must not grow.
                message = {**message, "headers": [*message.get("headers", ()), *raw]}
        return send(message)

    try:
        await app(scope, receive, watched)
    finally:
        # Asked only where a status may give hits back: a 405, or a count_when somewhere.
        if plan is not None and (status == 405 or plan.whens is not None
                                 or guard.count_when is not None):
            back = guard.given_back(verdict, status)
            if back:
                await slots_async.refund_async(guard, limiter, verdict, back)


async def serve_connection(guard: Guard, limiter: AsyncLimiter, verdict: Admit | None,
                           app: App, scope: Scope, receive: Receive, send: Send) -> None:
    """Run the app for an admitted (or unlimited) WebSocket: the slots it holds, if any,
    held for its whole connection."""
    if verdict is None or verdict.plan is None or verdict.plan.token is None:
        await app(scope, receive, send)
    else:
        await serve_holding(guard, limiter, verdict, app, scope, receive, send)


async def serve_holding(guard: Guard, limiter: AsyncLimiter, admit: Admit, app: App,
                        scope: Scope, receive: Receive, send: Send) -> None:
    """Run the app for a request that holds in-flight slots (an HTTP response, or a
    WebSocket's whole connection): they are given back once the last body chunk has been
    sent, else when the app returns or raises (a client that went away, an error), with
    whatever an HTTP response's status gives back, in one call; renewed while it runs."""
    holding = Holding(guard, limiter, admit, send, scope["type"] == "http")
    try:
        await app(scope, receive, holding.send)
    finally:
        if not holding.done:  # most responses gave them back with their last chunk
            later = holding.end()
            if later is not None:
                await later


class DefaultResponses:
    """The default 429 or 503, as JSON. The guard hands a flood the same headers and body
    while its numbers hold: they are encoded once (the last verdict's are kept)."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: tuple[Headers, bytes, RawHeaders] | None = None

    async def send(self, verdict: Refuse | Unavailable, send: Send,
                   kind: str = "http.response") -> None:
        last = self._last
        if last is not None and last[0] is verdict.headers and last[1] is verdict.body:
            raw = last[2]
        else:
            raw = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(verdict.body)).encode()),
                   *encode_raw([item for item in verdict.headers if item[0] != "Content-Type"])]
            self._last = (verdict.headers, verdict.body, raw)
        # A copy: a server or an outer middleware may add to the list it is given.
        await send({"type": f"{kind}.start", "status": verdict.status, "headers": [*raw]})
        await send({"type": f"{kind}.body", "body": verdict.body})


async def deny_handshake(verdict: Refuse | Unavailable, scope: Scope, receive: Receive,
                         send: Send, answers: DefaultResponses) -> None:
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

    def send(self, message: Any) -> Awaitable[None]:  # no coroutine: the app awaits this
        return self.send_on(self.started(message) if message["type"] == "http.response.start"
                            else message)

    def started(self, message: Any) -> Any:
        """The response's start message: its status kept, the limiter's headers added."""
        self.status = message["status"]
        extra = self.extra
        if extra is None:
            return message
        headers = message.get("headers", ())
        if self.fill:
            present = {name.lower() for name, _ in headers}
            extra = [item for item in extra if item[0] not in present]
        # A new message and list: a Response's own header list must not grow.
        return {**message, "headers": [*headers, *extra]}


class Holding(Held):
    """The ``send`` of a response that holds in-flight slots, and its `Held`: right after
    its last body chunk has gone out (else when the app returns or raises) it gives them
    back, with what its status gives back, together with every other response of the guard
    that ends in the same turn of the event loop (`Holders`); it renews their lease on a
    chunk sent a third of a lease after the last renewal (a response, or a WebSocket, that
    sends nothing for that long is renewed by the holders' timer). Outside asyncio (trio)
    there are no holders: renewed on chunks only, given back in place."""

    __slots__ = ("extra", "guard", "holders", "http", "limiter", "renewal", "send_on",
                 "status")

    def __init__(self, guard: Guard, limiter: AsyncLimiter, admit: Admit, send: Send,
                 http: bool = True) -> None:
        plan = admit.plan
        if plan is None or plan.token is None:
            raise ValueError("Holding is for an admitted request that holds in-flight slots")
        # Held's fields, set here: one object and one call fewer per request.
        self.admit = admit
        self.plan = plan
        self.every = every = plan.compiled.renew_every
        self.clock = clock = limiter.monotonic
        self.next = clock() + every
        self.done = self.lost = False
        self.send_on = send
        self.extra = admit.raw if http else None
        self.status = 500  # an exception before the response starts will be a server error
        self.http = http  # a WebSocket gives back its slots only (as it never gives back hits)
        self.guard = guard
        self.limiter = limiter
        self.renewal: asyncio.Task[None] | None = None
        self.holders = Holders.on_this_loop(guard)
        if self.holders is not None:
            self.holders.hold(self)

    def send(self, message: Any) -> Awaitable[None]:
        # A coroutine of its own only where something is awaited beside the send: the app
        # awaits what this returns.
        kind = message["type"]
        if self.lost and kind in _LATER and self.guard.config.on_lease_lost == "end":
            # found by the timer's renewal
            raise LeaseLost("the response's in-flight slot went to another request while its "
                            "lease had ended (on_lease_lost=\"end\")")
        if kind == "http.response.start":
            self.status = message["status"]
            extra = self.extra
            if extra is not None:  # as `serve_admitted`'s `watched` adds them
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            return self.send_on(message)
        if kind != "http.response.body":
            return self.send_on(message)
        if not message.get("more_body", False):
            return self._last(message)
        if self.due():  # renewed first: a chunk goes out only with its slot
            return self._renewed(message)
        return self.send_on(message)

    async def _last(self, message: Any) -> None:
        await self.send_on(message)
        later = self.end()
        if later is not None:
            await later

    async def _renewed(self, message: Any) -> None:
        await slots_async.renew_async(self.guard, self.limiter, self)
        await self.send_on(message)

    def renew(self) -> None:
        """From the holders' timer: renew the lease if it is due (and no renewal runs)."""
        if self.due() and (self.renewal is None or self.renewal.done()):
            # Kept here: the loop holds only a weak reference to a task.
            self.renewal = asyncio.get_running_loop().create_task(self._renew())

    async def _renew(self) -> None:
        if self.done:  # ended since the timer asked: renewing would take its slots again
            return
        # A lost slot with on_lease_lost="end" ends the response at its next message (`send`).
        with contextlib.suppress(LeaseLost):
            await slots_async.renew_async(self.guard, self.limiter, self)

    def end(self) -> Awaitable[None] | None:
        """Give the slots back (once), with what the response's status gives back: in place
        where the store is in this process; else what to await, where the first response of
        this turn sends every give-back of the turn in one call, after letting the turn's
        others join it (the others wait for nothing). None: nothing to await."""
        if self.done:
            return None
        self.done = True
        guard, status = self.guard, self.status
        # Most responses give back no hit: their slots alone (a WebSocket's, always). The
        # status is asked only where it may give some back (as `serve_admitted`).
        if (self.http and (status == 405 or guard.count_when is not None
                           or self.plan.whens is not None)
                and guard.given_back(self.admit, status)):
            back: GiveBack | None = guard.give_back_of(self.admit,
                                                       guard.released(self.admit, status))
        else:
            back = None  # its slots alone
        holders = self.holders
        if holders is not None and not self.limiter.local_store:
            if holders.give_back(self, self.back if back is None else back):
                return self._sent_with_the_turn(holders)
            return None
        # A store in this process has no round trip for the turn to share: in place.
        if holders is not None:
            holders.live.discard(self)
        if given_back_here(guard, self.limiter, self if back is None else (back,)):
            return None
        return slots_async.give_back_by_call_async(guard, self.limiter,
                                                   (self.back if back is None else back,))

    @staticmethod
    async def _sent_with_the_turn(holders: Holders) -> None:
        try:
            await asyncio.sleep(0)  # a turn of the loop: the others of this one join
        finally:  # cancelled or not, the turn's slots go back
            await holders.send()


class Holders:
    """The requests of one guard that hold in-flight slots on one event loop: one timer
    renews the leases of those that send nothing for a third of a lease, and the slots of
    the responses that end in one turn of the loop go back in one call (per limiter; on a
    cluster, per identity's slot), sent by the first of them a turn later. No task: the
    call is part of a request, so it is done before the loop can close (a test client's)."""

    __slots__ = ("every", "guard", "hits", "live", "loop", "timer")

    def __init__(self, guard: Guard, loop: asyncio.AbstractEventLoop) -> None:
        self.guard = guard
        self.loop = loop
        self.live: set[Holding] = set()
        self.timer: asyncio.TimerHandle | None = None
        self.every = 0.0  # the timer's period: the shortest renewal period among the live
        self.hits: list[tuple[AsyncLimiter, GiveBack]] = []

    @staticmethod
    def on_this_loop(guard: Guard) -> Holders | None:
        """The guard's holders on the running asyncio loop (None under another library: trio).
        One per loop: a guard may serve several at once (test clients, threads); those of
        closed loops are dropped when a new loop comes."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return None
        by_loop: dict[asyncio.AbstractEventLoop, Holders] = guard.holders
        found = by_loop.get(loop)
        if found is None:
            for closed in [each for each in list(by_loop) if each.is_closed()]:
                by_loop.pop(closed, None)
            found = by_loop[loop] = Holders(guard, loop)
        return found

    def hold(self, holding: Holding) -> None:
        self.live.add(holding)
        every = holding.every
        if self.timer is None or every < self.every:
            if self.timer is not None:
                self.timer.cancel()
            self.every = every
            self.timer = self.loop.call_later(every, self._tick)

    def _tick(self) -> None:
        """Renew what is due; a holder is renewed at most two thirds of its lease after the
        last renewal (due at a third, seen by the next tick)."""
        self.timer = None
        if not self.live:
            return
        for holding in list(self.live):
            holding.renew()
        self.every = min(holding.every for holding in self.live)
        self.timer = self.loop.call_later(self.every, self._tick)

    def give_back(self, holding: Holding, hit: GiveBack) -> bool:
        """Add what `holding` gives back to this turn's call; True for the first of the
        turn, which then sends them all (`send`)."""
        self.live.discard(holding)
        self.hits.append((holding.limiter, hit))
        return len(self.hits) == 1

    async def send(self) -> None:
        """Send what this turn gives back: one call per limiter (on a cluster, per slot)."""
        hits, self.hits = self.hits, []
        # Nearly always one limiter; a test's fixture may swap it under a live app.
        by_limiter: dict[int, tuple[AsyncLimiter, list[GiveBack]]] = {}
        for limiter, hit in hits:
            by_limiter.setdefault(id(limiter), (limiter, []))[1].append(hit)
        for limiter, given in by_limiter.values():
            await slots_async.give_back_async(self.guard, limiter, given)
