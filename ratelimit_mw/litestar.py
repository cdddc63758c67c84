"""Rate limiting for Litestar: ``RateLimitPlugin``, or ``RateLimitMiddleware`` through
``DefineMiddleware``.

    from litestar import Litestar, get
    from ratelimit_mw import AsyncLimiter, AsyncRedisBackend
    from ratelimit_mw.litestar import RateLimitPlugin

    limiter = AsyncLimiter(AsyncRedisBackend.from_url("redis://localhost:6379/0"))

    @get("/login")
    @limiter.limit("5/minute")                 # or @get("/login", opt={"ratelimit": "5/minute"})
    async def login() -> str: ...

    app = Litestar([login], plugins=[RateLimitPlugin(limiter, default="100/minute")])

The plugin adds the middleware (innermost, so an authentication middleware has set
``scope["user"]`` first) and answers `RateLimitHTTPException` with the ASGI middleware's JSON
body, unless the app has a handler of its own for it or for ``HTTPException``.
``middleware=[DefineMiddleware(RateLimitMiddleware, limiter=limiter, default=...)]`` is the
same middleware without the handler. The options are the ASGI middleware's
(`ratelimit_mw.http.config.Config`), less two that only a middleware around the whole app
could act on (``on_blocked``, ``charge_method_not_allowed``: ConfigurationError).

Litestar builds the middleware for each route handler, after its router has matched: the
route template and the handler (its ``@limiter.limit``/``@limiter.exempt``, under or above
``@get``, and ``opt["ratelimit"]``/``opt["ratelimit_exempt"]`` from any layer) come from the
scope, and 404s and 405s, which the router answers, are never counted. What to do with a
request is decided by the shared guard (`ratelimit_mw.http.guard`), as for every adapter; a
refusal raises `RateLimitHTTPException` (429, or 503 with ``on_backend_error="deny"``) into
Litestar's exception handling, and WebSocket handshakes are refused as the ASGI middleware
refuses them.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:  # annotations only (strings at run time)
    from typing_extensions import Unpack

from ratelimit_mw._async.handler import handler_async
from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.http.asgi_routes import RouteMeta, endpoint_meta
from ratelimit_mw.http.asgi_send import (
    DefaultResponses,
    deny_handshake,
    is_preflight,
    serve_admitted,
    serve_connection,
)
from ratelimit_mw.http.config import Config, ConfigOptions, build_config
from ratelimit_mw.http.extras import require
from ratelimit_mw.http.guard import Guard
from ratelimit_mw.http.headers import TOO_MANY_REQUESTS
from ratelimit_mw.http.rules import Rule
from ratelimit_mw.http.verdict import Admit, Refuse, Unavailable
from ratelimit_mw.keys import ASGI, ROUTE_SCOPE_KEY
from ratelimit_mw.limiter import AsyncLimiter, require_async_limiter
from ratelimit_mw.routing import EXEMPT, RouteLimit, route_limits

require("litestar", "litestar", "ratelimit_mw.litestar")
from litestar.config.app import AppConfig  # noqa: E402
from litestar.connection import Request, WebSocket  # noqa: E402
from litestar.enums import MediaType  # noqa: E402
from litestar.exceptions import HTTPException  # noqa: E402
from litestar.middleware import DefineMiddleware  # noqa: E402
from litestar.openapi.spec import (  # noqa: E402
    OpenAPIHeader,
    OpenAPIMediaType,
    OpenAPIResponse,
    OpenAPIType,
    Operation,
    Schema,
)
from litestar.plugins import InitPluginProtocol  # noqa: E402
from litestar.response import Response  # noqa: E402
from litestar.routes import BaseRoute, HTTPRoute  # noqa: E402
from litestar.types import ASGIApp, Receive, Scope, Send  # noqa: E402

__all__ = ["OPT_EXEMPT", "OPT_LIMIT", "Config", "RateLimitHTTPException", "RateLimitMiddleware",
           "RateLimitPlugin", "Rule", "rate_limit_exception_handler"]

#: ``opt`` keys of a handler (or of its controller, router or app): the rate (a rate string, a
#: Policy, a callable (request) -> rate text, or a list of them), and an exemption.
OPT_LIMIT = "ratelimit"
OPT_EXEMPT = "ratelimit_exempt"

# Options only a middleware around the whole app could act on, and what to write instead.
_REFUSED = {
    "on_blocked": "on_blocked: under Litestar a refusal raises RateLimitHTTPException into "
                  "the app's exception handling; shape the 429 with a handler, "
                  "exception_handlers={429: your_handler} (the exception carries .decision, "
                  ".headers and .body)",
    "charge_method_not_allowed": "charge_method_not_allowed: Litestar's router answers 405 "
                                 "before any route's middleware runs, so none is ever seen; "
                                 "drop the option",
}


class RateLimitHTTPException(HTTPException):
    """A 429 (refused) or 503 (backend down, ``on_backend_error="deny"``) from the middleware.

    ``headers`` are the ones every 429 carries (``Retry-After``, ``RateLimit``,
    ``RateLimit-Policy``, ``Cache-Control``): Litestar's own handler sends them, with its
    ``{"status_code", "detail", "extra": {"retry_after"}}`` body; `rate_limit_exception_handler`
    sends ``body``, the ASGI middleware's JSON. ``decision``: the refusing Decision (None for a
    503).
    """

    def __init__(self, verdict: Refuse | Unavailable) -> None:
        body = json.loads(verdict.body)
        super().__init__(detail=body["detail"], status_code=verdict.status,
                         headers={name: value for name, value in verdict.headers
                                  if name != "Content-Type"},
                         extra={"retry_after": body["retry_after"]})
        self.body = verdict.body
        self.decision = verdict.decision if isinstance(verdict, Refuse) else None


def rate_limit_exception_handler(request: Request[Any, Any, Any],
                                 exc: Exception) -> Response[bytes]:
    """Answer a `RateLimitHTTPException` exactly as the ASGI middleware would."""
    if not isinstance(exc, RateLimitHTTPException):
        raise exc
    return Response(exc.body, status_code=exc.status_code, headers=exc.headers,
                    media_type=MediaType.JSON)


# limiter -> (id of each argument, option names) -> (the arguments, their guard)
_GUARDS: weakref.WeakKeyDictionary[
    AsyncLimiter, dict[tuple[object, ...], tuple[tuple[object, ...], Guard]]
] = weakref.WeakKeyDictionary()


def _guard_of(limiter: object, config: Config | None, options: dict[str, Any]) -> Guard:
    """The guard of the middlewares built from one ``DefineMiddleware``: Litestar builds one
    per route handler with the very same arguments, and they share one guard (one breaker,
    one in-memory fallback, one set of caches for the app). The arguments are kept with it,
    so that no id in the key is reused while it lives."""
    checked = require_async_limiter(limiter, "the Litestar middleware")
    given = (config, *options.values())
    key = (*map(id, given), *options)
    known = _GUARDS.setdefault(checked, {})
    found = known.get(key)
    if found is None:
        built = build_config(config, options)
        for option, message in _REFUSED.items():
            if getattr(built, option) not in (None, False):
                raise ConfigurationError(f"the Litestar middleware takes no {message}")
        found = known[key] = (given, Guard(built, checked, timeout=built.backend_timeout,
                                           raw=True, requests=ASGI))
    return found[1]


def _limits_of(handler: Any, limiter: AsyncLimiter) -> RouteMeta:
    """What a route handler carries: the decorators on its function (``@limiter.limit``
    under ``@get``) or on the handler itself (above it), and its ``opt``."""
    fn = getattr(handler, "fn", None)
    found = route_limits(handler) or (None if fn is None else endpoint_meta(fn, "GET"))
    opt = getattr(handler, "opt", None) or {}
    exempt, rates = opt.get(OPT_EXEMPT, False), opt.get(OPT_LIMIT)
    where = f"the route handler {getattr(fn, '__qualname__', handler)!r}"
    if not isinstance(exempt, bool):
        raise ConfigurationError(f"opt[{OPT_EXEMPT!r}] of {where} must be True or False, got "
                                 f"{exempt!r}")
    if exempt or found == EXEMPT:
        if rates is not None or isinstance(found, tuple):
            raise ConfigurationError(f"{where} is both exempt and limited; keep one")
        return EXEMPT
    if rates is None:
        return found
    limits: list[RouteLimit] = list(found) if isinstance(found, tuple) else []
    for rate in rates if isinstance(rates, (list, tuple)) else [rates]:
        try:
            limit = RouteLimit.make(rate, key=None, cost=1, name=None).bound_to(fn or handler)
        except ConfigurationError as exc:
            raise ConfigurationError(f"opt[{OPT_LIMIT!r}] of {where}: {exc}") from None
        if limit.policy is not None:  # as the decorator does: names must agree on algorithms
            limiter.shared_logs.add((limit.policy,))
        limits.append(limit)
    return tuple(limits)


def _route_of(app: object) -> BaseRoute | None:
    """The route whose handlers a middleware wraps: the innermost app of the stack Litestar
    builds is the route's own ``handle`` method."""
    current = app
    for _ in range(16):
        owner = getattr(current, "__self__", None)
        if isinstance(owner, BaseRoute):
            return owner
        current = getattr(current, "app", None)
    return None


