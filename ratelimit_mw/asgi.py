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
request is decided by the shared guard (`ratelimit_mw.http.guard`) from the request's
selection (`ratelimit_mw.http.selection`, made once per method and route): this module
resolves the route, hands the guard the scope (a Starlette ``Request`` only where a callable
of the app will read it), and sends the verdict (`ratelimit_mw.http.asgi_send`); the
guard awaits the one backend call, bounded by ``backend_timeout``.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only (strings at run time)
    from typing_extensions import Unpack

from ratelimit_mw._async.handler import Handler, handler_async
from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.http.asgi_routes import (
    RouteMeta,
    carries_any,
    endpoint_meta,
    flatten_routes,
    needs_route,
    routes_of,
)
from ratelimit_mw.http.asgi_send import (
    DefaultResponses,
    Watch,
    deny_handshake,
    is_preflight,
    serve_admitted,
    serve_connection,
)
from ratelimit_mw.http.config import Config, ConfigOptions, build_config
from ratelimit_mw.http.extras import require
from ratelimit_mw.http.guard import Guard
from ratelimit_mw.http.headers import encode_raw
from ratelimit_mw.http.rules import Rule
from ratelimit_mw.http.verdict import Admit, Refuse, Unavailable
from ratelimit_mw.keys import ASGI, ROUTE_SCOPE_KEY
from ratelimit_mw.limiter import AsyncLimiter, require_async_limiter

require("starlette", "starlette", "ratelimit_mw.asgi")
from starlette.datastructures import Headers  # noqa: E402
from starlette.requests import Request  # noqa: E402

# Starlette's own ASGI types: `app.add_middleware(RateLimitMiddleware, ...)` then type-checks
# under mypy --strict against its middleware factory protocol.
from starlette.types import ASGIApp, Receive, Scope, Send  # noqa: E402
from starlette.websockets import WebSocket  # noqa: E402

try:  # where FastAPI is installed, its schema documents the 429s whenever it is built
    from ratelimit_mw.http.openapi import document_fastapi
except ImportError:
    def document_fastapi(app: object, guard: Guard) -> None:
        return None

__all__ = ["Config", "RateLimitMiddleware", "Rule", "is_preflight"]

# Which Starlette route will serve a request. The middleware runs before the app's router,
# so it asks the router's own routes (``route.matches(scope)``): the first full match, else
# the first partial one (the route that answers 405), descending into ``Mount``, ``Host``,
# nested ``Router``s, mounted sub-apps and included FastAPI routers, each mount's prefix
# added to the template. Resolutions are cached per (method, path); nothing is resolved
# when no endpoint carries a decorator and no key function needs the template.
Resolved = tuple["str | None", RouteMeta]  # (template, metadata)
_CACHE_SIZE = 4096
_MAX_DEPTH = 16  # nesting of mounts/routers; deeper trees are treated as unresolvable
_UNRESOLVED: Resolved = (None, None)
_MOUNT_SUFFIX = "/{path}"


def _is_host(route: Any) -> bool:
    return getattr(route, "host_regex", None) is not None


def _sub_routes(route: Any) -> Sequence[Any] | None:
    """The routes inside a Mount or Host (None for a plain route or a mounted plain app)."""
    try:
        routes = getattr(route, "routes", None)
    except Exception:
        return None
    if routes is None or routes:
        return routes
    # Mount(app=SomeMiddleware(sub_app)) lists no routes; look through the wrappers.
    return routes_of(getattr(route, "app", None))


def _walk(routes: Iterable[Any], depth: int, seen: set[int]) -> tuple[bool, bool]:
    """(whether an endpoint in the tree carries a decorator, whether it has a Host route)."""
    decorated = host = False
    if depth > _MAX_DEPTH or id(routes) in seen:
        return decorated, host
    seen.add(id(routes))
    for route in flatten_routes(routes):
        host = host or _is_host(route)
        endpoint = getattr(route, "endpoint", None)
        decorated = decorated or (endpoint is not None and carries_any(endpoint))
        sub = _sub_routes(route)
        if sub is not None:
            inner = _walk(sub, depth + 1, seen)
            decorated, host = decorated or inner[0], host or inner[1]
        elif getattr(route, "path_format", "").endswith(_MOUNT_SUFFIX):  # a mounted plain app
            app = getattr(route, "app", None)
            decorated = decorated or (app is not None and carries_any(app))
    return decorated, host


