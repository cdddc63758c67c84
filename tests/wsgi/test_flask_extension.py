"""The Flask extension, driven by Flask's test client, on the memory backend and real Redis."""

from __future__ import annotations

import json
import threading
from typing import Any

import flask
import pytest
import werkzeug.test
from flask import Blueprint, Flask
from flask.views import MethodView
from support import failing_backend as FailingBackend

import ratelimit_mw as rl
from ratelimit_mw import keys
from ratelimit_mw.core.errors import BackendError, ConfigurationError
from ratelimit_mw.flask import EXTENSION_KEY, BackendUnavailable, RateLimit, RateLimited
from ratelimit_mw.keys import ROUTE_SCOPE_KEY
from ratelimit_mw.wsgi import DECISION_KEY

PEER = "ip:127.0.0.1"


def new_app() -> Flask:
    app = Flask(__name__)
    app.config["TESTING"] = True
    return app


def statuses(client: Any, path: str, n: int, **kwargs: Any) -> list[int]:
    return [client.get(path, **kwargs).status_code for _ in range(n)]


# -- the limit -----------------------------------------------------------------------------
def test_exactly_limit_admitted_then_a_json_429_not_werkzeugs_html(
    limiter: rl.Limiter, clock: Any
) -> None:
    app = new_app()

    @app.route("/")
    def index() -> str:
        return "hello"

    RateLimit(app, limiter=limiter, default="3/minute")
    c = app.test_client()
    admitted = [c.get("/") for _ in range(3)]
    refused = c.get("/")
    assert [r.status_code for r in admitted] == [200] * 3
    assert [r.headers["RateLimit"] for r in admitted] == [
        '"minute";r=2;t=60', '"minute";r=1;t=60', '"minute";r=0;t=60']
    assert admitted[0].headers["RateLimit-Policy"] == '"minute";q=3;w=60'
    assert refused.status_code == 429
    assert refused.headers["Content-Type"] == "application/json"
    assert refused.headers["Retry-After"] == "60"
    assert refused.headers["RateLimit"] == '"minute";r=0;t=60'
    assert refused.headers["RateLimit-Policy"] == '"minute";q=3;w=60'
    assert refused.headers["Cache-Control"] == "no-store"
    assert refused.headers.getlist("Retry-After") == ["60"]  # not doubled by after_request
    assert refused.get_json() == {"detail": "Too Many Requests", "retry_after": 60}
    clock.advance(60)
    assert c.get("/").status_code == 200


def test_the_decision_is_in_flask_g_and_in_the_environ(limiter: rl.Limiter) -> None:
    app = new_app()

    @app.route("/")
    def index() -> dict[str, Any]:
        decision = flask.g.ratelimit
        return {"remaining": decision.remaining,
                "same": flask.request.environ[DECISION_KEY] is decision}

    @app.route("/free")
    @limiter.exempt
    def free() -> dict[str, Any]:
        return {"decision": flask.g.ratelimit}

    RateLimit(app, limiter=limiter, default="5/minute")
    assert app.test_client().get("/").get_json() == {"remaining": 4, "same": True}
    assert app.test_client().get("/free").get_json() == {"decision": None}


def test_requests_that_match_no_route_fall_under_the_default(limiter: rl.Limiter) -> None:
    app = new_app()
    RateLimit(app, limiter=limiter, default="2/minute")
    c = app.test_client()
    assert statuses(c, "/nowhere", 3) == [404, 404, 429]


# -- decorators ----------------------------------------------------------------------------
def test_an_exempt_view_escapes_the_default_but_not_the_rules(limiter: rl.Limiter) -> None:
    app = new_app()

    @app.route("/health")
    @limiter.exempt
    def health() -> str:
        return "ok"

    @app.route("/admin/health")
    @limiter.exempt
    def admin_health() -> str:
        return "ok"

    RateLimit(app, limiter=limiter, default="1/minute", rules={"/admin/*": "2/minute"})
    c = app.test_client()
    assert statuses(c, "/health", 4) == [200] * 4
    assert "RateLimit" not in c.get("/health").headers
    assert statuses(c, "/admin/health", 3) == [200, 200, 429]


def test_a_class_based_view_is_limited_by_a_decorator_on_the_class(
    limiter: rl.Limiter,
) -> None:
    app = new_app()

    @limiter.limit("1/minute")
    class Items(MethodView):
        def get(self) -> str:
            return "items"

    app.add_url_rule("/items", view_func=Items.as_view("items"))
    RateLimit(app, limiter=limiter, default="10/minute")
    assert statuses(app.test_client(), "/items", 2) == [200, 429]


