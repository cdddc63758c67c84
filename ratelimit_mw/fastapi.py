"""The FastAPI dependency form, for those who prefer ``Depends`` to the middleware.

    from fastapi import Depends, FastAPI
    from ratelimit_mw import AsyncLimiter, keys
    from ratelimit_mw.fastapi import (RateLimitDependency, RateLimitHTTPException,
                                      rate_limit_exception_handler)

    limiter = AsyncLimiter()
    app = FastAPI()
    app.add_exception_handler(RateLimitHTTPException, rate_limit_exception_handler)

    @app.post("/login", dependencies=[Depends(RateLimitDependency(limiter, "5/minute"))])
    async def login(): ...

A refusal raises ``RateLimitHTTPException``, an ``HTTPException`` (status 429, the same
``Retry-After``, ``RateLimit``, ``RateLimit-Policy`` and ``Cache-Control`` headers as the
middleware). With ``rate_limit_exception_handler`` installed the body is the middleware's too
(``{"detail": ..., "retry_after": N}``); without it FastAPI's own handler answers
``{"detail": "Too Many Requests"}`` with the same status and headers. Admitted responses get
the rate-limit headers through the ``Response`` FastAPI injects, which FastAPI copies onto the
response the endpoint's return value becomes (not onto a ``Response`` the endpoint returns
itself).

Quotas: with a rate string and no ``name``, each endpoint using the dependency counts apart
(the policy is named after the endpoint, as ``@limiter.limit`` does), so one instance can sit
on a whole router. With ``name=`` (or a ``Policy``) every endpoint using it shares one quota.
"""

# No "from __future__ import annotations" here: FastAPI reads the annotations of
# RateLimitDependency.__call__ at runtime, and an instance has no __globals__ to resolve
# string annotations against.

import json
import sys
import weakref
from collections.abc import Callable
from typing import Any, TypedDict

from ratelimit_mw.core.decision import Decision
from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.core.policy import Policy
from ratelimit_mw.http.asgi_routes import (
    RouteResolver,
    endpoint_meta,
    flatten_routes,
    needs_route,
    route_path,
)
from ratelimit_mw.http.config import Config, ErrorPolicy, build_config
from ratelimit_mw.http.drive import async_timeout, decide_async, require_async_limiter
from ratelimit_mw.http.extras import require
from ratelimit_mw.http.guard import Admit, Applied, Guard, Refuse, Selection
from ratelimit_mw.http.routing import Cost, Predicate, stable_module, validate_cost
from ratelimit_mw.keys import ROUTE_SCOPE_KEY, KeyFunc
from ratelimit_mw.limiter import AsyncLimiter

if sys.version_info >= (3, 11):  # read at run time: this module's annotations are evaluated
    from typing import Unpack
else:  # pragma: no cover - Python 3.10 (FastAPI depends on typing_extensions)
    from typing_extensions import Unpack

require("fastapi", "fastapi", "ratelimit_mw.fastapi")
from fastapi import FastAPI, HTTPException, Request, Response  # noqa: E402

__all__ = ["TOO_MANY_REQUESTS", "Config", "RateLimitDependency", "RateLimitHTTPException",
           "document_rate_limits", "rate_limit_exception_handler"]


class RateLimitHTTPException(HTTPException):
    """A 429 (refused) or 503 (backend down, ``on_backend_error="deny"``) from the dependency.

    ``body`` is the JSON the middleware would send; ``decision`` the refusing Decision (None
    for a 503).
    """

    def __init__(self, status_code: int, body: bytes, headers: dict[str, str],
                 decision: Decision | None = None) -> None:
        super().__init__(status_code=status_code, detail=json.loads(body)["detail"],
                         headers=headers)
        self.body = body
        self.decision = decision


async def rate_limit_exception_handler(request: Request, exc: Exception) -> Response:
    """Answer a ``RateLimitHTTPException`` exactly as the middleware would."""
    if not isinstance(exc, RateLimitHTTPException):
        raise exc
    return Response(exc.body, status_code=exc.status_code, headers=exc.headers,
                    media_type="application/json")


def _refuse_middleware_only(config: Config) -> None:
    """Options a dependency could only ignore: a user who sets one expects it to act."""
    if config.on_blocked is not None:
        raise ConfigurationError(
            "on_blocked belongs to the middleware: a dependency answers a refusal by raising "
            "RateLimitHTTPException; shape that answer with an exception handler instead, "
            "app.add_exception_handler(RateLimitHTTPException, your_handler) (the exception "
            "carries .decision, .headers and .body)"
        )
    if config.per_method:
        raise ConfigurationError(
            "per_method applies to the middleware's default limit; a dependency counts for "
            "the endpoints it sits on: put it on the one method's route, or give each method "
            "its own RateLimitDependency (name= to choose which share a quota)"
        )
    if config.charge_method_not_allowed:
        raise ConfigurationError(
            "charge_method_not_allowed applies to the middleware: FastAPI answers 405 before "
            "any dependency runs, so a dependency never sees one; drop the option, or set it "
            "on RateLimitMiddleware"
        )