def _match(routes: Iterable[Any], scope: dict[str, Any], method: str, prefix: str,
           depth: int) -> Resolved | None:
    """The first full match among `routes`, else the template of the first partial one (the
    router answers 405) with no metadata: a 405 never reaches the endpoint, so its decorators
    do not apply but the default does, as in Flask. None when nothing matches."""
    if depth > _MAX_DEPTH:
        return None
    partial: tuple[Any, dict[str, Any]] | None = None
    for route in flatten_routes(routes):
        try:
            match, child = route.matches(scope)
        except Exception:  # a custom route or convertor failing must not fail the request
            continue
        level = getattr(match, "value", match)
        if level == 2:  # Match.FULL
            return _descend(route, scope, child, method, prefix, depth)
        if level == 1 and partial is None:  # Match.PARTIAL
            partial = (route, child)
    if partial is None:
        return None
    resolved = _descend(partial[0], scope, partial[1], method, prefix, depth)
    return None if resolved is None else (resolved[0], None)


def _descend(route: Any, scope: dict[str, Any], child: Any, method: str, prefix: str,
             depth: int) -> Resolved | None:
    child_scope = {**scope, **child} if isinstance(child, dict) else scope
    sub = _sub_routes(route)
    if _is_host(route):
        return None if sub is None else _match(sub, child_scope, method, prefix, depth + 1)
    path_format = getattr(route, "path_format", None)
    if sub is not None and isinstance(path_format, str) and path_format.endswith(_MOUNT_SUFFIX):
        # A Mount: whatever it routes to inside decides; a miss inside is the sub-router's
        # 404, which Starlette does not fall back from either.
        inner = prefix + path_format[: -len(_MOUNT_SUFFIX)]
        return _match(sub, child_scope, method, inner, depth + 1)
    endpoint = child.get("endpoint") if isinstance(child, dict) else None
    if endpoint is None:
        endpoint = getattr(route, "endpoint", None)
    template = prefix + path_format if isinstance(path_format, str) else None
    return (template, None if endpoint is None else endpoint_meta(endpoint, method))


class RouteResolver:
    """Resolves (method, path) to (template, endpoint metadata), cached per app. ``app``,
    ``routes`` and ``size`` say what it resolved against (the middleware checks them per
    request), ``host`` whether Host routes make the host part of a request's shape."""

    __slots__ = ("_always", "_cache", "app", "enabled", "host", "routes", "size")

    def __init__(self, *, always: bool) -> None:
        # always: a key function needs the template, so resolve even with no decorators.
        self._always = always
        self.app: object = None
        self.routes: Sequence[Any] | None = None
        self.size = -1
        self.enabled = self.host = False
        self._cache: dict[tuple[str, ...], Resolved] = {}

    def _rebuild(self, app: object) -> None:
        self.app = app
        self.routes = routes = routes_of(app)
        self._cache.clear()
        self.size = -1 if routes is None else len(routes)
        try:
            decorated, self.host = (False, False) if routes is None else _walk(routes, 0, set())
        except Exception:  # an odd route object: resolve per request, which is safe
            decorated = self.host = True
        self.enabled = routes is not None and (self._always or decorated)

    def resolved(self, scope: MutableMapping[str, Any], app: object, method: str,
                 path: str) -> Resolved:
        """The request's route template and what its endpoint carries (None, None: nothing,
        or nothing needs resolving)."""
        routes = self.routes
        if app is not self.app or (routes is not None and len(routes) != self.size):
            self._rebuild(app)
            routes = self.routes
        if not self.enabled or routes is None:
            return _UNRESOLVED
        # Host routes match on the Host header: requests for other hosts share no entry.
        cache_key = (method, path, _host_of(scope)) if self.host else (method, path)
        found = self._cache.get(cache_key)
        if found is None:
            found = _match(routes, dict(scope), method, "", 0) or _UNRESOLVED
            if len(self._cache) >= _CACHE_SIZE:  # paths are client text: dropped whole
                self._cache.clear()
            self._cache[cache_key] = found
        return found

    def resolve(self, scope: MutableMapping[str, Any], app: object, method: str,
                path: str) -> RouteMeta:
        """What the request's endpoint carries (None: nothing, or nothing needs resolving);
        its template, when found, is left in ``scope[ROUTE_SCOPE_KEY]``."""
        template, meta = self.resolved(scope, app, method, path)
        if template is not None:
            scope[ROUTE_SCOPE_KEY] = template
        return meta