def test_decorator_costs_and_keys_are_honoured(limiter: rl.Limiter) -> None:
    app = new_app()

    @app.route("/export")
    @limiter.limit("10/minute", cost=4, key=keys.header("X-Api-Key", required=True))
    def export() -> str:
        return "csv"

    RateLimit(app, limiter=limiter)
    c = app.test_client()
    a = {"X-Api-Key": "a"}
    assert statuses(c, "/export", 3, headers=a) == [200, 200, 429]
    assert c.get("/export", headers={"X-Api-Key": "b"}).status_code == 200


# -- blueprints ----------------------------------------------------------------------------
def blueprint_app(limiter: rl.Limiter, setup: Any, **options: Any) -> Flask:
    app = new_app()
    api = Blueprint("api", __name__, url_prefix="/api")
    api.add_url_rule("/a", "a", lambda: "a")
    api.add_url_rule("/b", "b", lambda: "b")

    @api.route("/own")
    @limiter.limit("1/minute")
    def own() -> str:
        return "own"

    setup(api)
    app.register_blueprint(api)
    app.add_url_rule("/outside", "outside", lambda: "outside")
    RateLimit(app, limiter=limiter, **options)
    return app


def test_a_blueprint_limit_is_one_quota_for_the_whole_blueprint(limiter: rl.Limiter) -> None:
    def setup(api: Blueprint) -> None:
        RateLimit(limiter=limiter).limit_blueprint(api, "3/minute")

    c = blueprint_app(limiter, setup, default="10/minute").test_client()
    assert [c.get(p).status_code for p in ("/api/a", "/api/b", "/api/a", "/api/b")] == [
        200, 200, 200, 429]
    assert statuses(c, "/api/own", 2) == [200, 429]  # a view's own decorator wins
    assert c.get("/outside").headers["RateLimit"] == '"minute";r=9;t=60'


def test_an_exempt_blueprint_drops_the_default_for_its_undecorated_views(
    limiter: rl.Limiter,
) -> None:
    c = blueprint_app(limiter, lambda api: RateLimit(limiter=limiter).exempt_blueprint(api),
                      default="1/minute").test_client()
    assert statuses(c, "/api/a", 3) == [200, 200, 200]
    assert statuses(c, "/api/own", 2) == [200, 429]
    assert statuses(c, "/outside", 2) == [200, 429]


def test_limiter_decorators_work_on_blueprints_and_count_each_blueprint_apart(
    limiter: rl.Limiter,
) -> None:
    app = new_app()
    first, second = Blueprint("first", __name__), Blueprint("second", __name__)
    first.add_url_rule("/1", "one", lambda: "1")
    second.add_url_rule("/2", "two", lambda: "2")
    limiter.limit("1/minute")(first)
    limiter.limit("1/minute")(second)
    app.register_blueprint(first)
    app.register_blueprint(second)
    RateLimit(app, limiter=limiter)
    c = app.test_client()
    assert statuses(c, "/1", 2) == [200, 429]
    assert statuses(c, "/2", 2) == [200, 429]


def test_the_innermost_blueprint_with_a_setting_wins(limiter: rl.Limiter) -> None:
    app = new_app()
    ext = RateLimit(limiter=limiter, default="5/minute")
    parent, child, plain = (Blueprint(n, __name__) for n in ("parent", "child", "plain"))
    parent.add_url_rule("/p", "p", lambda: "p")
    child.add_url_rule("/c", "c", lambda: "c")
    plain.add_url_rule("/x", "x", lambda: "x")
    ext.limit_blueprint(parent, "1/minute")
    ext.exempt_blueprint(child)
    child.register_blueprint(plain, url_prefix="/plain")  # no setting: the child's applies
    parent.register_blueprint(child, url_prefix="/child")
    app.register_blueprint(parent, url_prefix="/parent")
    ext.init_app(app)
    c = app.test_client()
    assert statuses(c, "/parent/p", 2) == [200, 429]
    assert statuses(c, "/parent/child/c", 3) == [200, 200, 200]
    assert statuses(c, "/parent/child/plain/x", 3) == [200, 200, 200]


