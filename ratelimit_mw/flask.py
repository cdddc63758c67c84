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
as the middleware's. Headers are added and ``count_when`` refunds are decided in
``after_request``.

Per-app state (the options' caches, the breaker) lives in ``app.extensions["ratelimit_mw"]``,
so one extension object serves any number of apps built by an app factory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from flask import Blueprint, Flask, Response
from flask import g as _g
from flask import request as _request_proxy
from werkzeug.exceptions import ServiceUnavailable, TooManyRequests

from ratelimit_mw._errors import ConfigurationError
from ratelimit_mw._http import (
    ErrorPolicy,
    MiddlewareCore,
    Rule,
    Selection,
    validate_on_blocked,
)
from ratelimit_mw.decision import Decision
from ratelimit_mw.headers import retry_after_seconds, too_many_requests_body, unavailable_body
from ratelimit_mw.keys import ROUTE_SCOPE_KEY
from ratelimit_mw.limiter import Limiter
from ratelimit_mw.policy import Policy
from ratelimit_mw.routing import (
    ATTRIBUTE,
    EXEMPT,
    Cost,
    KeyFunc,
    RouteLimit,
    limit_decorator,
    route_limits,
)
from ratelimit_mw.routing import exempt as _exempt
from ratelimit_mw.wsgi import (
    DECISION_KEY,
    REFUSE,
    UNAVAILABLE,
    Headers,
    SyncGate,
    require_sync_limiter,
)

__all__ = ["EXTENSION_KEY", "BackendUnavailable", "RateLimit", "RateLimited", "Rule"]

#: The extension's per-app state: ``app.extensions[EXTENSION_KEY]``.
EXTENSION_KEY = "ratelimit_mw"

# What before_request leaves for after_request: the headers to add, whether they only fill
# gaps (a refusal rendered by the app's own handler), and the checks to refund.
_PENDING = "ratelimit_mw.pending"
_JSON = ("Content-Type", "application/json")


class RateLimited(TooManyRequests):
    """The refusal, raised in ``before_request``; ``@app.errorhandler(429)`` receives it.

    ``decision`` is the limiter's `Decision`, ``retry_after`` the Retry-After seconds and
    ``ratelimit_headers`` the headers the 429 carries (they are also added to whatever a
    handler returns, unless it sets them itself). Without a handler the response is JSON:
    ``{"detail": ..., "retry_after": N}``.
    """

    def __init__(self, decision: Decision, headers: Headers) -> None:
        super().__init__(retry_after=retry_after_seconds(decision))
        self.decision = decision
        self.ratelimit_headers = headers

    def get_body(self, environ: Any = None, scope: Any = None) -> str:
        return too_many_requests_body(self.decision).decode()

    def get_headers(self, environ: Any = None, scope: Any = None) -> list[tuple[str, str]]:
        return [_JSON, *self.ratelimit_headers]


class BackendUnavailable(ServiceUnavailable):
    """``on_backend_error`` refused a request while the store is down: a 503 that
    ``@app.errorhandler(503)`` can render; without a handler it is JSON with Retry-After."""

    def __init__(self, retry_after: int, headers: Headers) -> None:
        super().__init__(retry_after=retry_after)
        self.ratelimit_headers = headers
        self._body = unavailable_body(retry_after).decode()

    def get_body(self, environ: Any = None, scope: Any = None) -> str:
        return self._body

    def get_headers(self, environ: Any = None, scope: Any = None) -> list[tuple[str, str]]:
        return [_JSON, *self.ratelimit_headers]


def _generic_name(target: object) -> str:
    # The policy name RouteLimit.bound_to gives a target that is not a function.
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', '?')}"


def _blueprint_name(bp: Blueprint) -> str:
    return f"blueprint:{bp.import_name}.{bp.name}"


class _AppState:
    """Everything one app needs per request, built by init_app and kept in app.extensions."""

    __slots__ = ("app", "core", "gate", "on_blocked", "routes", "selections")

    def __init__(self, app: Flask, core: MiddlewareCore, limiter: Limiter,
                 on_blocked: Callable[[Any, Decision], Any] | None) -> None:
        self.app = app
        self.core = core
        self.gate = SyncGate(core, limiter)
        self.on_blocked = on_blocked
        # endpoint -> what applies to it (limits, EXEMPT or None). Filled on first use, not
        # at init_app: decorators written above @app.route run after the view is registered.
        self.routes: dict[str, object] = {}
        # endpoint (None: no route matched) -> its Selection, when no path rule makes the
        # policies depend on the path as well.
        self.selections: dict[str | None, Selection | None] | None = (
            None if core.rules else {}
        )

    # -- route metadata --------------------------------------------------------------------
    def route_for(self, endpoint: str, request: Any) -> object:
        try:
            return self.routes[endpoint]
        except KeyError:
            pass
        view = self.app.view_functions.get(endpoint)
        found: object = route_limits(view)
        if found is None:
            # A class-based view carries its decorators on the class.
            found = route_limits(getattr(view, "view_class", None))
        if found is None:
            for name in request.blueprints:  # innermost first
                bp = self.app.blueprints.get(name)
                found = self._blueprint_limits(bp) if bp is not None else None
                if found is not None:
                    break
        # Kept whole (the selection cache holds its id), also when it is None.
        self.routes[endpoint] = found
        return found

    def _blueprint_limits(self, bp: Any) -> object:
        found = route_limits(bp)
        if found is None or found == EXEMPT:
            return found
        # @limiter.limit(...) applied to a blueprint names its policy after the Blueprint
        # class; rename it after the blueprint, so that blueprints count apart.
        generic = _generic_name(bp)
        limits: tuple[RouteLimit, ...] = found  # type: ignore[assignment]
        renamed = tuple(
            RouteLimit.make(item.rates, key=item.key, cost=item.cost,
                            name=_blueprint_name(bp)).bound_to(bp)
            if item.name == generic else item
            for item in limits
        )
        if renamed != limits:
            setattr(bp, ATTRIBUTE, renamed)
        return getattr(bp, ATTRIBUTE)

    # -- the request hooks -----------------------------------------------------------------
    def _selection(self, endpoint: str | None, request: Any) -> Selection | None:
        """What applies to this request; without path rules, once per endpoint."""
        selections = self.selections
        if selections is not None:
            try:
                return selections[endpoint]
            except KeyError:
                pass
        # No endpoint: no route matched (404, 405) and the defaults apply.
        route = None if endpoint is None else self.route_for(endpoint, request)
        selection = self.core.select(request.method, request.path, route)
        if selections is not None:
            # Bounded by the app's endpoints; stable because route_for is cached too.
            selections[endpoint] = selection
        return selection

    def before_request(self) -> Any:
        request = _request_proxy._get_current_object()  # type: ignore[attr-defined]
        environ = request.environ
        rule = request.url_rule
        if rule is not None:
            environ[ROUTE_SCOPE_KEY] = rule.rule
        selection = self._selection(request.endpoint, request)
        if selection is None:
            # Always there for the view: None unless the limiter decided.
            environ[DECISION_KEY] = _g._get_current_object().ratelimit = None
            return None
        gate = self.gate
        verdict, decision, checks = gate.consult(selection, request)
        environ[DECISION_KEY] = _g._get_current_object().ratelimit = decision
        core = self.core
        if decision is None:
            if verdict == UNAVAILABLE:
                headers = gate.unavailable_headers()
                environ[_PENDING] = (headers, True, None)
                raise BackendUnavailable(core.cooldown_seconds(), headers)
            return None
        if verdict == REFUSE:
            headers = gate.refusal_headers(decision, selection)
            environ[_PENDING] = (headers, True, None)
            if self.on_blocked is not None:
                try:
                    return self.on_blocked(request, decision)
                except Exception as exc:
                    core.log_failure("ratelimit_mw on_blocked failed; answering the JSON 429",
                                     exc)
            refusal = RateLimited(decision, headers)
            if self.app._find_error_handler(refusal, request.blueprints) is None:
                # No @app.errorhandler(429): answer directly. Raising would cost Flask's whole
                # exception path for every request of a flood, to render the same response.
                return Response(refusal.get_body(), 429, refusal.get_headers())
            raise refusal
        refund = checks if core.count_when is not None and decision.allowed else None
        if core.headers:
            environ[_PENDING] = (gate.served_headers(decision, selection), False, refund)
        elif refund is not None:
            environ[_PENDING] = (None, False, refund)
        return None

    def after_request(self, response: Response) -> Response:
        request = _request_proxy._get_current_object()  # type: ignore[attr-defined]
        pending = request.environ.pop(_PENDING, None)
        if pending is None:
            return response
        headers, fill_only, refund = pending
        if headers:
            target = response.headers
            if fill_only:
                for name, value in headers:
                    if name not in target:
                        target[name] = value
            else:
                # add() one by one: extend() first works out what kind of mapping it got.
                add = target.add
                for name, value in headers:
                    add(name, value)
        if refund is not None and self.core.should_refund(response.status_code):
            # After the response has gone out: the client does not wait for the round trip.
            gate = self.gate
            response.call_on_close(lambda: gate.refund(refund))
        return response


class RateLimit:
    """Rate limiting for a Flask app: ``RateLimit(app, limiter=...)`` or ``init_app(app)``.

    The options are those of `ratelimit_mw.wsgi.RateLimitMiddleware`, except that
    ``on_blocked(request, decision)`` returns anything a Flask view may return (the
    rate-limit headers are added unless it sets them), and that refusals otherwise go through
    Flask's error handling as `RateLimited` (and ``on_backend_error="deny"`` as
    `BackendUnavailable`). Key functions receive ``flask.request``. The decision is
    ``flask.g.ratelimit`` and ``request.environ["ratelimit_mw.decision"]``.
    """

    def __init__(
        self,
        app: Flask | None = None,
        limiter: Limiter | None = None,
        *,
        default: Policy | str | Sequence[Policy | str] | None = None,
        rules: Sequence[Rule] | Mapping[str, Policy | str] | None = None,
        key: KeyFunc | None = None,
        on_backend_error: ErrorPolicy = "allow",
        headers: bool = True,
        legacy_headers: bool = False,
        mode: str = "enforce",
        on_blocked: Callable[[Any, Decision], Any] | None = None,
        on_refusal: Callable[[Any, Decision], None] | None = None,
        count_when: Callable[[int], bool] | None = None,
        backend_cooldown: float = 1.0,
    ) -> None:
        if limiter is not None:
            require_sync_limiter(limiter, "RateLimit")
        validate_on_blocked(on_blocked, "lambda request, decision: ('slow down', 429)")
        self.limiter = limiter
        self.on_blocked = on_blocked
        self._options: dict[str, Any] = {
            "default": default, "rules": rules, "key": key,
            "on_backend_error": on_backend_error, "headers": headers,
            "legacy_headers": legacy_headers, "mode": mode, "on_refusal": on_refusal,
            "count_when": count_when, "backend_cooldown": backend_cooldown,
        }
        # Validate now, so a typo fails where the extension is written, not at init_app.
        self._core()
        if app is not None:
            self.init_app(app)

    def _core(self) -> MiddlewareCore:
        return MiddlewareCore(**self._options)

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
        state = _AppState(app, self._core(), limiter, self.on_blocked)
        app.extensions[EXTENSION_KEY] = state
        app.before_request(state.before_request)
        app.after_request(state.after_request)

    # -- decorators (metadata only, like Limiter.limit / Limiter.exempt) --------------------
    def limit_blueprint(self, blueprint: Blueprint, rates: Policy | str, *,
                        key: KeyFunc | None = None, cost: Cost = 1,
                        name: str | None = None) -> Blueprint:
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
        route_limit = RouteLimit.make(rates, key=key, cost=cost,
                                      name=name or _blueprint_name(blueprint))
        return limit_decorator(route_limit)(cast(Any, blueprint))  # type: ignore[no-any-return]

    def exempt_blueprint(self, blueprint: Blueprint) -> Blueprint:
        """Exempt every view of `blueprint` without a decorator of its own from ``default``."""
        if not isinstance(blueprint, Blueprint):
            raise ConfigurationError(
                f"exempt_blueprint takes a flask.Blueprint, got {blueprint!r}; for a view "
                "write @limiter.exempt"
            )
        return _exempt(cast(Any, blueprint))  # type: ignore[no-any-return]