def _schema(spec: dict[str, Any]) -> Schema:
    properties = spec.get("properties")
    return Schema(type=OpenAPIType(spec["type"]),
                  properties=None if properties is None
                  else {name: _schema(value) for name, value in properties.items()})


_TOO_MANY_REQUESTS = OpenAPIResponse(
    description=TOO_MANY_REQUESTS["description"],
    headers={name: OpenAPIHeader(description=spec["description"], schema=_schema(spec["schema"]))
             for name, spec in TOO_MANY_REQUESTS["headers"].items()},
    content={media: OpenAPIMediaType(schema=_schema(spec["schema"]))
             for media, spec in TOO_MANY_REQUESTS["content"].items()},
)
_MARK = "_ratelimit_mw"
_DOCUMENTED: dict[type[Operation], type[Operation]] = {}


def _documenting(base: type[Operation]) -> type[Operation]:
    """The handler's ``operation_class``, made to add the 429 to its operation's responses
    (Litestar's ``responses=`` cannot carry the response headers)."""
    if getattr(base, _MARK, False):
        return base
    found = _DOCUMENTED.get(base)
    if found is None:
        parent = getattr(base, "__post_init__", None)

        def __post_init__(self: Operation) -> None:
            if parent is not None:
                parent(self)
            self.responses = {**(self.responses or {})}
            self.responses.setdefault("429", _TOO_MANY_REQUESTS)

        found = _DOCUMENTED[base] = dataclass(type(f"RateLimited{base.__name__}", (base,),
                                                   {"__post_init__": __post_init__,
                                                    _MARK: True}))
    return found