def test_blueprint_helpers_reject_what_is_not_a_blueprint() -> None:
    ext = RateLimit(limiter=rl.Limiter())
    with pytest.raises(ConfigurationError, match="Blueprint"):
        ext.limit_blueprint(lambda: None, "1/minute")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="Blueprint"):
        ext.exempt_blueprint("api")  # type: ignore[arg-type]


# -- route templates -----------------------------------------------------------------------
def test_routes_are_keyed_by_their_rule_template_not_the_raw_path(limiter: rl.Limiter) -> None:
    app = new_app()
    templates: list[str] = []

    @app.route("/users/<int:user_id>")
    def user(user_id: int) -> str:
        templates.append(flask.request.environ[ROUTE_SCOPE_KEY])
        return str(user_id)

    app.add_url_rule("/items/<name>", "item", lambda name: name)
    RateLimit(app, limiter=limiter, default="2/minute",
              key=keys.compose(keys.client_ip(), keys.route()))
    c = app.test_client()
    assert [c.get(p).status_code for p in ("/users/1", "/users/2", "/users/3")] == [
        200, 200, 429]
    assert c.get("/items/a").status_code == 200  # another template, another bucket
    assert templates == ["/users/<int:user_id>", "/users/<int:user_id>"]
    assert limiter.peek(rl.Policy("2/minute"),
                        f"{len(PEER)}:{PEER}|26:route:/users/<int:user_id>").remaining == 0


# -- error handling ------------------------------------------------------------------------
def test_errorhandler_429_customises_the_refusal_and_keeps_the_headers(
    limiter: rl.Limiter,
) -> None:
    app = new_app()
    app.add_url_rule("/", "index", lambda: "ok")
    seen: list[Any] = []

    @app.errorhandler(429)
    def too_many(error: RateLimited) -> tuple[str, int]:
        seen.append(error)
        return f"<p>wait {error.retry_after} s</p>", 429

    RateLimit(app, limiter=limiter, default="1/minute")
    c = app.test_client()
    c.get("/")
    refused = c.get("/")
    assert refused.status_code == 429
    assert refused.get_data(as_text=True) == "<p>wait 60 s</p>"
    assert refused.headers["Content-Type"].startswith("text/html")
    assert refused.headers["Retry-After"] == "60"
    assert refused.headers["RateLimit"] == '"minute";r=0;t=60'
    assert refused.headers["Cache-Control"] == "no-store"
    assert isinstance(seen[0], RateLimited)
    assert seen[0].decision.allowed is False


def test_a_generic_http_exception_handler_sees_the_refusal_too(limiter: rl.Limiter) -> None:
    from werkzeug.exceptions import HTTPException

    app = new_app()
    app.add_url_rule("/", "index", lambda: "ok")

    @app.errorhandler(HTTPException)
    def http_error(error: HTTPException) -> tuple[dict[str, Any], int]:
        return {"error": error.code}, error.code or 500

    RateLimit(app, limiter=limiter, default="1/minute")
    c = app.test_client()
    c.get("/")
    refused = c.get("/")
    assert (refused.status_code, refused.get_json()) == (429, {"error": 429})
    assert refused.headers["Retry-After"] == "60"


@pytest.mark.parametrize("hook_first", [True, False])
def test_the_fields_go_on_the_response_that_goes_out_after_every_after_request_hook(
    limiter: rl.Limiter, hook_first: bool,
) -> None:
    """An app's after_request hook may hand back a new response, registered before the
    extension or after it: the fields are added as the response starts, so the one that
    goes out carries them, once; the hook itself sees the decision in ``g.ratelimit``."""
    app = new_app()
    app.add_url_rule("/", "index", lambda: "ok")
    seen: list[Any] = []

    def replace(response: Any) -> Any:
        seen.append((flask.g.ratelimit.remaining, "RateLimit" in response.headers))
        return flask.Response("replaced", 200)

    if hook_first:
        app.after_request(replace)
    RateLimit(app, limiter=limiter, default="3/minute")
    if not hook_first:
        app.after_request(replace)
    answer = app.test_client().get("/")
    assert answer.get_data(as_text=True) == "replaced"
    assert answer.headers.getlist("RateLimit") == ['"minute";r=2;t=60']
    assert answer.headers.getlist("RateLimit-Policy") == ['"minute";q=3;w=60']
    assert seen == [(2, False)]


def _environ_copying(wsgi_app: Any) -> Any:
    """A middleware that hands the app a copy of the environ (as some do)."""
    def copying(environ: dict[str, Any], start_response: Any) -> Any:
        return wsgi_app(dict(environ), start_response)
    return copying