class DependencyOptions(TypedDict, total=False):
    """The options `RateLimitDependency` takes as keywords (the others are the middleware's)."""

    on_backend_error: ErrorPolicy
    headers: bool
    legacy_headers: bool
    mode: str
    on_refusal: Callable[[Any, Decision], None] | None
    exempt_when: Predicate | None
    charge_preflight: bool
    backend_timeout: float
    backend_cooldown: float
    enabled: bool | None


class RateLimitDependency:
    """``Depends(RateLimitDependency(limiter, "5/minute", key=..., cost=...))``.

    ``key`` (default: the configuration's, ``keys.client_ip()``) and ``cost`` (a whole number
    or ``(request) -> int``) belong to this limit; the other options are the middleware's
    (``config=`` or keywords: ``on_backend_error``, ``headers``, ``legacy_headers``,
    ``mode``, ``on_refusal``, ``exempt_when``, ``charge_preflight``, ``backend_timeout``,
    ``backend_cooldown``); those that only the middleware can act on (``default``,
    ``rules``, ``count_when``, ``on_blocked``, ``per_method``,
    ``charge_method_not_allowed``) raise ConfigurationError here.
    ``name`` makes every endpoint using this dependency share one quota. The dependency
    returns the Decision (or None when the backend failed and the request was admitted) and
    leaves it in ``request.state.ratelimit``.
    """

    def __init__(self, limiter: AsyncLimiter, rates: Policy | str, *,
                 key: KeyFunc | None = None, cost: Cost = 1, name: str | None = None,
                 config: Config | None = None,
                 **options: Unpack[DependencyOptions]) -> None:
        self.limiter = require_async_limiter(limiter, "RateLimitDependency")
        if isinstance(rates, Policy):
            if name is not None:
                raise ConfigurationError(
                    "name= applies to a rate string; a Policy is already named: "
                    f'Policy({";".join(map(str, rates.rates))!r}, name={name!r})'
                )
            shared: Policy | None = rates
        elif isinstance(rates, str):
            shared = Policy(rates, name=name) if name is not None else None
            if shared is None:
                Policy(rates)  # a typo fails here, at import time, not on a request
        else:
            raise ConfigurationError(
                f'RateLimitDependency takes a rate string such as "5/minute" or a Policy, '
                f"got {rates!r}"
            )
        self.rates = rates
        probe = shared if shared is not None else Policy(str(rates))
        self.cost = validate_cost(cost, probe)
        self.config = build_config(config, options)
        if self.config.count_when is not None or self.config.rule_list or self.config.defaults:
            raise ConfigurationError(
                "RateLimitDependency takes its limit as `rates`; count_when, rules and default "
                "belong to the middleware (ratelimit_mw.asgi.RateLimitMiddleware)"
            )
        _refuse_middleware_only(self.config)
        self.key = key or self.config.key_func
        self.guard = Guard(self.config, self.limiter,
                           timeout=async_timeout(self.limiter, self.config.backend_timeout))
        self._shared = None if shared is None else self._selection_of(shared, shared.name)
        if shared is not None:  # one quota under a name: it may meet the limiter's others
            self.limiter._shared_logs.add((shared,))
        # endpoint id -> (endpoint, Selection); the endpoint is kept so its id stays its own.
        self._per_endpoint: dict[int, tuple[object, Selection]] = {}
        self._resolver = RouteResolver(always=True) if needs_route(self.key) else None

    def __repr__(self) -> str:
        return f"RateLimitDependency({self.limiter!r}, {self.rates!r})"

    def _selection_of(self, policy: Policy, label: str) -> Selection:
        return Selection((Applied(policy, self.key, self.cost, label),))

    def _selection(self, endpoint: object) -> Selection:
        if self._shared is not None:
            return self._shared
        cached = self._per_endpoint.get(id(endpoint))
        if cached is None or cached[0] is not endpoint:
            label = "depends" if endpoint is None else getattr(endpoint, "__qualname__", "?")
            counter = f"route {stable_module(endpoint)}.{label} {self.rates}"
            cached = (endpoint, self._selection_of(Policy(str(self.rates), name=counter), label))
            self._per_endpoint[id(endpoint)] = cached
        return cached[1]

    async def __call__(self, request: Request, response: Response) -> Decision | None:
        scope = request.scope
        guard = self.guard
        if not guard.enabled:
            request.state.ratelimit = None
            return None
        if self._resolver is not None and ROUTE_SCOPE_KEY not in scope:
            # The middleware sets the template when it runs; without it, resolve it here,
            # relative to the app that routed the request.
            resolved = self._resolver.resolve(scope, scope.get("app"), scope["method"],
                                              route_path(scope))
            if resolved is not None and resolved[0] is not None:
                scope[ROUTE_SCOPE_KEY] = resolved[0]
        method: str = scope["method"]
        preflight = method == "OPTIONS" and "access-control-request-method" in request.headers
        selection = self._selection(scope.get("endpoint"))
        verdict = await decide_async(guard, self.limiter, selection, request, method,
                                     preflight)
        if verdict is None:
            return None
        decision = verdict.decision if isinstance(verdict, (Admit, Refuse)) else None
        request.state.ratelimit = decision
        if isinstance(verdict, Admit):
            for header, value in verdict.headers or ():
                response.headers.append(header, value)
            return decision
        raise RateLimitHTTPException(verdict.status, verdict.body,
                                     {k: v for k, v in verdict.headers if k != "Content-Type"},
                                     decision)


