"""Which route will serve an ASGI request: its template and what its endpoint carries.

The middleware runs before the app's router, so it asks the router's own routes
(``route.matches(scope)``) which one will take the request: the first full match, else the
first partial one (the route that answers 405), descending into ``Mount``, ``Host``, nested
``Router``s, mounted sub-apps and (``fastapi.routing.iter_route_contexts``) included FastAPI
routers, each mount's prefix added to the template. Resolutions are cached per (method,
path); nothing is resolved when no endpoint carries a decorator and no key function needs
the template.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Iterable, MutableMapping, Sequence
from typing import Any

from ratelimit_mw import keys as _keys
from ratelimit_mw.keys import ROUTE_SCOPE_KEY
from ratelimit_mw.routing import route_limits

RouteMeta = Any  # tuple[RouteLimit, ...] | EXEMPT | None, as routing.route_limits gives it
Resolved = tuple["str | None", RouteMeta]  # (template, metadata)

_CACHE_SIZE = 4096
_MAX_DEPTH = 16  # nesting of mounts/routers; deeper trees are treated as unresolvable
_HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
_UNRESOLVED: Resolved = (None, None)
_MOUNT_SUFFIX = "/{path}"


def endpoint_meta(endpoint: object, method: str) -> RouteMeta:
    """What the endpoint (or the handler a class-based endpoint dispatches to) carries,
    through ``functools.wraps`` chains and ``functools.partial``; for an ``HTTPEndpoint``
    class, the method's own decorator wins over one on the class."""
    if inspect.isclass(endpoint):
        name = method.lower()
        if method == "HEAD" and not hasattr(endpoint, "head"):
            name = "get"  # what HTTPEndpoint.dispatch calls
        handler = getattr(endpoint, name, None)
        found = None if handler is None else endpoint_meta(handler, method)
        return found if found is not None else route_limits(endpoint)
    current: Any = endpoint
    for _ in range(16):
        found = route_limits(current)
        if found is not None or current is None:
            return found
        is_partial = isinstance(current, functools.partial)
        current = current.func if is_partial else getattr(current, "__wrapped__", None)
    return None


def _carries_any(endpoint: object) -> bool:
    methods = _HTTP_METHODS if inspect.isclass(endpoint) else ("GET",)
    return any(endpoint_meta(endpoint, method) is not None for method in methods)


def flatten_routes(routes: Iterable[Any]) -> Iterable[Any]:
    """The routes as the router tries them, included FastAPI routers expanded."""
    iterate = getattr(sys.modules.get("fastapi.routing"), "iter_route_contexts", None)
    return routes if iterate is None else iterate(list(routes))


def routes_of(app: object) -> Sequence[Any] | None:
    """The route list of an app, a router, or an app wrapped in middleware (``.app``)."""
    current = app
    for _ in range(8):
        if current is None:
            return None
        try:
            routes = getattr(current, "routes", None)
        except Exception:  # a property of someone's app; it must not break the request
            return None
        is_list = isinstance(routes, Sequence) and not isinstance(routes, (str, bytes))
        # An empty list on something that wraps another app: the routes may be further in.
        if is_list and (routes or not hasattr(current, "app")):
            return routes
        current = getattr(current, "app", None)
    return None


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
        decorated = decorated or (endpoint is not None and _carries_any(endpoint))
        sub = _sub_routes(route)
        if sub is not None:
            inner = _walk(sub, depth + 1, seen)
            decorated, host = decorated or inner[0], host or inner[1]
        elif getattr(route, "path_format", "").endswith(_MOUNT_SUFFIX):  # a mounted plain app
            app = getattr(route, "app", None)
            decorated = decorated or (app is not None and _carries_any(app))
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


def needs_route(key: Callable[[Any], Any] | None) -> bool:
    """May this key function read the route template? Undeclared callables may."""
    return key is not None and "route" in _keys.reads(key)


class RouteResolver:
    """Resolves (method, path) to (template, endpoint metadata), cached per app."""

    __slots__ = ("_always", "_app", "_cache", "_enabled", "_host", "_routes", "_size")

    def __init__(self, *, always: bool) -> None:
        # always: a key function needs the template, so resolve even with no decorators.
        self._always = always
        self._app: object = None
        self._routes: Sequence[Any] | None = None
        self._size = -1
        self._enabled = self._host = False
        self._cache: dict[tuple[str, ...], Resolved] = {}

    def _rebuild(self, app: object) -> None:
        self._app = app
        self._routes = routes = routes_of(app)
        self._cache.clear()
        self._size = -1 if routes is None else len(routes)
        try:
            decorated, self._host = (False, False) if routes is None else _walk(routes, 0, set())
        except Exception:  # an odd route object: resolve per request, which is safe
            decorated = self._host = True
        self._enabled = routes is not None and (self._always or decorated)

    def resolve(self, scope: MutableMapping[str, Any], app: object, method: str,
                path: str) -> RouteMeta:
        """What the request's endpoint carries (None: nothing, or nothing needs resolving);
        its template, when found, is left in ``scope[ROUTE_SCOPE_KEY]``."""
        routes = self._routes
        if app is not self._app or (routes is not None and len(routes) != self._size):
            self._rebuild(app)
            routes = self._routes
        if not self._enabled or routes is None:
            return None
        # Host routes match on the Host header: requests for other hosts share no entry.
        cache_key = (method, path, _host_of(scope)) if self._host else (method, path)
        found = self._cache.get(cache_key)
        if found is None:
            found = _match(routes, dict(scope), method, "", 0) or _UNRESOLVED
            if len(self._cache) >= _CACHE_SIZE:  # paths are client text: dropped whole
                self._cache.clear()
            self._cache[cache_key] = found
        template, meta = found
        if template is not None:
            scope[ROUTE_SCOPE_KEY] = template
        return meta


def _host_of(scope: MutableMapping[str, Any]) -> str:
    for name, value in scope.get("headers", ()):
        if name == b"host":
            return str(value.decode("latin-1").lower())
    return ""