@pytest.mark.parametrize("setup", ["wsgi_app taken before init_app",
                                   "an environ-copying middleware installed first"])
def test_the_fields_are_sent_however_the_app_is_served(limiter: rl.Limiter,
                                                       setup: str) -> None:
    """A framework that took ``app.wsgi_app`` before ``init_app`` (Connexion does) never
    runs the extension's wrapper: the fields go on in ``after_request`` instead. A
    middleware installed first that copies the environ still shares what is left for the
    wrapper. Either way admitted responses and the 429 carry them once."""
    app = new_app()
    app.add_url_rule("/", "index", lambda: "ok")
    if setup.startswith("wsgi_app taken"):
        served = app.wsgi_app
        RateLimit(app, limiter=limiter, default="1/minute")
    else:
        app.wsgi_app = _environ_copying(app.wsgi_app)  # type: ignore[method-assign]
        RateLimit(app, limiter=limiter, default="1/minute")
        served = app.wsgi_app
    client = werkzeug.test.Client(served, flask.Response)
    admitted, refused = client.get("/"), client.get("/")
    assert admitted.status_code == 200
    assert admitted.headers.getlist("RateLimit") == ['"minute";r=0;t=60']
    assert refused.status_code == 429
    assert refused.headers.getlist("Retry-After") == ["60"]
    assert refused.headers.getlist("RateLimit-Policy") == ['"minute";q=1;w=60']


def test_an_errorhandler_that_adds_to_the_refusals_headers_changes_only_its_own(
    limiter: rl.Limiter,
) -> None:
    """The guard renders a flood's 429 once per shape: each RateLimited carries its own
    copy of those headers, so a handler appending to it leaves the next refusal as it was."""
    app = new_app()
    app.add_url_rule("/", "index", lambda: "ok")

    @app.errorhandler(429)
    def too_many(error: RateLimited) -> Any:
        error.ratelimit_headers.append(("X-Seen", "1"))
        return error.get_response()

    RateLimit(app, limiter=limiter, default="1/minute")
    c = app.test_client()
    c.get("/")
    first, second = c.get("/"), c.get("/")
    assert first.status_code == second.status_code == 429
    assert first.headers.getlist("X-Seen") == second.headers.getlist("X-Seen") == ["1"]


def test_shadow_mode_and_on_refusal_in_flask(limiter: rl.Limiter) -> None:
    app = new_app()
    app.add_url_rule("/", "index", lambda: "ok")
    refused: list[str] = []
    RateLimit(app, limiter=limiter, default="1/minute", mode="shadow",
              on_refusal=lambda request, decision: refused.append(request.path))
    c = app.test_client()
    responses = [c.get("/") for _ in range(3)]
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert [r.headers["RateLimit"] for r in responses] == ['"minute";r=0;t=60'] * 3
    assert all("Retry-After" not in r.headers for r in responses)
    assert refused == ["/", "/"]


# -- the backend down ----------------------------------------------------------------------
def failure_app(backend: Any, **options: Any) -> Flask:
    app = new_app()
    app.add_url_rule("/", "index", lambda: "ok", methods=["GET", "POST"])
    RateLimit(app, limiter=rl.Limiter(backend), default="1/minute", **options)
    return app


def test_backend_down_callable_and_errorhandler_503(down_backend: rl.RedisBackend) -> None:
    app = failure_app(down_backend,
                      on_backend_error=lambda request, error: request.method == "GET",
                      backend_cooldown=0)

    @app.errorhandler(503)
    def unavailable(error: BackendUnavailable) -> tuple[str, int]:
        return f"try again in {error.retry_after}", 503

    c = app.test_client()
    assert c.get("/").status_code == 200
    denied = c.post("/")
    assert (denied.status_code, denied.get_data(as_text=True)) == (503, "try again in 1")
    assert denied.headers["Retry-After"] == "1"


@pytest.mark.parametrize("error", [BackendError("down"), RuntimeError("bug"), OSError()])
def test_no_backend_failure_becomes_a_500(error: BaseException) -> None:
    c = failure_app(FailingBackend(error)).test_client()
    assert statuses(c, "/", 3) == [200, 200, 200]