def _host_of(scope: MutableMapping[str, Any]) -> str:
    for name, value in scope.get("headers", ()):
        if name == b"host":
            return str(value.decode("latin-1").lower())
    return ""


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


def _inside_litestar(app: object) -> bool:
    """Whether `app` is a piece of a Litestar app's route handling (not the whole app, which
    this middleware may wrap for its defaults and rules, 404s included)."""
    module = type(app).__module__
    return module.partition(".")[0] == "litestar" and module != "litestar.app"


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
        if _inside_litestar(app):
            # Litestar builds this per route handler (DefineMiddleware), where its handlers'
            # decorators cannot be seen: a limit silently ignored is worse than none.
            raise ConfigurationError(
                "ratelimit_mw.asgi.RateLimitMiddleware cannot see Litestar's route handlers "
                "(their @limiter.limit would be ignored); use the Litestar adapter: "
                "plugins=[RateLimitPlugin(limiter, default=...)] or middleware=[DefineMiddleware("
                "RateLimitMiddleware, limiter=limiter, default=...)] with both imported from "
                "ratelimit_mw.litestar")
        self.app = app
        self.guard = self.guard_of(app, limiter, config=config, **options)
        self.limiter: AsyncLimiter = self.guard.limiter
        self.config = self.guard.config
        # Route resolution: keyed on the app this middleware wraps when its route tree can be
        # reached from here (through .app of the middleware below it); otherwise on
        # scope["app"], which Starlette sets before running its middleware stack.
        self._root: object = app if routes_of(app) is not None else None
        self._resolver = RouteResolver(always=any(map(needs_route, self.guard.keys_in_use)))
        self._defaults = DefaultResponses()  # the default 429 and 503
        # (method, path[, host]) -> what `_entry` worked out for them.
        self._entries: dict[tuple[str, ...], tuple[str | None, Handler | None, bool]] = {}
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
        return Guard(config, limiter, timeout=config.backend_timeout, raw=True, requests=ASGI)

    def __repr__(self) -> str:
        return f"RateLimitMiddleware({self.app!r}, {self.limiter!r})"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "websocket" and self.config.websockets:
                await self._handshake(scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        method: str = scope["method"]
        path: str = scope["path"] if not scope.get("root_path") else route_path(scope)
        # What is fixed per method and path (its route's template, its limits' handler)
        # is looked up whole; the routes it was resolved against are checked first (the
        # resolver's app is the one `_resolved` last gave it: this root, else the app seen).
        resolver = self._resolver
        routes = resolver.routes
        if (scope.get("app") is not self._seen_app
                or (routes is not None and len(routes) != resolver.size)):
            self._entries.clear()
        key = (method, path, _host_of(scope)) if resolver.host else (method, path)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entry(scope, method, path, key)
        template, handle, scope_only = entry
        if template is not None:
            scope[ROUTE_SCOPE_KEY] = template
        # The decision is left in the scope's state for the app: a Decision, else None.
        state = scope.setdefault("state", {})
        if handle is None:
            state["ratelimit"] = None
            await self.app(scope, receive, send)
            return
        # One Request for every key function, hook and handler of this request; where only
        # built-in keys read it (decided when the selection was made), the scope.
        request: Any
        if scope_only:
            request = _ScopeView()
            request.scope = scope
        else:
            request = Request(scope)
        verdict = await handle(request, method, method == "OPTIONS" and is_preflight(scope))
        if type(verdict) is Admit:
            state["ratelimit"] = verdict.decision
            await serve_admitted(self.guard, self.limiter, verdict, self.app, scope, receive,
                                 send)
        elif type(verdict) is Refuse:
            state["ratelimit"] = verdict.decision
            await self._refuse(request, verdict, scope, receive, send)
        else:
            state["ratelimit"] = None
            if verdict is not None:
                await self._answer(verdict, send)  # type: ignore[arg-type]
            else:
                await self.app(scope, receive, send)

    def _entry(self, scope: Scope, method: str, path: str,
               key: tuple[str, ...]) -> tuple[str | None, Handler | None, bool]:
        """What a method and path come to, worked out on their first request and kept: the
        route's template (for ``keys.route()``), the handler of the limits that apply (None:
        none), whether their keys read the scope alone. Bounded: paths are client text."""
        template, meta = self._resolved(scope, method, path)
        selection = self.guard.select(method, path, meta)
        entry = (template,
                 None if selection is None else handler_async(self.guard, self.limiter,
                                                              selection),
                 selection is not None and selection.scope_only)
        entries = self._entries
        if len(entries) >= _CACHE_SIZE:
            entries.clear()
        entries[key] = entry
        return entry

    def _resolved(self, scope: Scope, method: str, path: str) -> Resolved:
        """The request's route template and what its endpoint carries; a new app seen in
        the scope gets its OpenAPI schema documented first."""
        app = scope.get("app")
        if app is not self._seen_app:
            self._seen_app = app
            document_fastapi(app, self.guard)
        return self._resolver.resolved(scope, self._root if self._root is not None else app,
                                       method, path)

    def _routed(self, scope: Scope, method: str, path: str) -> tuple[dict[str, Any], Any]:
        """What the request's endpoint carries (its template left in the scope), and the
        scope's state, where the decision is left (None until one is made)."""
        template, meta = self._resolved(scope, method, path)
        if template is not None:
            scope[ROUTE_SCOPE_KEY] = template
        state = scope.setdefault("state", {})
        state["ratelimit"] = None
        return state, meta

    async def _handshake(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A WebSocket handshake: one hit, as a GET to its path; refused before accept."""
        path = route_path(scope)
        # Resolved apart from HTTP requests to the same path: another route may take them.
        state, meta = self._routed(scope, "WEBSOCKET", path)
        selection = self.guard.select("GET", path, meta)
        verdict = None if selection is None else await handler_async(
            self.guard, self.limiter, selection)(_Handshake(scope, receive, send), "GET", False)
        if verdict is None or isinstance(verdict, Admit):
            state["ratelimit"] = None if verdict is None else verdict.decision
            await serve_connection(self.guard, self.limiter, verdict, self.app, scope, receive,
                                   send)
            return
        if isinstance(verdict, Refuse):
            state["ratelimit"] = verdict.decision
        await deny_handshake(verdict, scope, receive, send, self._defaults)

    async def _refuse(self, request: Any, refusal: Refuse, scope: Scope, receive: Receive,
                      send: Send) -> None:
        on_blocked = self.config.on_blocked
        if on_blocked is not None:
            if not isinstance(request, Request):  # the app's hook is handed a Request
                request = Request(scope)
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
                watch = Watch(send, encode_raw(refusal.headers), fill=True)
                await response(scope, receive, watch.send)
                return
        await self._answer(refusal, send)

    async def _answer(self, verdict: Refuse | Unavailable, send: Send) -> None:
        """The default 429 or 503, as JSON."""
        await self._defaults.send(verdict, send)


class _ScopeView:
    """A request as the built-in keys read it (`keys.reads_scope`): the scope, and its
    headers when asked; built without a Python call (no ``__init__``: ``scope`` is set)."""

    __slots__ = ("scope",)
    scope: Scope

    @property
    def headers(self) -> Headers:
        return Headers(scope=self.scope)


class _Handshake(WebSocket):
    """The handshake as key functions and hooks see it: a Starlette ``WebSocket`` that is a
    GET to its path, as it is on the wire (``request.method`` reads "GET")."""

    method = "GET"

