"""Rate limiting for any WSGI application, on a sync `Limiter`.

    from ratelimit_mw import Limiter, RedisBackend
    from ratelimit_mw.wsgi import RateLimitMiddleware

    limiter = Limiter(RedisBackend.from_url("redis://localhost:6379/0"))
    app = RateLimitMiddleware(app, limiter, default="100/minute")

Everything that does not depend on the WSGI protocol (which policies apply, key functions,
headers, bodies, the failure policy and its cool-down) lives in `ratelimit_mw._http` and is
shared with the ASGI middleware; this module only adapts it to ``environ`` and
``start_response``. `SyncGate`, the part that calls the limiter, is shared with the Flask
extension.

A plain WSGI app has no router the middleware could ask, so only ``default`` and ``rules``
apply here; route decorators and route templates need the Flask extension
(`ratelimit_mw.flask.RateLimit`), which sees Flask's routing.

A WSGI server cannot interrupt a blocking call, so an outage is bounded by the Redis client's
own timeouts (~100 ms with ``RedisBackend.from_url``) and, after a failure, by the cool-down:
for ``backend_cooldown`` seconds the backend is skipped and ``on_backend_error`` applies at
once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeAlias

from ratelimit_mw._errors import BackendError, ConfigurationError
from ratelimit_mw._http import (
    ErrorPolicy,
    MiddlewareCore,
    Rule,
    Selection,
    validate_on_blocked,
)
from ratelimit_mw.core import Check
from ratelimit_mw.decision import Decision
from ratelimit_mw.headers import too_many_requests_body, unavailable_body
from ratelimit_mw.keys import ROUTE_SCOPE_KEY
from ratelimit_mw.limiter import AsyncLimiter, Limiter
from ratelimit_mw.policy import Policy
from ratelimit_mw.routing import KeyFunc

try:
    from werkzeug.wrappers import Request
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "ratelimit_mw.wsgi hands key functions a werkzeug Request: pip install "
        "'ratelimit_mw[flask]' (or werkzeug)"
    ) from exc

__all__ = [
    "DECISION_KEY",
    "ROUTE_SCOPE_KEY",
    "RateLimitMiddleware",
    "Rule",
]

#: Where the middleware leaves the `Decision` for the app: ``environ[DECISION_KEY]``.
DECISION_KEY = "ratelimit_mw.decision"

ExcInfo: TypeAlias = (
    tuple[type[BaseException], BaseException, TracebackType] | tuple[None, None, None] | None
)
StartResponse: TypeAlias = Callable[..., Callable[[bytes], object]]
WSGIApp: TypeAlias = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]
Headers: TypeAlias = list[tuple[str, str]]

# What SyncGate.consult says about a request.
ADMIT = 0
REFUSE = 1
UNAVAILABLE = 2

_COOLING_DOWN = "the rate-limit backend failed recently; skipping it during the cool-down"
_JSON = ("Content-Type", "application/json")
_NO_STORE = ("Cache-Control", "no-store")


def require_sync_limiter(limiter: object, where: str) -> Limiter:
    if not isinstance(limiter, Limiter):
        hint = (
            "an AsyncLimiter belongs to the ASGI middleware (ratelimit_mw.asgi)"
            if isinstance(limiter, AsyncLimiter)
            else "build one with Limiter(RedisBackend.from_url(url)) or Limiter() for memory"
        )
        raise ConfigurationError(f"{where} needs a sync Limiter, got {limiter!r}; {hint}")
    return limiter


class SyncGate:
    """One sync limiter call per request under the failure policy: the WSGI and Flask half.

    `consult` runs the key functions, skips the backend while the breaker is open, turns any
    exception from the call into ``on_backend_error`` and reports refusals; it never raises.
    """

    __slots__ = ("_cooling", "core", "limiter")

    def __init__(self, core: MiddlewareCore, limiter: Limiter) -> None:
        self.core = core
        self.limiter = limiter
        # Handed to on_backend_error callables for requests skipped during the cool-down.
        self._cooling = BackendError(_COOLING_DOWN)

    def consult(self, selection: Selection,
                request: Any) -> tuple[int, Decision | None, list[Check]]:
        """(ADMIT | REFUSE | UNAVAILABLE, the decision if the backend gave one, the checks)."""
        core = self.core
        checks = core.checks(selection, request)
        if not checks:
            return ADMIT, None, checks
        if core.breaker.is_open():
            return self._failed(request, self._cooling), None, checks
        try:
            decision = self.limiter.check(checks)
        except Exception as exc:  # anything from the backend call: never a 500
            core.breaker.trip()
            core.log_failure("ratelimit_mw backend call failed; applying on_backend_error", exc)
            return self._failed(request, exc), None, checks
        if decision.allowed:
            return ADMIT, decision, checks
        core.notify_refusal(request, decision)
        return (ADMIT if core.shadow else REFUSE), decision, checks

    def _failed(self, request: Any, exc: BaseException) -> int:
        return ADMIT if self.core.admit_on_error(request, exc) else UNAVAILABLE

    def refund(self, checks: Sequence[Check]) -> None:
        """Give back an admitted hit (count_when); a failure is logged, never raised.

        Not while the breaker is open: a sync worker would wait out a timeout for a backend
        known to be down. The hit then stays counted.
        """
        core = self.core
        if core.breaker.is_open():
            core.log_failure("ratelimit_mw: backend cooling down; a hit count_when would have "
                             "given back stays counted", self._cooling)
            return
        try:
            self.limiter.uncheck(checks)
        except Exception as exc:
            core.breaker.trip()
            core.log_failure("ratelimit_mw: could not give back a hit (count_when); it stays "
                             "counted", exc)

    def served_headers(self, decision: Decision, selection: Selection) -> Headers:
        """The headers for a response the app serves (admitted, or refused in shadow mode)."""
        headers = self.core.response_headers(decision, selection)
        if not decision.allowed:
            # A shadow refusal was served: Retry-After would tell the client to back off from
            # a response it just got.
            headers = [item for item in headers if item[0] != "Retry-After"]
        return headers

    def refusal_headers(self, decision: Decision, selection: Selection) -> Headers:
        """What every 429 carries: Retry-After, RateLimit, RateLimit-Policy, no caching."""
        return [_NO_STORE, *self.core.response_headers(decision, selection)]

    def unavailable_headers(self) -> Headers:
        return [_NO_STORE, ("Retry-After", str(self.core.cooldown_seconds()))]


def _status_code(status: str) -> int:
    try:
        return int(status[:3])
    except (TypeError, ValueError):
        return 500


def _missing(present: Iterable[tuple[str, str]], extra: Headers) -> Headers:
    names = {name.lower() for name, _ in present}
    return [item for item in extra if item[0].lower() not in names]


class _DeferredRequest(Request):
    """The werkzeug ``Request`` the middleware hands key functions and hooks, parsed on first use.

    Most key functions read only ``environ`` (``keys.client_ip()`` does), and parsing the rest
    (server, path, query string, the headers view) would cost about as much as the key
    function itself on every request. The attributes werkzeug's ``Request.__init__`` sets are
    filled in when one of them is first read; apart from when that work happens, this is a
    ``Request`` like any other.
    """

    def __init__(self, environ: dict[str, Any]) -> None:  # parsing waits for _Parsed
        self.environ = environ
        # What Request(environ) does at once: werkzeug helpers find the request here.
        environ["werkzeug.request"] = self

    def _parse(self) -> None:
        own = dict(self.__dict__)  # whatever the app set on the request before it was parsed
        Request.__init__(self, own["environ"], populate_request=False)
        self.__dict__.update(own)


class _Parsed:
    """One attribute of `_DeferredRequest`: reading it parses the request.

    A non-data descriptor, so that once parsing has put the value in the instance's
    ``__dict__`` reads no longer come here. Not ``__getattr__``: that would turn every
    ``hasattr`` miss (keys.py's ASGI-or-WSGI test) into a raised exception.
    """

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, request: _DeferredRequest | None, owner: type | None = None) -> Any:
        if request is None:
            return self
        request._parse()
        return request.__dict__[self.name]


# What Request.__init__ sets on the instance (environ is there from the start).
for _name in set(vars(Request({}, populate_request=False))) - {"environ"}:
    setattr(_DeferredRequest, _name, _Parsed(_name))
del _name


class _Refunding:
    """The app's body iterable; when the server closes it, refund if the status says so.

    The refund waits for close() rather than start_response so that the last status wins (an
    app may call start_response again with exc_info) and so that its round trip happens after
    the response has gone out, not before the first byte.
    """

    __slots__ = ("_checks", "_gate", "_iterable", "_status")

    def __init__(self, iterable: Iterable[bytes], status: list[str], gate: SyncGate,
                 checks: list[Check]) -> None:
        self._iterable = iterable
        self._status = status
        self._gate = gate
        self._checks = checks

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._iterable)

    def close(self) -> None:
        try:
            close = getattr(self._iterable, "close", None)
            if close is not None:
                close()
        finally:
            status = self._status[-1] if self._status else "500"
            if self._gate.core.should_refund(_status_code(status)):
                self._gate.refund(self._checks)


class RateLimitMiddleware:
    """Rate-limit a WSGI application.

    - ``limiter``: a sync `Limiter` (memory or Redis).
    - ``default``: a policy or rate string (or a list of them) for every request.
    - ``rules``: ``[Rule("/login", "5/minute", methods=["POST"]), ...]`` or
      ``{"/api/*": "100/minute"}``; they add to the default.
    - ``key``: the key function, default ``keys.client_ip()``; it receives a
      ``werkzeug.wrappers.Request``.
    - ``on_backend_error``: ``"allow"`` (admit, log at most once per interval), ``"deny"``
      (503 with Retry-After) or a callable ``(request, error) -> bool`` (True admits).
    - ``headers`` / ``legacy_headers``: RateLimit / X-RateLimit-* on admitted responses.
    - ``mode``: ``"enforce"`` or ``"shadow"`` (count and send headers, never refuse).
    - ``on_blocked``: ``(request, decision) -> WSGI app`` (a werkzeug ``Response`` is one) to
      answer refused requests instead of the JSON 429; the rate-limit headers are added to
      it unless it sets them.
    - ``on_refusal``: ``(request, decision) -> None``, called for every refusal (shadow too).
    - ``count_when``: ``(status) -> bool``; a hit is recorded before the app runs and given
      back after the response if this says the status should not count.
    - ``backend_cooldown``: seconds to skip the backend after a failure.

    The decision is left in ``environ["ratelimit_mw.decision"]`` (`DECISION_KEY`).
    """

    def __init__(
        self,
        app: WSGIApp,
        limiter: Limiter,
        *,
        default: Policy | str | Sequence[Policy | str] | None = None,
        rules: Sequence[Rule] | Mapping[str, Policy | str] | None = None,
        key: KeyFunc | None = None,
        on_backend_error: ErrorPolicy = "allow",
        headers: bool = True,
        legacy_headers: bool = False,
        mode: str = "enforce",
        on_blocked: Callable[[Any, Decision], WSGIApp] | None = None,
        on_refusal: Callable[[Any, Decision], None] | None = None,
        count_when: Callable[[int], bool] | None = None,
        backend_cooldown: float = 1.0,
    ) -> None:
        if not callable(app):
            raise ConfigurationError(
                f"RateLimitMiddleware wraps a WSGI application, got {app!r}; e.g. "
                "app.wsgi_app = RateLimitMiddleware(app.wsgi_app, limiter)"
            )
        validate_on_blocked(
            on_blocked, "lambda request, decision: Response('slow down', status=429)"
        )
        self.app = app
        self.core = MiddlewareCore(
            default=default, rules=rules, key=key, on_backend_error=on_backend_error,
            headers=headers, legacy_headers=legacy_headers, mode=mode, on_refusal=on_refusal,
            count_when=count_when, backend_cooldown=backend_cooldown,
        )
        self.gate = SyncGate(self.core, require_sync_limiter(limiter, "RateLimitMiddleware"))
        self.on_blocked = on_blocked
        # Without path rules the same policies (the defaults) apply to every request: select
        # them once instead of decoding the path and looking them up per request.
        self._per_path = bool(self.core.rules)
        self._fixed = None if self._per_path else self.core.select("GET", "/", None)

    def __repr__(self) -> str:
        return f"RateLimitMiddleware({self.app!r}, {self.gate.limiter!r})"

    def __call__(self, environ: dict[str, Any],
                 start_response: StartResponse) -> Iterable[bytes]:
        core = self.core
        # Always present for the app: None unless the limiter decided.
        environ[DECISION_KEY] = None
        selection = self._select(environ) if self._per_path else self._fixed
        if selection is None:
            return self.app(environ, start_response)
        request = _DeferredRequest(environ)
        verdict, decision, checks = self.gate.consult(selection, request)
        environ[DECISION_KEY] = decision
        if decision is None:
            if verdict == UNAVAILABLE:
                return self._unavailable(start_response)
            return self.app(environ, start_response)
        if verdict == REFUSE:
            return self._refuse(request, decision, selection, start_response)
        refund = core.count_when is not None and decision.allowed
        if not core.headers:
            if not refund:
                return self.app(environ, start_response)
            return self._serve_refunding(environ, start_response, None, checks)
        extra = self.gate.served_headers(decision, selection)
        if refund:
            return self._serve_refunding(environ, start_response, extra, checks)

        def start(status_line: str, headers: Headers, exc_info: ExcInfo = None) -> Any:
            # A new list: the app may reuse its own header list for every response.
            return start_response(status_line, headers + extra, exc_info)

        return self.app(environ, start)

    def _select(self, environ: dict[str, Any]) -> Selection | None:
        path: str = environ.get("PATH_INFO") or "/"
        if not path.isascii():
            # PEP 3333 hands over the raw bytes as latin-1; rules are written in Unicode.
            path = path.encode("latin-1", "replace").decode("utf-8", "replace")
        return self.core.select(environ.get("REQUEST_METHOD", "GET"), path, None)

    def _serve_refunding(self, environ: dict[str, Any], start_response: StartResponse,
                         extra: Headers | None, checks: list[Check]) -> Iterable[bytes]:
        """Serve an admitted request whose hit count_when may give back after the response."""
        status: list[str] = []

        def start(status_line: str, headers: Headers, exc_info: ExcInfo = None) -> Any:
            status.append(status_line)
            if extra:
                # A new list: the app may reuse its own header list for every response.
                headers = headers + extra
            return start_response(status_line, headers, exc_info)

        try:
            body = self.app(environ, start)
        except BaseException:
            # The app raised before answering: the server's answer will be a 500.
            if self.core.should_refund(500):
                self.gate.refund(checks)
            raise
        return _Refunding(body, status, self.gate, checks)

    def _refuse(self, request: Any, decision: Decision, selection: Selection,
                start_response: StartResponse) -> Iterable[bytes]:
        headers = self.gate.refusal_headers(decision, selection)
        if self.on_blocked is not None:
            try:
                response = self.on_blocked(request, decision)
                if not callable(response):
                    raise TypeError(f"on_blocked returned {response!r}, not a WSGI app")
            except Exception as exc:
                self.core.log_failure("ratelimit_mw on_blocked failed; answering the JSON 429",
                                      exc)
            else:
                def start(status_line: str, app_headers: Headers,
                          exc_info: ExcInfo = None) -> Any:
                    return start_response(status_line,
                                          app_headers + _missing(app_headers, headers), exc_info)

                return response(request.environ, start)
        body = too_many_requests_body(decision)
        start_response("429 Too Many Requests",
                       [_JSON, ("Content-Length", str(len(body))), *headers])
        return [body]

    def _unavailable(self, start_response: StartResponse) -> Iterable[bytes]:
        body = unavailable_body(self.core.cooldown_seconds())
        start_response("503 Service Unavailable",
                       [_JSON, ("Content-Length", str(len(body))),
                        *self.gate.unavailable_headers()])
        return [body]

