"""What an ASGI endpoint carries: the route decorators' limits, read through wrappers, class
endpoints and included FastAPI routers, for every adapter that finds endpoints itself (the
Starlette resolver of `ratelimit_mw.asgi`, Litestar's plugin, FastAPI's OpenAPI schema).
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ratelimit_mw import keys as _keys
from ratelimit_mw.routing import route_limits

RouteMeta = Any  # tuple[RouteLimit, ...] | EXEMPT | None, as routing.route_limits gives it

_HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


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


def carries_any(endpoint: object) -> bool:
    """Whether the endpoint carries a decorator for any method it may serve."""
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


def needs_route(key: Callable[[Any], Any] | None) -> bool:
    """May this key function read the route template? Undeclared callables may."""
    return key is not None and "route" in _keys.reads(key)
