"""The Flask extension: rate limits that know Flask's routes, blueprints and error handlers.

    from ratelimit_mw import Limiter, RedisBackend
    from ratelimit_mw.flask import RateLimit

    limiter = Limiter(RedisBackend.from_url("redis://localhost:6379/0"))
    ratelimit = RateLimit(limiter=limiter, default="100/minute")

    @app.route("/login", methods=["POST"])
    @limiter.limit("5/minute")
    def login(): ...

    ratelimit.init_app(app)          # or RateLimit(app, limiter=limiter, ...)

It takes the options of the WSGI middleware and decides in ``before_request``, where Flask has
already routed the request: ``@limiter.limit`` / ``@limiter.exempt`` on a view (above or
below ``@app.route``) and limits set on a blueprint are honoured, and routes are keyed by
their rule template (``/users/<int:id>``, see ``keys.route()``). The closest setting wins: a
view's own decorator, else that of its innermost blueprint that has one, else ``default``;
path ``rules`` always add. A refusal raises `RateLimited` (a werkzeug ``TooManyRequests``),
so ``@app.errorhandler(429)`` can render it; without a handler the answer is the same JSON 429
as the middleware's. ``count_when`` refunds are decided in ``after_request``; the rate-limit
headers are added as the response starts (`_with_fields`, around ``app.wsgi_app``), after
every ``after_request`` hook.

Per-app state (the options' caches, the breaker) lives in ``app.extensions["ratelimit_mw"]``,
so one extension object serves any number of apps built by an app factory.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:  # annotations only (strings at run time)
    from typing_extensions import Unpack

from ratelimit_mw._sync import slots as slots_sync
from ratelimit_mw._sync.handler import handler_sync
from ratelimit_mw.core.codec import Check
from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.core.policy import Policy
from ratelimit_mw.hooks import refuse_async
from ratelimit_mw.http.config import Config, ConfigOptions, build_config
from ratelimit_mw.http.extras import require
from ratelimit_mw.http.guard import DECISION_KEY, Guard
from ratelimit_mw.http.headers import Headers, retry_after_seconds
from ratelimit_mw.http.rules import Rule
from ratelimit_mw.http.verdict import Admit, Refuse, Unavailable
from ratelimit_mw.keys import ROUTE_SCOPE_KEY, KeyFunc
from ratelimit_mw.limiter import Limiter, require_sync_limiter
from ratelimit_mw.routing import ATTRIBUTE, Cost, RouteLimit, limit_decorator, route_limits
from ratelimit_mw.routing import exempt as _exempt

require("flask", "flask", "ratelimit_mw.flask")
from flask import Blueprint, Flask, Response  # noqa: E402
from flask import g as _g  # noqa: E402
from flask import request as _request_proxy  # noqa: E402
from flask.globals import request_ctx as _request_ctx  # noqa: E402
from werkzeug.exceptions import HTTPException, ServiceUnavailable, TooManyRequests  # noqa: E402

from ratelimit_mw.wsgi import (  # noqa: E402
    PREFLIGHT,
    json_headers,
    may_give_back,
    missing,
    renewing,
    sync_guard,
)

__all__ = ["EXTENSION_KEY", "BackendUnavailable", "Config", "RateLimit", "RateLimited", "Rule"]

#: The extension's per-app state: ``app.extensions[EXTENSION_KEY]``.
EXTENSION_KEY = "ratelimit_mw"

# What before_request leaves for the response: the headers to add, and whether they only
# fill gaps (a refusal rendered by the app's own handler). In `_FIELDS`, the list the
# wrapper around app.wsgi_app reads as the response starts (a copy of the environ shares
# it); without the wrapper (an app whose wsgi_app was taken before init_app), under
# `_PENDING`, for after_request.
_FIELDS = "ratelimit_mw.fields"
_PENDING = "ratelimit_mw.pending"
# An admitted request whose response may give its hit back: its `_Refund` when any response
# may (slots, a count_when), else its `Admit` until an uncharged 405 makes one.
_REFUND = "ratelimit_mw.refund"
_UNSEEN = object()  # an endpoint and method not met yet (None: nothing applies)


class _Refund:
    """One admitted request's give-back, decided once on the response that goes out.

    ``after_request`` hands it every response (Flask makes a second one, a 500, when a view
    or another hook raises); the close of the last one runs it, so the client does not wait
    for the round trip. When no response of ours goes out (an exception propagates, as in
    debug mode and ``app.testing``, raised before our after_request or after it by a later
    hook), ``teardown_request`` runs it with status 500, as the WSGI middleware counts an
    exception; not the teardown of a copied request context (`context`: the request's own).
    """

    __slots__ = ("admit", "context", "done", "erred", "guard", "limiter", "response")

    def __init__(self, guard: Guard, limiter: Limiter, admit: Admit) -> None:
        self.guard, self.limiter, self.admit = guard, limiter, admit
        self.context = _request_ctx._get_current_object()  # type: ignore[attr-defined]
        self.response: Response | None = None
        self.erred = False  # `response` is Flask's answer to an exception (it goes out)
        self.done = False

    def on(self, response: Response) -> None:
        """`response` is the one going out now: its close decides (with the in-flight slots
        the request holds, renewed while a streamed body is read)."""
        if response is self.response:
            return
        self.response = response
        self.erred = sys.exc_info()[1] is not None
        guard = self.guard
        plan = self.admit.plan
        if plan is None or plan.token is None:  # no slots: what the status gives back
            back = guard.given_back(self.admit, response.status_code)
        else:
            back = guard.released(self.admit, response.status_code)
            held = guard.holding(self.admit)
            if held is not None and response.is_streamed:
                response.response = renewing(response.response,  # type: ignore[arg-type]
                                             guard, self.limiter, held)
        if back:
            response.call_on_close(lambda: self.run(response, back))

    def run(self, response: Response | None, back: Sequence[Check]) -> None:
        if self.done or response is not self.response:
            return
        self.done = True
        slots_sync.refund_sync(self.guard, self.limiter, self.admit, back)


def _with_fields(wsgi_app: Callable[..., Any]) -> Callable[..., Any]:
    """`wsgi_app` with the rate-limit headers that ``before_request`` left (in `_FIELDS`)
    added as the response starts: after every ``after_request`` hook, to whatever response
    goes out (one a hook returned instead, an error handler's, a 500 Flask made), on each
    start (a second one with ``exc_info`` too), in a new list, as the WSGI middleware adds
    them. Plain pairs: werkzeug's ``Headers.add`` would check each value again, and ours
    are printable ASCII by construction."""

    def with_fields(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        left: list[tuple[Headers, bool]] = []
        environ[_FIELDS] = left

        def start(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            if left:
                extra, fill_only = left[-1]
                headers = [*headers, *(missing(headers, extra) if fill_only else extra)]
            return start_response(status, headers, exc_info)

        return wsgi_app(environ, start)

    return with_fields


def _leave(environ: dict[str, Any], headers: Headers | None, fill_only: bool) -> None:
    """Leave `headers` (None: none) for the response, where the wrapper around app.wsgi_app
    reads them, else for after_request."""
    left = environ.get(_FIELDS)
    if left is not None:
        if headers is None:
            left.clear()
        else:
            left.append((headers, fill_only))
    elif headers is None:
        environ.pop(_PENDING, None)
    else:
        environ[_PENDING] = (headers, fill_only)


class _JSONAnswer(HTTPException):
    """A refusal that ``@app.errorhandler`` can render; without a handler it is the JSON the
    middleware answers. ``ratelimit_headers``: those it carries (also added to whatever a
    handler returns, unless it sets them itself)."""

    ratelimit_headers: Headers
    _body: str

    def get_body(self, environ: Any = None, scope: Any = None) -> str:
        return self._body

    def get_headers(self, environ: Any = None, scope: Any = None) -> list[tuple[str, str]]:
        return json_headers(self.ratelimit_headers)


class RateLimited(_JSONAnswer, TooManyRequests):
    """The refusal, raised in ``before_request``; ``@app.errorhandler(429)`` receives it.

    ``decision`` is the limiter's `Decision` and ``retry_after`` the Retry-After seconds.
    Without a handler the response is JSON: ``{"detail": ..., "retry_after": N}``.
    """

    def __init__(self, refusal: Refuse) -> None:
        super().__init__(retry_after=retry_after_seconds(refusal.decision))
        self.decision = refusal.decision
        # A copy: the guard hands one rendering to every refusal of a shape, and the app's
        # error handler may add to this list.
        self.ratelimit_headers = list(refusal.headers)
        self._body = refusal.body.decode()


class BackendUnavailable(_JSONAnswer, ServiceUnavailable):
    """``on_backend_error`` refused a request while the store is down: a 503 that
    ``@app.errorhandler(503)`` can render; without a handler it is JSON with Retry-After."""

    def __init__(self, retry_after: int, headers: Headers, body: bytes) -> None:
        super().__init__(retry_after=retry_after)
        self.ratelimit_headers = list(headers)  # a copy, as RateLimited's
        self._body = body.decode()


class _AppState:
    """Everything one app needs per request, built by init_app and kept in app.extensions."""

    __slots__ = ("app", "guard", "handlers", "handles_429", "limiter", "routes")

    def __init__(self, app: Flask, config: Config, limiter: Limiter) -> None:
        self.app = app
        self.guard = sync_guard(config, limiter, "the Flask extension")
        self.limiter = limiter
        # blueprint chain -> whether an error handler answers a 429 there.
        self.handles_429: dict[tuple[str, ...], bool] = {}
        # endpoint -> what applies to it (limits, EXEMPT or None). Filled on first use, not
        # at init_app: decorators written above @app.route run after the view is registered.
        self.routes: dict[str, object] = {}
        # (endpoint, method) -> its selection's handler (None: nothing applies), when no path
        # rule makes it depend on the path. Bounded: a matched endpoint sees only its route's
        # methods, and no endpoint (404, 405) is kept under "" whatever the method.
        self.handlers: dict[tuple[str | None, str], Callable[..., Any] | None] | None = (
            None if config.rule_list else {}
        )

    def route_for(self, endpoint: str, request: Any) -> object:
        """What applies to the endpoint: the view's (a class-based view's on its class), else
        its innermost blueprint's that has limits."""
        try:
            return self.routes[endpoint]
        except KeyError:
            pass
        view = self.app.view_functions.get(endpoint)
        found: object = route_limits(view) or route_limits(getattr(view, "view_class", None))
        for name in request.blueprints if found is None else ():  # innermost first
            bp = self.app.blueprints.get(name)
            found = None if bp is None else self._blueprint_limits(bp)
            if found is not None:
                break
        # Kept whole (the selection cache holds its id), also when it is None.
        self.routes[endpoint] = found
        return found

    def _blueprint_limits(self, bp: Any) -> object:
        found = route_limits(bp)
        if not isinstance(found, tuple):
            return found
        # @limiter.limit(...) applied to a blueprint names its policy after the Blueprint
        # class; rename it after the blueprint, so that blueprints count apart.
        renamed = tuple(
            replace(item, policy=None if isinstance(item.rates, str) else item.policy,
                    in_flight=None, name=f"blueprint {bp.name}").bound_to(bp)
            if item.name is None and (isinstance(item.rates, str)
                                      or item.concurrency is not None) else item
            for item in found
        )
        if renamed != found:
            setattr(bp, ATTRIBUTE, renamed)
        return renamed

    def _handler(self, endpoint: str | None, request: Any,
                 cache_key: tuple[str | None, str]) -> Callable[..., Any] | None:
        """The handler of what applies to this request (None: nothing); without path rules
        kept per endpoint and method (a store, clock or metrics hook replaced under it rebuilds
        it: its generation)."""
        # No endpoint: no route matched (404, 405) and the defaults apply.
        route = None if endpoint is None else self.route_for(endpoint, request)
        selection = self.guard.select(request.method, request.path, route)
        handle = None if selection is None else handler_sync(self.guard, self.limiter,
                                                            selection)
        if self.handlers is not None:
            # Bounded by the app's endpoints; stable because route_for is cached too.
            self.handlers[cache_key] = handle
        return handle

    def before_request(self) -> Any:
        request = _request_proxy._get_current_object()  # type: ignore[attr-defined]
        environ = request.environ
        rule = request.url_rule
        if rule is not None:
            environ[ROUTE_SCOPE_KEY] = rule.rule
        method: str = request.method
        endpoint = None if rule is None else rule.endpoint
        cache_key = (endpoint, method if endpoint is not None else "")
        handlers = self.handlers
        handle: Any = handlers.get(cache_key, _UNSEEN) if handlers is not None else _UNSEEN
        if handle is _UNSEEN:
            handle = self._handler(endpoint, request, cache_key)
        verdict = None if handle is None else handle(request, method,
                                                     method == "OPTIONS" and PREFLIGHT in environ)
        # Always there for the view: None unless the limiter decided.
        environ[DECISION_KEY] = _g._get_current_object().ratelimit = getattr(
            verdict, "decision", None)
        if isinstance(verdict, Admit):
            if verdict.headers:
                _leave(environ, verdict.headers, False)
            if verdict.plan is not None:
                environ[_REFUND] = (_Refund(self.guard, self.limiter, verdict)
                                    if may_give_back(verdict, 500, self.guard) else verdict)
        elif verdict is not None:
            _leave(environ, verdict.headers, True)
            return self._refuse(request, verdict)
        return None

    def _refuse(self, request: Any, verdict: Refuse | Unavailable) -> Any:
        guard = self.guard
        if isinstance(verdict, Unavailable):
            raise BackendUnavailable(guard.breaker.retry_after(), verdict.headers, verdict.body)
        on_blocked = guard.config.on_blocked
        if on_blocked is not None:
            try:
                answer = on_blocked(request, verdict.decision)
                if answer is None:
                    # Flask reads None from before_request as "go on to the view": the
                    # refused request would be served.
                    raise TypeError("on_blocked returned None, not a response")
                # Made here, so that a value Flask cannot render is this fallback's, not a
                # 500 later.
                return self.app.make_response(answer)
            except Exception as exc:
                guard.log_failure("ratelimit_mw on_blocked failed; answering the JSON 429", exc)
        blueprints = tuple(request.blueprints)
        handled = self.handles_429.get(blueprints)
        if handled is None:
            # Error handlers are set up before the first request (Flask refuses them after),
            # so whether one answers a 429 is known per blueprint chain once asked.
            handled = self.handles_429[blueprints] = self.app._find_error_handler(
                RateLimited(verdict), list(blueprints)) is not None
        if handled:
            raise RateLimited(verdict)
        # No @app.errorhandler(429): answer directly. Raising would cost Flask's whole
        # exception path for every request of a flood, to render the same response. It
        # carries every rate-limit header already: nothing left to add.
        _leave(request.environ, None, True)
        return Response(verdict.body, 429, json_headers(verdict.headers))

    def after_request(self, response: Response) -> Response:
        environ = _request_proxy._get_current_object().environ  # type: ignore[attr-defined]
        found: _Refund | Admit | None = environ.get(_REFUND)
        if isinstance(found, _Refund):
            found.on(response)
        elif found is not None and response.status_code == 405:
            # An Admit kept: `may_give_back` said no for all but the status (a 405 may).
            environ[_REFUND] = refund = _Refund(self.guard, self.limiter, found)
            refund.on(response)
        pending = environ.pop(_PENDING, None)
        if pending is not None:  # no wrapper around app.wsgi_app: added here instead
            headers, fill_only = pending
            target = response.headers
            # add() one by one: extend() first works out what kind of mapping it got.
            add = target.add
            for name, value in missing(target, headers) if fill_only else headers:
                add(name, value)
        return response

    def teardown_request(self, exc: BaseException | None) -> None:
        # One proxy dereference: each costs more than the rest of this hook.
        context = _request_ctx._get_current_object()  # type: ignore[attr-defined]
        refund = context.request.environ.get(_REFUND)
        # An Admit: a 500 gives nothing back. Another context: a copied one's end (a thread's
        # copy_current_request_context), not the request's.
        if type(refund) is not _Refund or refund.context is not context:
            return
        if refund.response is not None and (exc is None or refund.erred):
            return  # the response it saw goes out, and its close gives back
        # No response of ours goes out: the exception propagated, before our after_request or
        # after it (a later hook raised: the response it saw is thrown away); a 500.
        refund.response = None
        refund.run(None, refund.guard.released(refund.admit, 500))


class RateLimit:
    """Rate limiting for a Flask app: ``RateLimit(app, limiter=...)`` or ``init_app(app)``.

    The options are those of `ratelimit_mw.wsgi.RateLimitMiddleware`, except that
    ``on_blocked(request, decision)`` returns anything a Flask view may return (the
    rate-limit headers are added unless it sets them), and that refusals otherwise go through
    Flask's error handling as `RateLimited` (and ``on_backend_error="deny"`` as
    `BackendUnavailable`). Key functions receive ``flask.request``. The decision is
    ``flask.g.ratelimit`` and ``request.environ["ratelimit_mw.decision"]``.
    """

    def __init__(self, app: Flask | None = None, limiter: Limiter | None = None, *,
                 config: Config | None = None, **options: Unpack[ConfigOptions]) -> None:
        if limiter is not None:
            require_sync_limiter(limiter, "RateLimit")
        self.limiter = limiter
        # Validated now, so a typo fails where the extension is written, not at init_app.
        self.config = build_config(config, options)
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask, *, limiter: Limiter | None = None) -> None:
        """Install on `app`; `limiter` overrides the extension's for this app (app factories
        that build it from ``app.config``)."""
        limiter = limiter if limiter is not None else self.limiter
        if limiter is None:
            raise ConfigurationError(
                "RateLimit needs a limiter: RateLimit(app, limiter=Limiter(RedisBackend."
                "from_url(url))) or init_app(app, limiter=...); Limiter() counts in memory"
            )
        require_sync_limiter(limiter, "RateLimit")
        if EXTENSION_KEY in app.extensions:
            raise ConfigurationError(
                f"RateLimit is already installed on {app!r}; install one extension per app "
                "and put every limit in it"
            )
        state = _AppState(app, self.config, limiter)
        app.extensions[EXTENSION_KEY] = state
        app.before_request(state.before_request)
        app.after_request(state.after_request)
        app.teardown_request(state.teardown_request)
        app.wsgi_app = _with_fields(app.wsgi_app)  # type: ignore[method-assign]

    # -- decorators (metadata only, like Limiter.limit / Limiter.exempt) --------------------
    def limit_blueprint(self, blueprint: Blueprint, rates: Policy | str | None = None, *,
                        key: KeyFunc | None = None, cost: Cost = 1,
                        name: str | None = None,
                        concurrency: Policy | int | None = None) -> Blueprint:
        """Limit every view of `blueprint` that has no decorator of its own.

        The quota is shared by the whole blueprint (one policy named after it, or `name`);
        for one quota per view, key by route as well:
        ``key=keys.compose(keys.client_ip(), keys.route())``. Calling it again adds tiers.
        """
        if not isinstance(blueprint, Blueprint):
            raise ConfigurationError(
                f"limit_blueprint takes a flask.Blueprint, got {blueprint!r}; for a view "
                'write @limiter.limit("5/minute")'
            )
        refuse_async("the Flask extension", [("key", key),
                                             ("cost", cost if callable(cost) else None)])
        route_limit = RouteLimit.make(rates, key=key, cost=cost,
                                      name=name or f"blueprint {blueprint.name}",
                                      concurrency=concurrency)
        return limit_decorator(route_limit)(cast(Any, blueprint))  # type: ignore[no-any-return]

    def exempt_blueprint(self, blueprint: Blueprint) -> Blueprint:
        """Exempt every view of `blueprint` without a decorator of its own from ``default``."""
        if not isinstance(blueprint, Blueprint):
            raise ConfigurationError(
                f"exempt_blueprint takes a flask.Blueprint, got {blueprint!r}; for a view "
                "write @limiter.exempt"
            )
        return _exempt(cast(Any, blueprint))  # type: ignore[no-any-return]