# -- OpenAPI -------------------------------------------------------------------------------
_HEADERS = {
    "Retry-After": ("Seconds until a retry can be admitted (whole seconds, at least 1)",
                    "integer"),
    "RateLimit": ('The governing limit: "<name>";r=<remaining>;t=<seconds> (IETF draft)',
                  "string"),
    "RateLimit-Policy": ('Every limit that applies: "<name>";q=<quota>;w=<window seconds>',
                         "string"),
}
TOO_MANY_REQUESTS: dict[str, Any] = {
    "description": "Too Many Requests: a rate limit is exhausted; retry after Retry-After "
                   "seconds",
    "headers": {name: {"description": text, "schema": {"type": kind}}
                for name, (text, kind) in _HEADERS.items()},
    "content": {"application/json": {"schema": {
        "type": "object",
        "properties": {"detail": {"type": "string"}, "retry_after": {"type": "integer"}},
    }}},
}


def _uses_dependency(dependant: Any, seen: int = 0) -> bool:
    if seen > 32:
        return False
    for sub in getattr(dependant, "dependencies", ()):
        if isinstance(getattr(sub, "call", None), RateLimitDependency):
            return True
        if _uses_dependency(sub, seen + 1):
            return True
    return False


def _limited(route: Any, path: str, method: str, guards: list[Guard]) -> bool:
    """Whether a limit applies to this operation: the route's decorator, the dependency
    among its dependencies, or the default and rules of a middleware on the app."""
    meta = endpoint_meta(getattr(route, "endpoint", None), method)
    if isinstance(meta, tuple) and any(limit.applies_to(method) for limit in meta):
        return True
    if _uses_dependency(getattr(route, "dependant", None)):
        return True
    return any(guard.select(method, path, meta) is not None for guard in guards)


# The guards of middleware instances around an app (not in its `user_middleware`).
_GUARDS: weakref.WeakKeyDictionary[Any, list[Guard]] = weakref.WeakKeyDictionary()


def _guards(app: Any) -> list[Guard]:
    """The guards of every RateLimitMiddleware on `app`: those that wrap it, and those added
    with ``app.add_middleware``, which Starlette builds only on the first request."""
    from ratelimit_mw.asgi import RateLimitMiddleware  # the ASGI adapter imports this module

    added = [entry.cls(app.router, *entry.args, **entry.kwargs).guard
             for entry in getattr(app, "user_middleware", ())
             if isinstance(entry.cls, type) and issubclass(entry.cls, RateLimitMiddleware)]
    return [*_GUARDS.get(app, ()), *added]


def _documented(app: Any, build: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The schema `build` answers, documented when this call built it."""
    before = app.openapi_schema
    schema = build()
    if schema is not before:
        _document(app, schema, _guards(app))
    return schema


def _hook_openapi() -> None:
    """Every FastAPI app's schema documents its 429s whenever it is built: served, or
    exported by a script before any request (``json.dump(app.openapi(), f)``)."""
    original = FastAPI.openapi
    if getattr(original, "_ratelimit_mw", False):
        return

    def openapi(self: FastAPI) -> dict[str, Any]:
        return _documented(self, lambda: original(self))

    openapi._ratelimit_mw = True  # type: ignore[attr-defined]
    FastAPI.openapi = openapi  # type: ignore[method-assign]


_hook_openapi()


def document_rate_limits(app: Any, guard: Guard | None = None) -> Any:
    """Add the 429 (with ``Retry-After``, ``RateLimit`` and ``RateLimit-Policy``) to every
    operation of `app`'s OpenAPI schema that a limit applies to: a route decorated with
    ``limiter.limit``, one that depends on a `RateLimitDependency`, or one that a
    middleware's default or rules limit. FastAPI's own ``openapi()`` does so once this
    module is imported (``ratelimit_mw.asgi`` imports it); an app that replaces
    ``app.openapi`` with its own function calls this afterwards. `guard`: the guard of a
    middleware that wraps `app`. Returns `app`."""
    if guard is not None and guard not in _GUARDS.setdefault(app, []):
        _GUARDS[app].append(guard)
    own = vars(app).get("openapi")
    if own is not None and not getattr(own, "_ratelimit_mw", False):
        def openapi() -> dict[str, Any]:
            return _documented(app, own)

        openapi._ratelimit_mw = True  # type: ignore[attr-defined]
        app.openapi = openapi
    return app


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
