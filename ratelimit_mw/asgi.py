"""Rate limiting for ASGI apps (Starlette, FastAPI, any ASGI app): ``RateLimitMiddleware``.

    from ratelimit_mw import AsyncLimiter, AsyncRedisBackend, keys
    from ratelimit_mw.asgi import RateLimitMiddleware, Rule

    limiter = AsyncLimiter(AsyncRedisBackend.from_url("redis://localhost:6379/0"))
    app.add_middleware(RateLimitMiddleware, limiter=limiter, default="100/minute",
                       rules=[Rule("/login", "5/minute", methods=["POST"])])

Pure ASGI (no ``BaseHTTPMiddleware``): websocket and lifespan scopes pass through untouched,
and the rate-limit headers are added by wrapping ``send``. Everything that does not depend on
the request is decided in ``__init__`` (``MiddlewareCore``); a request costs one route lookup
(cached), its key functions, and one backend call bounded by ``backend_timeout``.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import sys
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from typing import Any, TypeAlias

from starlette.requests import Request

from ratelimit_mw._asgi_routes import RouteResolver, needs_route, route_path, routes_of
from ratelimit_mw._errors import BackendError, ConfigurationError
from ratelimit_mw._http import (
    ErrorPolicy,
    MiddlewareCore,
    Rule,
    Selection,
    validate_on_blocked,
)
from ratelimit_mw.backends.memory import MemoryBackend
from ratelimit_mw.core import Check
from ratelimit_mw.decision import Decision
from ratelimit_mw.headers import too_many_requests_body, unavailable_body
from ratelimit_mw.keys import ROUTE_SCOPE_KEY
from ratelimit_mw.limiter import AsyncLimiter, Limiter
from ratelimit_mw.policy import Policy
from ratelimit_mw.routing import KeyFunc

__all__ = ["RateLimitMiddleware", "Rule"]

Scope: TypeAlias = MutableMapping[str, Any]
Message: TypeAlias = MutableMapping[str, Any]
Receive: TypeAlias = Callable[[], Awaitable[Message]]
Send: TypeAlias = Callable[[Message], Awaitable[None]]
ASGIApp: TypeAlias = Callable[[Scope, Receive, Send], Awaitable[None]]
RawHeaders: TypeAlias = list[tuple[bytes, bytes]]
BlockedHandler: TypeAlias = Callable[[Request, Decision], "ASGIApp | Awaitable[ASGIApp]"]

_JSON_NO_STORE: RawHeaders = [
    (b"content-type", b"application/json"),
    (b"cache-control", b"no-store"),
]

if sys.version_info >= (3, 11):

    async def _bounded(awaitable: Awaitable[Any], seconds: float) -> Any:
        async with asyncio.timeout(seconds):
            return await awaitable

else:  # pragma: no cover - exercised on Python 3.10 only

    async def _bounded(awaitable: Awaitable[Any], seconds: float) -> Any:
        return await asyncio.wait_for(awaitable, seconds)


def _encode(pairs: Sequence[tuple[str, str]], *, drop_retry_after: bool = False) -> RawHeaders:
    return [
        (name.lower().encode("latin-1"), value.encode("latin-1"))
        for name, value in pairs
        if not (drop_retry_after and name == "Retry-After")
    ]


def _validate_timeout(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigurationError(f"{name} must be a number of seconds > 0, e.g. {name}=0.1; "
                                 f"got {value!r}")
    return float(value)


class Fallback(enum.Enum):
    """What to do when the backend could not decide."""

    ADMIT = "admit"
    DENY = "deny"


class Gate:
    """One backend call under a deadline, the breaker, and the failure policy.

    Shared by the middleware and the FastAPI dependency so both fail the same way: whatever
    the backend raises (BackendError, TimeoutError, OSError, anything) trips the breaker and
    becomes ``on_backend_error``; while the breaker is open the backend is not called at all.
    """

    __slots__ = ("_cooling", "core", "limiter", "timeout")

    def __init__(self, core: MiddlewareCore, limiter: AsyncLimiter, timeout: float) -> None:
        self.core = core
        self.limiter = limiter
        # The memory backend answers without ever yielding to the loop: a deadline could not
        # interrupt it and would only cost a timer per request.
        self.timeout = None if isinstance(limiter.backend, MemoryBackend) else timeout
        # Passed to an on_backend_error callable while the breaker is open. Never raised.
        self._cooling = BackendError(
            "the rate-limit backend failed recently; not calling it during the cool-down"
        )

    async def check(self, checks: Sequence[Check], request: Any) -> Decision | Fallback:
        core = self.core
        if core.breaker.is_open():
            error: BaseException = self._cooling
        else:
            try:
                if self.timeout is None:
                    return await self.limiter.check(checks)
                decision: Decision = await _bounded(self.limiter.check(checks), self.timeout)
                return decision
            except Exception as exc:  # "never a 500" covers whatever a backend raises
                core.breaker.trip()
                core.log_failure(
                    "ratelimit_mw: the rate-limit backend failed; applying on_backend_error", exc
                )
                error = exc
        return Fallback.ADMIT if core.admit_on_error(request, error) else Fallback.DENY

    async def uncheck(self, checks: Sequence[Check]) -> None:
        """Give back an admitted hit (count_when); a failure is logged, never raised."""
        core = self.core
        if core.breaker.is_open():
            core.log_failure("ratelimit_mw: backend cooling down; a hit count_when would have "
                             "given back stays counted", self._cooling)
            return
        try:
            if self.timeout is None:
                await self.limiter.uncheck(checks)
            else:
                await _bounded(self.limiter.uncheck(checks), self.timeout)
        except Exception as exc:
            core.breaker.trip()
            core.log_failure("ratelimit_mw: could not give back a hit (count_when); it stays "
                             "counted", exc)


def require_async_limiter(limiter: object) -> AsyncLimiter:
    if isinstance(limiter, AsyncLimiter):
        return limiter
    hint = ("a sync Limiter would block the event loop; " if isinstance(limiter, Limiter)
            else "")
    raise ConfigurationError(
        f"the ASGI middleware needs an AsyncLimiter, got {limiter!r}; {hint}write "
        "limiter=AsyncLimiter(AsyncRedisBackend.from_url(\"redis://localhost:6379/0\")) "
        "or AsyncLimiter() for the in-process memory backend"
    )


class RateLimitMiddleware:
    """Rate-limit every HTTP request of an ASGI app.

    - ``limiter``: an ``AsyncLimiter``.
    - ``default``: policy (or rate string, or several) for requests whose route carries no
      decorator; ``None`` limits only decorated routes and rules.
    - ``rules``: ``[Rule("/login", "5/minute", methods=["POST"])]`` or ``{"/api/*": "..."}``;
      they apply to every matching request, decorated or not.
    - ``key``: key function, default ``keys.client_ip()``.
    - ``on_backend_error``: ``"allow"`` (admit, log), ``"deny"`` (503) or a callable
      ``(request, error) -> bool`` (True admits).
    - ``headers``: ``RateLimit``/``RateLimit-Policy`` on admitted responses (429s always
      carry them); ``legacy_headers`` adds ``X-RateLimit-Limit/Remaining/Reset``.
    - ``mode``: ``"enforce"`` or ``"shadow"`` (count and report, never refuse).
    - ``on_blocked``: ``(request, decision) -> ASGI app`` (e.g. a Starlette ``Response``, or
      an awaitable of one) sent instead of the default 429, as it is.
    - ``on_refusal``: ``(request, decision) -> None``, told of every refusal, shadow or real.
    - ``count_when``: ``(status) -> bool``; a response for which it is False gives its hit
      back (recorded before the app runs, refunded after).
    - ``backend_timeout``: deadline of every backend call (seconds); ``backend_cooldown``:
      how long to skip the backend after a failure.

    The decision is left in ``scope["state"]["ratelimit"]`` (``request.state.ratelimit``):
    a ``Decision``, or ``None`` when no policy applied or the backend failed and the request
    was admitted.
    """

    def __init__(
        self,
        app: ASGIApp,
        limiter: AsyncLimiter,
        *,
        default: Policy | str | Sequence[Policy | str] | None = None,
        rules: Sequence[Rule] | Mapping[str, Policy | str] | None = None,
        key: KeyFunc | None = None,
        on_backend_error: ErrorPolicy = "allow",
        headers: bool = True,
        legacy_headers: bool = False,
        mode: str = "enforce",
        on_blocked: BlockedHandler | None = None,
        on_refusal: Callable[[Request, Decision], None] | None = None,
        count_when: Callable[[int], bool] | None = None,
        backend_timeout: float = 0.1,
        backend_cooldown: float = 1.0,
    ) -> None:
        self.app = app
        self.limiter = require_async_limiter(limiter)
        self.core = MiddlewareCore(
            default=default,
            rules=rules,
            key=key,
            on_backend_error=on_backend_error,
            headers=headers,
            legacy_headers=legacy_headers,
            mode=mode,
            on_refusal=on_refusal,
            count_when=count_when,
            backend_cooldown=backend_cooldown,
        )
        self.on_blocked = validate_on_blocked(
            on_blocked, "lambda request, decision: PlainTextResponse('slow down', status_code=429)"
        )
        self._gate = Gate(self.core, self.limiter,
                          _validate_timeout("backend_timeout", backend_timeout))
        # Route resolution: keyed on the app this middleware wraps when its route tree can be
        # reached from here (through .app of the middleware below it); otherwise on
        # scope["app"], which Starlette sets before running its middleware stack.
        self._root: object = app if routes_of(app) is not None else None
        keys_in_use = [self.core.key, *(rule.key for rule in self.core.rules)]
        self._resolver = RouteResolver(always=any(needs_route(k) for k in keys_in_use))
        self._policy_bytes: dict[int, tuple[Selection, bytes]] = {}
        retry = self.core.cooldown_seconds()
        body = unavailable_body(retry)
        self._unavailable_headers: RawHeaders = [
            *_JSON_NO_STORE,
            (b"retry-after", str(retry).encode()),
            (b"content-length", str(len(body)).encode()),
        ]
        self._unavailable_body = body

    def __repr__(self) -> str:
        return f"RateLimitMiddleware({self.app!r}, {self.limiter!r})"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        core = self.core
        method: str = scope["method"]
        path = route_path(scope)
        meta = None
        root = self._root if self._root is not None else scope.get("app")
        resolved = self._resolver.resolve(scope, root, method, path)
        if resolved is not None:
            template, meta = resolved
            if template is not None:
                scope[ROUTE_SCOPE_KEY] = template
        # request.state.ratelimit always exists for the app: None until a decision is made.
        state = scope.get("state")
        if state is None:
            state = scope["state"] = {}
        state["ratelimit"] = None
        selection = core.select(method, path, meta)
        if selection is None:
            await self.app(scope, receive, send)
            return
        # One Request for every key function, hook and handler of this request.
        request = Request(scope)
        checks = core.checks(selection, request)
        if not checks:
            await self.app(scope, receive, send)
            return
        outcome = await self._gate.check(checks, request)
        if outcome is Fallback.ADMIT:
            await self.app(scope, receive, send)
            return
        if outcome is Fallback.DENY:
            await self._unavailable(send)
            return
        decision = outcome
        state["ratelimit"] = decision
        if not decision.allowed:
            core.notify_refusal(request, decision)
            if not core.shadow:
                await self._refuse(request, decision, selection, scope, receive, send)
                return
        extra = self._headers_for(decision, selection) if core.headers else None
        if core.count_when is not None and decision.allowed:
            await self._call_counting(scope, receive, send, extra, checks)
        elif extra is not None:
            await self.app(scope, receive, _with_headers(send, extra))
        else:
            await self.app(scope, receive, send)

    # -- responses ---------------------------------------------------------------------------
    def _headers_for(self, decision: Decision, selection: Selection) -> RawHeaders:
        """Headers for a response the app sends (admitted, or refused in shadow mode)."""
        if self.core.legacy_headers or not decision.allowed:
            # A shadow refusal was served: Retry-After would tell the client to back off
            # from a response it just got.
            return _encode(self.core.response_headers(decision, selection),
                           drop_retry_after=True)
        cached = self._policy_bytes.get(id(selection))
        if cached is None or cached[0] is not selection:
            # Selections live as long as the app (MiddlewareCore caches them), so this stays
            # as small as the set of route/rule combinations.
            cached = (selection, selection.policy_header.value.encode("latin-1"))
            self._policy_bytes[id(selection)] = cached
        header = selection.policy_header
        return [
            (b"ratelimit-policy", cached[1]),
            (b"ratelimit", header.ratelimit(decision).encode("latin-1")),
        ]

    async def _refuse(self, request: Request, decision: Decision, selection: Selection,
                      scope: Scope, receive: Receive, send: Send) -> None:
        if self.on_blocked is not None:
            try:
                response: Any = self.on_blocked(request, decision)
                if inspect.isawaitable(response):
                    response = await response
                if not callable(response):
                    raise TypeError(f"on_blocked returned {response!r}, not an ASGI app")
            except Exception as exc:
                self.core.log_failure("ratelimit_mw on_blocked failed; answering the default "
                                      "429", exc)
            else:
                # A 429 always carries Retry-After and the RateLimit fields: the user's response
                # gets those it does not set itself.
                required = [
                    (b"cache-control", b"no-store"),
                    *_encode(self.core.response_headers(decision, selection)),
                ]
                await response(scope, receive, _with_missing_headers(send, required))
                return
        body = too_many_requests_body(decision)
        headers = [
            *_JSON_NO_STORE,
            (b"content-length", str(len(body)).encode()),
            *_encode(self.core.response_headers(decision, selection)),
        ]
        await send({"type": "http.response.start", "status": 429, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _unavailable(self, send: Send) -> None:
        # A fresh list each time: middleware further out may append to it in place.
        await send({"type": "http.response.start", "status": 503,
                    "headers": list(self._unavailable_headers)})
        await send({"type": "http.response.body", "body": self._unavailable_body})

    async def _call_counting(self, scope: Scope, receive: Receive, send: Send,
                             extra: RawHeaders | None, checks: list[Check]) -> None:
        """Run the app, then give the hit back if count_when says this response does not count."""
        status = 500  # an exception before the response starts will be a server error

        async def send_and_watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if extra is not None:
                    message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        except Exception:
            if self.core.should_refund(status):
                await self._gate.uncheck(checks)
            raise
        if self.core.should_refund(status):
            await self._gate.uncheck(checks)


def _with_missing_headers(send: Send, required: RawHeaders) -> Send:
    async def send_completing_headers(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", ()))
            present = {name.lower() for name, _ in headers}
            headers += [(name, value) for name, value in required if name not in present]
            message = {**message, "headers": headers}
        await send(message)

    return send_completing_headers


def _with_headers(send: Send, extra: RawHeaders) -> Send:
    async def send_with_headers(message: Message) -> None:
        if message["type"] == "http.response.start":
            # A new message and list: a Response's own header list must not grow.
            message = {**message, "headers": [*message.get("headers", ()), *extra]}
        await send(message)

    return send_with_headers
