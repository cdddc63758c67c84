"""FastAPI's OpenAPI schema documents the 429 of every limited operation, whenever it is built.

Once this module is imported (the ASGI and FastAPI adapters import it where FastAPI is
installed), ``FastAPI.openapi`` adds the 429 to every operation a limit applies to (see
`document_rate_limits`), also under a middleware added with ``app.add_middleware``, which
Starlette builds only on the first request: a schema exported before any request is
documented too. The adapters are found by what they declare, not imported: a dependency
class sets `DEPENDENCY_MARK`, a middleware class offers ``guard_of(app, *args, **kwargs)``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from ratelimit_mw.http.asgi_routes import endpoint_meta, flatten_routes
from ratelimit_mw.http.guard import Guard
from ratelimit_mw.http.headers import TOO_MANY_REQUESTS

#: The class attribute that marks a FastAPI dependency as a rate limit.
DEPENDENCY_MARK = "__ratelimit_mw_dependency__"
# Marks an ``openapi`` function that documents already.
_MARK = "_ratelimit_mw"

# The guards of middleware instances around an app (not in its `user_middleware`).
_GUARDS: weakref.WeakKeyDictionary[Any, list[Guard]] = weakref.WeakKeyDictionary()


def _uses_dependency(dependant: Any, depth: int = 0) -> bool:
    return depth <= 32 and any(
        getattr(getattr(sub, "call", None), DEPENDENCY_MARK, False)
        or _uses_dependency(sub, depth + 1)
        for sub in getattr(dependant, "dependencies", ()))


def _limited(route: Any, path: str, method: str, guards: list[Guard]) -> bool:
    """Whether a limit applies to this operation: the route's decorator, the dependency
    among its dependencies, or the default and rules of a middleware on the app."""
    meta = endpoint_meta(getattr(route, "endpoint", None), method)
    return ((isinstance(meta, tuple) and any(limit.applies_to(method) for limit in meta))
            or _uses_dependency(getattr(route, "dependant", None))
            or any(guard.select(method, path, meta) is not None for guard in guards))


def _documented(app: Any, build: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The schema `build` answers, documented when this call built it, by the guards of every
    RateLimitMiddleware that wraps `app` or was added with ``app.add_middleware``."""
    before = app.openapi_schema
    schema = build()
    if schema is not before:
        added = [entry.cls.guard_of(app.router, *entry.args, **entry.kwargs)
                 for entry in getattr(app, "user_middleware", ())
                 if callable(getattr(entry.cls, "guard_of", None))]
        _document(app, schema, [*_GUARDS.get(app, ()), *added])
    return schema


def _hook_openapi() -> None:
    """Every FastAPI app's schema documents its 429s whenever it is built: served, or
    exported by a script before any request (``json.dump(app.openapi(), f)``)."""
    original = FastAPI.openapi
    if getattr(original, _MARK, False):
        return

    def openapi(self: FastAPI) -> dict[str, Any]:
        return _documented(self, lambda: original(self))

    setattr(openapi, _MARK, True)
    FastAPI.openapi = openapi  # type: ignore[method-assign]


_hook_openapi()


def document_rate_limits(app: Any, guard: Guard | None = None) -> Any:
    """Add the 429 (with ``Retry-After``, ``RateLimit`` and ``RateLimit-Policy``) to every
    operation of `app`'s OpenAPI schema that a limit applies to: a route decorated with
    ``limiter.limit``, one that depends on a `RateLimitDependency`, or one that a
    middleware's default or rules limit. FastAPI's own ``openapi()`` does so once this
    module is imported; an app that replaces ``app.openapi`` with its own function calls
    this afterwards. `guard`: the guard of a middleware that wraps `app`. Returns `app`."""
    if guard is not None and guard not in _GUARDS.setdefault(app, []):
        _GUARDS[app].append(guard)
    own = vars(app).get("openapi")
    if own is not None and not getattr(own, _MARK, False):
        def openapi() -> dict[str, Any]:
            return _documented(app, own)

        setattr(openapi, _MARK, True)
        app.openapi = openapi
    return app


def document_fastapi(app: object, guard: Guard) -> None:
    """`document_rate_limits(app, guard)` when `app` is a FastAPI app (the ASGI middleware
    asks of every app it meets)."""
    if isinstance(app, FastAPI):
        document_rate_limits(app, guard)


def _document(app: Any, schema: dict[str, Any], guards: list[Guard]) -> None:
    limited: set[tuple[str, str]] = set()
    for entry in flatten_routes(list(app.routes)):
        route = getattr(entry, "route", entry)
        unique_id = getattr(route, "unique_id", None)
        path = getattr(entry, "path_format", None) or getattr(route, "path_format", None)
        if unique_id is None or not isinstance(path, str):
            continue
        for method in getattr(route, "methods", None) or ():
            if _limited(route, path, method, guards):
                limited.add((unique_id, method.lower()))
    for operations in schema.get("paths", {}).values():
        for method, operation in operations.items():
            # (A route of several methods gives each of them the same operationId.)
            if (operation.get("operationId"), method) in limited:
                operation.setdefault("responses", {}).setdefault("429", TOO_MANY_REQUESTS)