# -- count_when ----------------------------------------------------------------------------
# -- app factory ---------------------------------------------------------------------------
def test_one_extension_serves_many_apps_with_state_per_app(
    limiter: rl.Limiter, prefix: str
) -> None:
    ext = RateLimit(default="1/minute", on_backend_error="deny", backend_cooldown=60)

    def create_app(app_limiter: rl.Limiter) -> Flask:
        app = new_app()
        app.add_url_rule("/", "index", lambda: "ok")
        ext.init_app(app, limiter=app_limiter)
        return app

    down = create_app(rl.Limiter(FailingBackend(BackendError("down"))))
    first = create_app(limiter)
    second = create_app(rl.Limiter(limiter.backend, prefix=prefix + "b",
                                   clock=limiter.clock))
    assert down.test_client().get("/").status_code == 503  # trips this app's breaker only
    assert statuses(first.test_client(), "/", 2) == [200, 429]
    assert statuses(second.test_client(), "/", 2) == [200, 429]
    states = {id(app.extensions[EXTENSION_KEY]) for app in (down, first, second)}
    assert len(states) == 3
    assert not hasattr(ext, "core")


def test_installing_twice_or_without_a_limiter_is_a_configuration_error() -> None:
    app = new_app()
    with pytest.raises(ConfigurationError, match="needs a limiter"):
        RateLimit(app)
    RateLimit(app, limiter=rl.Limiter())
    with pytest.raises(ConfigurationError, match="already installed"):
        RateLimit(app, limiter=rl.Limiter())


