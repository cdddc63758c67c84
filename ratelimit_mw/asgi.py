"""Rate limiting for ASGI apps (Starlette, FastAPI, any ASGI app): ``RateLimitMiddleware``.

    from ratelimit_mw import AsyncLimiter, AsyncRedisBackend, keys
    from ratelimit_mw.asgi import Config, RateLimitMiddleware, Rule

    limiter = AsyncLimiter(AsyncRedisBackend.from_url("redis://localhost:6379/0"))
    RATE_LIMITS = Config(default="100/minute",          # built, and checked, at import time
                         rules=[Rule("/login", "5/minute", methods=["POST"])])
    app.add_middleware(RateLimitMiddleware, limiter=limiter, config=RATE_LIMITS)

Pure ASGI (no ``BaseHTTPMiddleware``): lifespan scopes pass through untouched, and the
rate-limit headers are added by wrapping ``send``. A WebSocket handshake is one hit, selected
as a GET to its path (the default, rules, a decorated WebSocket endpoint, ``exempt``); a
refused one is answered before ``accept``: a 429 with ``Retry-After`` through the ASGI
WebSocket denial response where the server offers it, else a close with code 1008 whose
reason says when to retry (``websockets=False`` leaves WebSockets alone). What to do with a
request is decided by the shared guard (`ratelimit_mw.http.guard`); this module reads the
scope, awaits the one backend call (bounded by ``backend_timeout``) and sends the verdict.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only (strings at run time)
    from typing_extensions import Unpack

from ratelimit_mw.http.asgi_routes import RouteResolver, needs_route, routes_of
from ratelimit_mw.http.config import Config, ConfigOptions, build_config
from ratelimit_mw.http.extras import require
from ratelimit_mw.http.guard import Admit, Guard, Refuse, Unavailable
from ratelimit_mw.http.headers import RawHeaders, encode_raw
from ratelimit_mw.http.rules import Rule
from ratelimit_mw.limiter import AsyncLimiter, require_async_limiter

require("starlette", "starlette", "ratelimit_mw.asgi")
from starlette.requests import Request  # noqa: E402

# Starlette's own ASGI types: `app.add_middleware(RateLimitMiddleware, ...)` then type-checks
# under mypy --strict against its middleware factory protocol.
from starlette.types import ASGIApp, Message, Receive, Scope, Send  # noqa: E402
from starlette.websockets import WebSocket  # noqa: E402

try:  # where FastAPI is installed, its schema documents the 429s whenever it is built
    from ratelimit_mw.http.openapi import document_fastapi
except ImportError:
    def document_fastapi(app: object, guard: Guard) -> None:
        return None

__all__ = ["Config", "RateLimitMiddleware", "Rule"]


def is_preflight(scope: Scope) -> bool:
    """Whether an OPTIONS request is a CORS preflight (it names the method it asks about)."""
    return any(name == b"access-control-request-method" for name, _ in scope.get("headers", ()))


def route_path(scope: Scope) -> str:
    """The path the app's router matches: ``path`` without the ``root_path`` prefix, as
    Starlette's private ``get_route_path`` (copied: the hot path calls no framework
    internals)."""
    path: str = scope["path"]
    root_path = scope.get("root_path", "")
    if root_path and path.startswith(root_path):
        rest = path[len(root_path):]
        if not rest or rest[0] == "/":
            return rest
    return path


class RateLimitMiddleware:
    """Rate-limit every HTTP request of an ASGI app.

    ``RateLimitMiddleware(app, limiter, config=Config(...))`` or the same options as keywords
    (see `ratelimit_mw.http.config.Config` for every option); ``limiter`` is an
    ``AsyncLimiter``. ``on_blocked`` returns an ASGI app (a Starlette ``Response``, or an
    awaitable of one), sent as it is with the rate-limit headers it lacks.

    The decision is left in ``scope["state"]["ratelimit"]`` (``request.state.ratelimit``):
    a ``Decision``, or ``None`` when no policy applied or the backend failed and the request
    was admitted.
    """

    def __init__(self, app: ASGIApp, limiter: AsyncLimiter, *, config: Config | None = None,
                 **options: Unpack[ConfigOptions]) -> None:
        self.app = app
        self.guard = self.guard_of(app, limiter, config=config, **options)
        self.limiter: AsyncLimiter = self.guard.limiter
        self.config = self.guard.config
        # Route resolution: keyed on the app this middleware wraps when its route tree can be
        # reached from here (through .app of the middleware below it); otherwise on
        # scope["app"], which Starlette sets before running its middleware stack.
        self._root: object = app if routes_of(app) is not None else None
        self._resolver = RouteResolver(always=any(map(needs_route, self.guard.keys_in_use)))
        # The last default answer's encoded headers, with the verdict they encode (_answer).
        self._last_raw: tuple[Refuse | Unavailable, RawHeaders] | None = None
        # The app the requests come through (scope["app"]; or the app wrapped here): a FastAPI
        # app's OpenAPI schema documents the 429 of its limited operations.
        self._seen_app: object = None
        inner: object = app
        for _ in range(8):
            document_fastapi(inner, self.guard)
            inner = getattr(inner, "app", None)

    @classmethod
    def guard_of(cls, app: ASGIApp, limiter: AsyncLimiter, *, config: Config | None = None,
                 **options: Unpack[ConfigOptions]) -> Guard:
        """The guard ``RateLimitMiddleware(app, limiter, ...)`` decides with (the OpenAPI
        documentation asks it before Starlette has built the middleware)."""
        limiter = require_async_limiter(limiter, "the ASGI middleware")
        config = build_config(config, options)
        return Guard(config, limiter, timeout=config.backend_timeout, raw=True)

    def __repr__(self) -> str:
        return f"RateLimitMiddleware({self.app!r}, {self.limiter!r})"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "websocket" and self.config.websockets:
                await self._handshake(scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        guard = self.guard
        method: str = scope["method"]
        path = route_path(scope)
        state, meta = self._routed(scope, method, path)
        selection = guard.select(method, path, meta)
        if selection is not None:
            # One Request for every key function, hook and handler of this request.
            request = Request(scope)
            verdict = await guard.decide_async(self.limiter, selection, request, method,
                                               method == "OPTIONS" and is_preflight(scope))
            if isinstance(verdict, Admit):
                state["ratelimit"] = verdict.decision
                if verdict.refund is None and verdict.raw is None:
                    await self.app(scope, receive, send)
                    return
                watch = _Watch(send, verdict.raw)
                try:
                    await self.app(scope, receive, watch.send)
                finally:
                    back = guard.given_back(verdict, watch.status)
                    if back:
                        await guard.refund_async(self.limiter, back)
                return
            if isinstance(verdict, Refuse):
                state["ratelimit"] = verdict.decision
                await self._refuse(request, verdict, scope, receive, send)
                return
            if verdict is not None:
                await self._answer(verdict, send)
                return
        await self.app(scope, receive, send)

    def _routed(self, scope: Scope, method: str, path: str) -> tuple[dict[str, Any], Any]:
        """What the request's endpoint carries (its template left in the scope), and the
        scope's state, where the decision is left (None until one is made)."""
        app = scope.get("app")
        if app is not self._seen_app:
            self._seen_app = app
            document_fastapi(app, self.guard)
        meta = self._resolver.resolve(scope, self._root if self._root is not None else app,
                                      method, path)
        state = scope.get("state")
        if state is None:
            state = scope["state"] = {}
        state["ratelimit"] = None
        return state, meta

    async def _handshake(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A WebSocket handshake: one hit, as a GET to its path; refused before accept."""
        path = route_path(scope)
        # Resolved apart from HTTP requests to the same path: another route may take them.
        state, meta = self._routed(scope, "WEBSOCKET", path)
        selection = self.guard.select("GET", path, meta)
        verdict = None if selection is None else await self.guard.decide_async(
            self.limiter, selection, _Handshake(scope, receive, send), "GET", False)
        if verdict is None or isinstance(verdict, Admit):
            state["ratelimit"] = None if verdict is None else verdict.decision
            await self.app(scope, receive, send)
            return
        refused = isinstance(verdict, Refuse)
        if isinstance(verdict, Refuse):
            state["ratelimit"] = verdict.decision
        message = await receive()
        if message.get("type") != "websocket.connect":
            return  # the client has gone already
        if "websocket.http.response" in (scope.get("extensions") or {}):
            await self._answer(verdict, send, "websocket.http.response")
            return
        retry = next((value for name, value in verdict.headers if name == "Retry-After"), "1")
        # 1008: policy violation; 1013: try again later (the store is out, "deny").
        await send({"type": "websocket.close", "code": 1008 if refused else 1013,
                    "reason": f"{'rate limited' if refused else 'unavailable'}; "
                              f"retry after {retry} s"})

    async def _refuse(self, request: Request, refusal: Refuse, scope: Scope, receive: Receive,
                      send: Send) -> None:
        on_blocked = self.config.on_blocked
        if on_blocked is not None:
            try:
                response: Any = on_blocked(request, refusal.decision)
                if inspect.isawaitable(response):
                    response = await response
                if not callable(response):
                    raise TypeError(f"on_blocked returned {response!r}, not an ASGI app")
            except Exception as exc:
                self.guard.log_failure("ratelimit_mw on_blocked failed; answering the default "
                                       "429", exc)
            else:
                # A 429 always carries Retry-After and the RateLimit fields: the user's response
                # gets those it does not set itself.
                watch = _Watch(send, encode_raw(refusal.headers), fill=True)
                await response(scope, receive, watch.send)
                return
        await self._answer(refusal, send)

    async def _answer(self, verdict: Refuse | Unavailable, send: Send,
                      kind: str = "http.response") -> None:
        """The default 429 or 503, as JSON."""
        last = self._last_raw
        if last is not None and last[0] is verdict:
            raw = last[1]
        else:  # the guard hands a flood the same verdict while its numbers hold: encode once
            raw = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(verdict.body)).encode()),
                   *encode_raw([item for item in verdict.headers if item[0] != "Content-Type"])]
            self._last_raw = (verdict, raw)
        # A copy: a server or an outer middleware may add to the list it is given.
        await send({"type": f"{kind}.start", "status": verdict.status, "headers": [*raw]})
        await send({"type": f"{kind}.body", "body": verdict.body})


class _Handshake(WebSocket):
    """The handshake as key functions and hooks see it: a Starlette ``WebSocket`` that is a
    GET to its path, as it is on the wire (``request.method`` reads "GET")."""

    method = "GET"


class _Watch:
    """The ``send`` of a response the limiter adds headers to (`fill`: only those it lacks):
    remembers the status, for a response that may give its hit back."""

    __slots__ = ("extra", "fill", "send_on", "status")

    def __init__(self, send: Send, extra: RawHeaders | None, fill: bool = False) -> None:
        self.send_on = send
        self.extra = extra
        self.fill = fill
        self.status = 500  # an exception before the response starts will be a server error

    async def send(self, message: Message) -> None:
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
