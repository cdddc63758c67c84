"""Rate limiting for any WSGI application, on a sync `Limiter`.

    from ratelimit_mw import Limiter, RedisBackend
    from ratelimit_mw.wsgi import Config, RateLimitMiddleware

    limiter = Limiter(RedisBackend.from_url("redis://localhost:6379/0"))
    app = RateLimitMiddleware(app, limiter, config=Config(default="100/minute"))

What to do with a request is decided by the shared guard (`ratelimit_mw.http.guard`: the
request's selection, the one backend call, the verdict); this module reads ``environ``, asks
the guard for the verdict, answers through ``start_response`` and, when the server closes the
body, gives back what the final status gives back and the in-flight slots the request held.
It also holds what the Flask extension and the Django middleware share with it: the guard a
sync adapter builds (`sync_guard`), a refusal's JSON headers, the headers an app's own 429
lacks, whether a status gives the hit back, a body that renews its slots' lease.

A plain WSGI app has no router the middleware could ask, so only ``default`` and ``rules``
apply here; route decorators and route templates need the Flask extension
(`ratelimit_mw.flask.RateLimit`), which sees Flask's routing.

A WSGI server cannot interrupt a blocking call, so an outage is bounded by the Redis client's
own timeouts (~100 ms with ``RedisBackend.from_url``) and, after a failure, by the breaker:
for ``backend_cooldown`` seconds the backend is skipped and ``on_backend_error`` applies at
once, then one request probes it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from http import HTTPStatus
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeAlias

from ratelimit_mw._sync import slots as slots_sync
from ratelimit_mw._sync.handler import handler_sync
from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.http.config import Config, ConfigOptions, build_config
from ratelimit_mw.http.extras import installed
from ratelimit_mw.http.guard import DECISION_KEY, Guard
from ratelimit_mw.http.headers import Headers
from ratelimit_mw.http.rules import Rule
from ratelimit_mw.http.verdict import Admit, Held, Refuse
from ratelimit_mw.keys import ROUTE_SCOPE_KEY, WSGI
from ratelimit_mw.limiter import Limiter, require_sync_limiter

if TYPE_CHECKING:  # annotations only (strings at run time)
    from typing_extensions import Unpack

# Key functions get werkzeug's Request where werkzeug is installed (what Flask and werkzeug
# users read); without it the middleware needs nothing but the standard library.
if installed("werkzeug"):
    from ratelimit_mw.http.werkzeug_request import DeferredRequest as _Request
else:
    from ratelimit_mw.http.environ_request import EnvironRequest as _Request  # type: ignore[assignment]

__all__ = [
    "DECISION_KEY",
    "ROUTE_SCOPE_KEY",
    "Config",
    "RateLimitMiddleware",
    "Rule",
]

ExcInfo: TypeAlias = (
    tuple[type[BaseException], BaseException, TracebackType] | tuple[None, None, None] | None
)
StartResponse: TypeAlias = Callable[..., Callable[[bytes], object]]
WSGIApp: TypeAlias = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]

#: The environ key of a CORS preflight's Access-Control-Request-Method.
PREFLIGHT = "HTTP_ACCESS_CONTROL_REQUEST_METHOD"


def sync_guard(config: Config, limiter: Limiter, adapter: str) -> Guard:
    """The guard of a WSGI adapter: no deadline it could enforce, no async hook it could
    await (`adapter` names it in the ConfigurationError)."""
    return Guard(config, limiter, timeout=None, awaits=adapter, requests=WSGI)


def json_headers(headers: Headers) -> Headers:
    """A default 429 or 503's headers: JSON, and the verdict's own (no second Content-Type)."""
    return [("Content-Type", "application/json"),
            *(item for item in headers if item[0] != "Content-Type")]


def missing(present: Iterable[tuple[str, str]], extra: Headers) -> Headers:
    """The `extra` headers that `present` does not set: what the app's own rendering of a
    refusal lacks of those every 429 carries."""
    names = {name.lower() for name, _ in present}
    return [item for item in extra if item[0].lower() not in names]


def renewing(chunks: Iterable[bytes], guard: Guard, limiter: Limiter,
             held: Held) -> Iterator[bytes]:
    """`chunks`, renewing the lease of the slots `held` on a chunk that comes a third of a
    lease after the last renewal (a long stream keeps its slots; a dead worker's end)."""
    try:
        for chunk in chunks:
            if held.due():
                slots_sync.renew_sync(guard, limiter, held)
            yield chunk
    finally:  # closed by the server (Flask's response): the app's iterable is closed too
        close = getattr(chunks, "close", None)
        if close is not None:
            close()


class _Refunding:
    """The app's body iterable; when the server closes it (PEP 3333: also when the client
    went away or the body raised), give back what the status gives back and the in-flight
    slots the request holds (renewed while the body is read), in one call.

    It waits for close(), not start_response, so that the last status wins (an app may call
    start_response again with exc_info) and its round trip comes after the response. A body
    whose response started with a status that gives nothing back (no slots, no count_when,
    not an uncharged 405) is not wrapped.
    """

    __slots__ = ("_admit", "_held", "_iterable", "_middleware", "_status")

    def __init__(self, iterable: Iterable[bytes], status: list[str],
                 middleware: RateLimitMiddleware, admit: Admit) -> None:
        self._iterable = iterable
        self._status = status
        self._middleware = middleware
        self._admit = admit
        plan = admit.plan
        self._held = (None if plan is None or plan.token is None
                      else Held(admit, middleware.limiter.monotonic))

    def __iter__(self) -> Iterator[bytes]:
        held = self._held
        if held is None:
            return iter(self._iterable)
        middleware = self._middleware
        return renewing(self._iterable, middleware.guard, middleware.limiter, held)

    def close(self) -> None:
        try:
            close = getattr(self._iterable, "close", None)
            if close is not None:
                close()
        finally:
            held = self._held
            if held is None or not held.done:
                if held is not None:
                    held.done = True
                self._middleware._refund(self._admit,
                                         self._status[-1] if self._status else "500")


class RateLimitMiddleware:
    """Rate-limit a WSGI application.

    ``RateLimitMiddleware(app, limiter, config=Config(...))`` or the same options as keywords
    (see `ratelimit_mw.http.config.Config`); ``limiter`` is a sync `Limiter`. Key functions
    receive a ``werkzeug.wrappers.Request`` where werkzeug is installed, else an
    `~ratelimit_mw.http.environ_request.EnvironRequest` (the attributes a key reads, spelled
    as werkzeug's). ``on_blocked`` returns a WSGI app (a werkzeug ``Response`` is one); the
    rate-limit headers are added to it unless it sets them.

    The decision is left in ``environ["ratelimit_mw.decision"]`` (`DECISION_KEY`).
    """

    def __init__(self, app: WSGIApp, limiter: Limiter, *, config: Config | None = None,
                 **options: Unpack[ConfigOptions]) -> None:
        if not callable(app):
            raise ConfigurationError(
                f"RateLimitMiddleware wraps a WSGI application, got {app!r}; e.g. "
                "app.wsgi_app = RateLimitMiddleware(app.wsgi_app, limiter)"
            )
        self.app = app
        self.limiter = require_sync_limiter(limiter, "RateLimitMiddleware")
        self.config = build_config(config, options)
        self.guard = sync_guard(self.config, self.limiter, "the WSGI middleware")
        # Without path rules the defaults apply to every request: selected once, not per
        # request (a per-method default depends on the method, which select() caches).
        self._per_path = bool(self.guard.rules)
        self._fixed = None if self._per_path else self.guard.select("GET", "/", None)
        # Its handler, built on the first request and kept (a store, clock or metrics hook
        # replaced under it rebuilds it: its generation).
        self._fixed_handler: Callable[..., Any] | None = None

    def __repr__(self) -> str:
        return f"RateLimitMiddleware({self.app!r}, {self.limiter!r})"

    def __call__(self, environ: dict[str, Any],
                 start_response: StartResponse) -> Iterable[bytes]:
        # Always present for the app: None unless the limiter decided.
        environ[DECISION_KEY] = None
        method: str = environ.get("REQUEST_METHOD", "GET")
        if self._per_path:
            path: str = environ.get("PATH_INFO") or "/"
            if not path.isascii():
                # PEP 3333 hands over the raw bytes as latin-1; rules are written in Unicode.
                path = path.encode("latin-1", "replace").decode("utf-8", "replace")
            selection = self.guard.select(method, path, None)
            handle = (None if selection is None
                      else handler_sync(self.guard, self.limiter, selection))
        else:
            handle = self._fixed_handler
            if handle is None and self._fixed is not None:
                handle = self._fixed_handler = handler_sync(self.guard, self.limiter,
                                                            self._fixed)
        if handle is None:
            return self.app(environ, start_response)
        request = _Request(environ)
        verdict = handle(request, method, method == "OPTIONS" and PREFLIGHT in environ)
        if verdict is None:
            return self.app(environ, start_response)
        if not isinstance(verdict, Admit):
            if isinstance(verdict, Refuse):
                environ[DECISION_KEY] = verdict.decision
                return self._refuse(request, verdict, start_response)
            return _answer(start_response, verdict.status, verdict.headers, verdict.body)
        environ[DECISION_KEY] = verdict.decision
        extra = verdict.headers
        if verdict.plan is None and not extra:
            return self.app(environ, start_response)
        status: list[str] = []
        unwrapped = False  # the body went out as the app made it: no close of ours

        def start(status_line: str, headers: Headers, exc_info: ExcInfo = None) -> Any:
            nonlocal unwrapped
            status.append(status_line)
            if unwrapped and may_give_back(verdict, _code(status_line), self.guard):
                unwrapped = False  # started again with a status that gives back (a 405)
                self._refund(verdict, status_line)
            # A new list: the app may reuse its own header list for every response.
            return start_response(status_line, headers + extra if extra else headers, exc_info)

        if verdict.plan is None:
            return self.app(environ, start)
        try:
            body = self.app(environ, start)
        except BaseException:
            self._refund(verdict, "500")  # the server's answer to what the app raised
            raise
        if status and not may_give_back(verdict, _code(status[-1]), self.guard):
            # Started with a status that gives nothing back (most responses): only a 405
            # it may be started again as would (`start` sees to it).
            unwrapped = True
            return body
        return _Refunding(body, status, self, verdict)

    def _refund(self, admit: Admit, status: str) -> None:
        """Give back what a response with this status line gives back, and its slots."""
        code = _code(status)
        plan = admit.plan
        if plan is not None and plan.token is not None:  # with its in-flight slots
            slots_sync.release_sync(self.guard, self.limiter, admit, code)
        else:
            slots_sync.refund_sync(self.guard, self.limiter, admit,
                                   self.guard.given_back(admit, code))

    def _refuse(self, request: Any, refusal: Refuse,
                start_response: StartResponse) -> Iterable[bytes]:
        on_blocked = self.config.on_blocked
        if on_blocked is not None:
            try:
                response = on_blocked(request, refusal.decision)
                if not callable(response):
                    raise TypeError(f"on_blocked returned {response!r}, not a WSGI app")
            except Exception as exc:
                self.guard.log_failure("ratelimit_mw on_blocked failed; answering the JSON 429",
                                       exc)
            else:
                def start(status_line: str, headers: Headers, exc_info: ExcInfo = None) -> Any:
                    return start_response(status_line,
                                          headers + missing(headers, refusal.headers), exc_info)

                return response(request.environ, start)  # type: ignore[no-any-return]
        return _answer(start_response, refusal.status, refusal.headers, refusal.body)


def may_give_back(admit: Admit, status: int, guard: Guard) -> bool:
    """Whether an admitted response with this status may give anything back (`Guard.released`
    says what): it holds slots, a count_when may say so, or it is a 405 (not charged: else
    the request has nothing to give back). Most give nothing back, and the WSGI middleware
    and the Flask extension then keep nothing for them. (Here rather than on the guard: the
    WSGI middleware asks it without leaving its module.)"""
    plan = admit.plan
    return plan is not None and (plan.token is not None or plan.whens is not None
                                 or guard.count_when is not None or status == 405)


def _code(status: str) -> int:
    """The code of a WSGI status line ("200 OK"); a line without one counts as a 500."""
    try:
        return int(status[:3])
    except (TypeError, ValueError):
        return 500


def _answer(start_response: StartResponse, status: int, headers: Headers,
            body: bytes) -> Iterable[bytes]:
    start_response(f"{status} {HTTPStatus(status).phrase}",
                   [*json_headers(headers), ("Content-Length", str(len(body)))])
    return [body]