@pytest.mark.parametrize("bad, message", [
    (dict(limiter=rl.AsyncLimiter()), "ASGI middleware"),
    (dict(limiter=rl.Limiter(), mode="loud"), "enforce"),
    (dict(limiter=rl.Limiter(), default="ten a minute"), "ten a minute"),
    (dict(limiter=rl.Limiter(), on_blocked=429), "on_blocked"),
])
def test_configuration_mistakes_fail_where_the_extension_is_written(
    bad: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        RateLimit(**bad)


def test_hostile_forwarded_headers_through_flask(limiter: rl.Limiter) -> None:
    app = new_app()
    app.add_url_rule("/", "index", lambda: "ok")
    RateLimit(app, limiter=limiter, default="2/minute",
              key=keys.client_ip(trusted_proxies=["10.0.0.0/8"]))
    c = app.test_client()
    spoofed = [c.get("/", headers={"X-Forwarded-For": f"198.51.100.{i}"}).status_code
               for i in range(3)]
    assert spoofed == [200, 200, 429]  # the peer 127.0.0.1 is not a trusted proxy
    behind_proxy = {"REMOTE_ADDR": "10.0.0.1"}
    garbage = ["\x00", "é" * 10_000, "1.2.3.4," * 5000, "unknown, 10.0.0.2"]
    codes = [c.get("/", headers={"X-Forwarded-For": g},
                   environ_overrides=behind_proxy).status_code for g in garbage]
    assert set(codes) <= {200, 429}
    assert json.loads(c.get("/").data)["retry_after"] == 60


def test_key_functions_see_what_hooks_registered_before_init_app_set(
    limiter: rl.Limiter,
) -> None:
    app = new_app()
    app.add_url_rule("/", "index", lambda: "ok")

    @app.before_request
    def authenticate() -> None:
        flask.g.user = flask.request.headers.get("X-User")

    RateLimit(app, limiter=limiter, default="1/minute",
              key=keys.user(lambda request: flask.g.get("user")))
    c = app.test_client()
    assert statuses(c, "/", 2, headers={"X-User": "ann"}) == [200, 429]
    assert c.get("/", headers={"X-User": "bob"}).status_code == 200
    assert statuses(c, "/", 3) == [200, 200, 200]  # no user: the policy does not apply


# -- what the hooks may get wrong ----------------------------------------------------------
@pytest.mark.parametrize("answer", [None, 42])
def test_an_on_blocked_that_returns_no_response_falls_back_to_the_json_429(
    limiter: rl.Limiter, answer: Any
) -> None:
    # None from before_request is Flask's "go on to the view": the refused request was
    # served; a value Flask cannot render was a 500.
    app, served = new_app(), []

    @app.route("/")
    def index() -> str:
        served.append(1)
        return "served"

    RateLimit(app, limiter=limiter, default="1/minute",
              on_blocked=lambda request, decision: answer)
    client = app.test_client()
    assert statuses(client, "/", 3) == [200, 429, 429]
    assert served == [1]
    refused = client.get("/")
    assert refused.json == {"detail": "Too Many Requests", "retry_after": 60}
    assert refused.headers["Retry-After"] == "60"


def _failing_app(limiter: rl.Limiter, *, propagate: bool, hook_fails: bool) -> Flask:
    app = Flask(__name__)
    app.config["PROPAGATE_EXCEPTIONS"] = propagate

    @app.route("/ok")
    def ok() -> str:
        return "ok"

    @app.route("/boom")
    def boom() -> str:
        raise RuntimeError("the view failed")

    RateLimit(app, limiter=limiter, default="3/minute", count_when=lambda status: status < 500)
    if hook_fails:
        @app.after_request
        def broken(response: Any) -> Any:  # registered after the extension: runs first
            if flask.request.path == "/boom":
                raise RuntimeError("an after_request hook failed")
            return response

    return app


@pytest.mark.parametrize(("propagate", "hook_fails"),
                         [(False, False), (True, False), (False, True)])
def test_a_failed_request_gives_its_hit_back_once_however_it_failed(
    limiter: rl.Limiter, propagate: bool, hook_fails: bool
) -> None:
    # An exception counts as a 500, whose hit count_when gives back: also when the exception
    # propagates (debug mode, app.testing) or a later hook throws the response away, which
    # lost the refund; and never twice, which would give back the admitted /ok too.
    app = _failing_app(limiter, propagate=propagate, hook_fails=hook_fails)
    client = app.test_client()
    assert client.get("/ok").status_code == 200
    for _ in range(4):
        try:
            response = client.get("/boom")
        except RuntimeError:
            continue
        assert response.status_code == 500
        response.close()
    assert limiter.peek(rl.Policy("3/minute"), PEER).remaining == 2


def _late_hook_app(limiter: rl.Limiter, **options: Any) -> Flask:
    """/fail's response is thrown away by an after_request hook that runs after the
    extension's (registered before it), and the exception propagates (as in app.testing)."""
    app = Flask(__name__)
    app.config["PROPAGATE_EXCEPTIONS"] = True

    @app.after_request
    def broken(response: Any) -> Any:
        if flask.request.path == "/fail":
            raise RuntimeError("a later after_request hook failed")
        return response

    @app.route("/ok")
    @app.route("/fail")
    def ok() -> str:
        return "ok"

    RateLimit(app, limiter=limiter, **options)
    return app


def test_a_response_a_later_hook_throws_away_gives_back_as_a_500(limiter: rl.Limiter) -> None:
    # The extension saw the 200, which never went out nor was closed: the request ends as a
    # 500 in teardown (count_when gives that back), as when the view itself raises.
    client = _late_hook_app(limiter, default="3/minute",
                            count_when=lambda status: status < 500).test_client()
    assert client.get("/ok").status_code == 200
    for _ in range(3):
        with pytest.raises(RuntimeError):
            client.get("/fail")
    assert limiter.peek(rl.Policy("3/minute"), PEER).remaining == 2


def test_a_slot_comes_back_when_a_later_hook_throws_the_response_away(
    limiter: rl.Limiter
) -> None:
    client = _late_hook_app(limiter, concurrency=1).test_client()
    for _ in range(2):
        with pytest.raises(RuntimeError):
            client.get("/fail")
    assert client.get("/ok").status_code == 200  # not 429: /fail's slot came back


@pytest.mark.parametrize(("status", "remaining"), [(200, 1), (500, 2)])
def test_a_copied_request_context_ending_is_not_the_requests_end(
    limiter: rl.Limiter, status: int, remaining: int
) -> None:
    # copy_current_request_context: the copy's teardown runs on the same environ, before the
    # view has returned. The request still counts by its own response: its hit is kept for a
    # 200 and given back once for a 500 (twice would give back /ok's too).
    app = Flask(__name__)

    @app.route("/ok")
    def ok() -> str:
        return "ok"

    @app.route("/parallel")
    def parallel() -> Any:
        @flask.copy_current_request_context
        def work() -> None:
            assert flask.request.path == "/parallel"

        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
        return "done", status

    RateLimit(app, limiter=limiter, default="3/minute", count_when=lambda code: code < 500)
    client = app.test_client()
    assert client.get("/ok").status_code == 200
    response = client.get("/parallel")
    assert response.status_code == status
    response.close()
    assert limiter.peek(rl.Policy("3/minute"), PEER).remaining == remaining