class _Handshake(WebSocket[Any, Any, Any]):
    """The handshake as key functions and hooks see it: Litestar's ``WebSocket``, a GET to
    its path as it is on the wire (``request.method`` reads "GET")."""

    method = "GET"


class RateLimitMiddleware:
    """Rate-limit the requests of a Litestar app's route handlers:
    ``DefineMiddleware(RateLimitMiddleware, limiter=limiter, default="100/minute", ...)``
    (keywords only: Litestar passes ``app=``), or ``config=Config(...)``.

    The decision is left in ``request.state.ratelimit``: a ``Decision``, or ``None`` when no
    policy applied or the backend failed and the request was admitted.
    """

    def __init__(self, app: ASGIApp, limiter: AsyncLimiter, *, config: Config | None = None,
                 **options: Unpack[ConfigOptions]) -> None:
        self.app = app
        self.guard = _guard_of(limiter, config, dict(options))
        self.limiter: AsyncLimiter = self.guard.limiter
        self.config = self.guard.config
        self._defaults = DefaultResponses()
        # id(handler) -> (handler, what it carries, its mount path): filled for the route's
        # handlers now, so that a mistyped opt stops the app from starting.
        self._handlers: dict[int, tuple[object, RouteMeta, str | None]] = {}
        route = _route_of(app)
        if route is None:
            return
        handlers: Sequence[Any] = getattr(route, "route_handlers", None) or [
            getattr(route, "route_handler", None)]
        for handler in handlers:
            self._remember(handler, route.path if getattr(handler, "is_mount", False) else None)
        if isinstance(route, HTTPRoute):  # its OpenAPI operations document the 429
            for method, (handler, _) in route.route_handler_map.items():
                if self.guard.select(method, route.path_format,
                                     self._handlers[id(handler)][1]) is not None:
                    handler.operation_class = _documenting(handler.operation_class)

    def __repr__(self) -> str:
        return f"RateLimitMiddleware({self.app!r}, {self.limiter!r})"

    def _remember(self, handler: object,
                  mount: str | None) -> tuple[object, RouteMeta, str | None]:
        entry = self._handlers[id(handler)] = (handler, _limits_of(handler, self.limiter), mount)
        return entry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        data = cast("dict[str, Any]", scope)
        kind = data["type"]
        if kind != "http":
            if kind == "websocket" and self.config.websockets:
                await self._handshake(data, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        guard = self.guard
        method: str = data["method"]
        meta, path, state = self._routed(data)
        selection = guard.select(method, path, meta)
        if selection is not None:
            verdict = await handler_async(guard, self.limiter, selection)(
                Request[Any, Any, Any](scope, receive, send), method,
                method == "OPTIONS" and is_preflight(data))
            if isinstance(verdict, Admit):
                state["ratelimit"] = verdict.decision
                await serve_admitted(guard, self.limiter, verdict, self.app, data, receive, send)
                return
            if verdict is not None:
                state["ratelimit"] = verdict.decision if isinstance(verdict, Refuse) else None
                raise RateLimitHTTPException(verdict)
        await self.app(scope, receive, send)

    def _routed(self, scope: dict[str, Any]) -> tuple[RouteMeta, str, dict[str, Any]]:
        """What the request's handler carries, the path rules match (the mount's prefix
        included) and the scope's state, where the decision is left (None until one is made);
        the route template is left in the scope for `keys.route`."""
        handler = scope.get("route_handler")
        entry = self._handlers.get(id(handler))
        if entry is None or entry[0] is not handler:
            entry = self._remember(handler, None)  # a handler built after the app (rare)
        _, meta, mount = entry
        path: str = scope["path"]
        if mount is None:
            scope[ROUTE_SCOPE_KEY] = scope.get("path_template")
        else:  # Litestar leaves a mounted app only what follows its prefix
            scope[ROUTE_SCOPE_KEY] = mount
            path = mount.rstrip("/") + path
        state = scope.get("state")
        if state is None:
            state = scope["state"] = {}
        state["ratelimit"] = None
        return meta, path, state

    async def _handshake(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        """A WebSocket handshake: one hit, as a GET to its path; refused before accept."""
        meta, path, state = self._routed(scope)
        selection = self.guard.select("GET", path, meta)
        verdict = None if selection is None else await handler_async(
            self.guard, self.limiter, selection)(
                _Handshake(cast("Scope", scope), receive, send), "GET", False)
        if isinstance(verdict, (Admit, Refuse)):
            state["ratelimit"] = verdict.decision
        if verdict is None or isinstance(verdict, Admit):
            await serve_connection(self.guard, self.limiter, verdict, self.app, scope, receive,
                                   send)
            return
        await deny_handshake(verdict, scope, receive, send, self._defaults)


class RateLimitPlugin(InitPluginProtocol):
    """``Litestar(..., plugins=[RateLimitPlugin(limiter, default="100/minute", ...)])``: the
    middleware on every route handler, and `rate_limit_exception_handler` for its
    `RateLimitHTTPException` unless the app handles that (or ``HTTPException``) itself; a
    handler for status 429 or 503 anywhere in the app wins in any case, as Litestar looks
    status codes up first."""

    __slots__ = ("config", "guard", "middleware")

    def __init__(self, limiter: AsyncLimiter, *, config: Config | None = None,
                 **options: Unpack[ConfigOptions]) -> None:
        self.config = build_config(config, options)
        self.guard = _guard_of(limiter, self.config, {})  # checked now, shared by the routes
        self.middleware = DefineMiddleware(RateLimitMiddleware, limiter=limiter,
                                           config=self.config)

    def on_app_init(self, app_config: AppConfig) -> AppConfig:
        app_config.middleware.append(self.middleware)
        handlers = app_config.exception_handlers
        if HTTPException not in handlers and RateLimitHTTPException not in handlers:
            handlers[RateLimitHTTPException] = rate_limit_exception_handler
        return app_config
