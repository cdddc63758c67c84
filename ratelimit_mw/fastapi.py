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
from collections.abc import Callable
from typing import Any, TypedDict

from ratelimit_mw.asgi import RouteResolver, is_preflight, route_path
from ratelimit_mw.core.decision import Decision
from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.core.policy import Policy
from ratelimit_mw.http.asgi_routes import needs_route
from ratelimit_mw.http.config import Config, ErrorPolicy, build_config
from ratelimit_mw.http.extras import require
from ratelimit_mw.http.guard import Guard
from ratelimit_mw.http.selection import Applied, Selection
from ratelimit_mw.http.verdict import Admit, Refuse
from ratelimit_mw.keys import ASGI, ROUTE_SCOPE_KEY, KeyFunc
from ratelimit_mw.limiter import AsyncLimiter, require_async_limiter
from ratelimit_mw.routing import Cost, Predicate, stable_module, validate_cost

if sys.version_info >= (3, 11):  # read at run time: this module's annotations are evaluated
    from typing import Unpack
else:  # pragma: no cover - Python 3.10 (FastAPI depends on typing_extensions)
    from typing_extensions import Unpack

require("fastapi", "fastapi", "ratelimit_mw.fastapi")
from fastapi import HTTPException, Request, Response  # noqa: E402

from ratelimit_mw._async.handler import handler_async  # noqa: E402
from ratelimit_mw.http.headers import TOO_MANY_REQUESTS  # noqa: E402
from ratelimit_mw.http.openapi import document_rate_limits  # noqa: E402

__all__ = ["TOO_MANY_REQUESTS", "Config", "RateLimitDependency", "RateLimitHTTPException",
           "document_rate_limits", "rate_limit_exception_handler"]

# Options a dependency could only ignore (a user who sets one expects it to act): the
# Config fields that say so, and what to write instead.
_MIDDLEWARE_ONLY = {
    ("count_when", "rule_list", "defaults"):
        "RateLimitDependency takes its limit as `rates`; count_when, rules and default "
        "belong to the middleware (ratelimit_mw.asgi.RateLimitMiddleware)",
    ("in_flight",):
        "concurrency belongs to the middleware: an in-flight slot is given back when the "
        "response has been sent, which a dependency does not see; write "
        "@limiter.limit(..., concurrency=N) on the endpoint, or Rule(path, concurrency=N)",
    ("on_blocked",):
        "on_blocked belongs to the middleware: a dependency answers a refusal by raising "
        "RateLimitHTTPException; shape that answer with an exception handler instead, "
        "app.add_exception_handler(RateLimitHTTPException, your_handler) (the exception "
        "carries .decision, .headers and .body)",
    ("per_method",):
        "per_method applies to the middleware's default limit; a dependency counts for "
        "the endpoints it sits on: put it on the one method's route, or give each method "
        "its own RateLimitDependency (name= to choose which share a quota)",
    ("charge_method_not_allowed",):
        "charge_method_not_allowed applies to the middleware: FastAPI answers 405 before "
        "any dependency runs, so a dependency never sees one; drop the option, or set it "
        "on RateLimitMiddleware",
}


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

    # http.openapi.DEPENDENCY_MARK: the schema documents the 429 of operations that use one.
    __ratelimit_mw_dependency__ = True

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
            probe: Policy = rates
        elif isinstance(rates, str):
            probe = Policy(rates, name=name)  # a typo fails here, at import time
        else:
            raise ConfigurationError(
                f'RateLimitDependency takes a rate string such as "5/minute" or a Policy, '
                f"got {rates!r}"
            )
        shared = probe if isinstance(rates, Policy) or name is not None else None
        self.rates = rates
        self.cost = validate_cost(cost, probe)
        self.config = build_config(config, options)
        for fields, message in _MIDDLEWARE_ONLY.items():
            if any(getattr(self.config, field) not in (None, False, ()) for field in fields):
                raise ConfigurationError(message)
        self.key = key or self.config.key_func
        self.guard = Guard(self.config, self.limiter, timeout=self.config.backend_timeout,
                           requests=ASGI)
        self._shared = None if shared is None else self._selection_of(shared, shared.name)
        if shared is not None:  # one quota under a name: it may meet the limiter's others
            self.limiter.shared_logs.add((shared,))
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
        if not self.guard.enabled:
            request.state.ratelimit = None
            return None
        method: str = scope["method"]
        if self._resolver is not None and ROUTE_SCOPE_KEY not in scope:
            # The middleware leaves the template when it runs; without it, resolve it here,
            # relative to the app that routed the request.
            self._resolver.resolve(scope, scope.get("app"), method, route_path(scope))
        handle = handler_async(self.guard, self.limiter, self._selection(scope.get("endpoint")))
        verdict = await handle(request, method, method == "OPTIONS" and is_preflight(scope))
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
