"""docs/migration.md, row by row: the ratelimit_mw column of "Spelling" does what it says, and
so does each point of "What means something different". Each test names its row; apps are
small Starlette, FastAPI and Flask apps on the memory backend (Redis where the row is about
a store)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from flask import Flask
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

import ratelimit_mw as rl
from ratelimit_mw import keys
from ratelimit_mw.asgi import Config, RateLimitMiddleware, Rule
from ratelimit_mw.backends import urls
from ratelimit_mw.flask import RateLimit, RateLimited
from tests.conftest import REDIS_URL


async def ok(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


_made = iter(range(10**6))


def fresh() -> Callable[..., Any]:
    """An endpoint of its own: decorators mark the function, and name counters after it."""
    async def endpoint(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    endpoint.__qualname__ = f"endpoint{next(_made)}"
    return endpoint


def starlette(limiter: rl.AsyncLimiter, routes: dict[str, Callable[..., Any]] | None = None,
              **options: Any) -> TestClient:
    """A Starlette app of the given routes (default: / and /other) behind the middleware."""
    routes = routes or {"/": ok, "/other": ok}
    app = Starlette(routes=[Route(path, endpoint, methods=["GET", "POST", "HEAD"])
                            for path, endpoint in routes.items()])
    return TestClient(RateLimitMiddleware(app, limiter, **options))


def statuses(client: Any, count: int, path: str = "/", method: str = "GET",
             **headers: str) -> list[int]:
    if isinstance(client, TestClient):
        return [client.request(method, path, headers=headers).status_code
                for _ in range(count)]
    return [client.open(path, method=method, headers=headers).status_code  # Flask's
            for _ in range(count)]


# -- Spelling ---------------------------------------------------------------------------------
def test_slowapi_setup_is_add_middleware_with_a_config() -> None:
    from fastapi import FastAPI

    limiter = rl.AsyncLimiter()
    app = FastAPI()
    app.add_middleware(RateLimitMiddleware, limiter=limiter, config=Config(default="1/minute"))

    @app.get("/")
    async def root() -> dict[str, str]:
        return {}

    with TestClient(app) as client:
        assert statuses(client, 2) == [200, 429]


def test_flask_limiter_setup_is_ratelimit_or_init_app() -> None:
    for style in ("direct", "init_app"):
        app = Flask(style)
        app.add_url_rule("/", "root", lambda: "ok")
        limiter = rl.Limiter()
        if style == "direct":
            RateLimit(app, limiter=limiter, default="1/minute")
        else:
            RateLimit(limiter=limiter, default="1/minute").init_app(app)
        assert statuses(app.test_client(), 2) == [200, 429]


def test_key_func_get_remote_address_is_the_default_client_ip() -> None:
    client = starlette(rl.AsyncLimiter(), default="1/minute")
    assert statuses(client, 2) == [200, 429]
    other = TestClient(client.app, client=("203.0.113.9", 1234))
    assert statuses(other, 1) == [200]


def test_a_decorators_key_func_is_key_taking_the_request() -> None:
    limiter = rl.AsyncLimiter()
    seen: list[str] = []

    def by_header(request: Request) -> str:
        seen.append(type(request).__name__)
        return "k:" + request.headers.get("x-k", "")

    client = starlette(limiter, {"/": limiter.limit("1/minute", key=by_header)(fresh())})
    assert statuses(client, 2, **{"x-k": "a"}) + statuses(client, 1, **{"x-k": "b"}) == [
        200, 429, 200]
    assert seen[0] == "Request"


@pytest.mark.parametrize(("url", "kind"), [
    ("redis://host:6379/0", "redis"), ("memory://", "memory"),
    ("redis+cluster://10.0.0.1:7000", "cluster"),
    ("redis+sentinel://h1:26379,h2:26379/mymaster", "sentinel"),
    ("rediss://:pw@redis.example.com:6380/0", "redis"), ("unix:///run/redis.sock", "redis"),
])
def test_storage_uri_is_the_same_url_in_from_url(url: str, kind: str) -> None:
    assert urls.parse(url).kind == kind
    if kind == "memory":
        assert isinstance(rl.RedisBackend.from_url(url), rl.MemoryBackend)
        assert isinstance(rl.Limiter().backend, rl.MemoryBackend)


def test_storage_uri_memcached_is_not_built() -> None:
    with pytest.raises(rl.ConfigurationError, match="memory://"):
        rl.RedisBackend.from_url("memcached://127.0.0.1:11211")


def test_key_prefix_is_the_limiters_prefix() -> None:
    backend = rl.RedisBackend.from_url(REDIS_URL)
    limiter = rl.Limiter(backend, prefix="myappmig")
    limiter.hit("1/minute", "u")
    try:
        assert list(backend.client.scan_iter("myappmig:*"))
    finally:
        limiter.reset("1/minute", "u")
        backend.close()


@pytest.mark.parametrize(("strategy", "algorithm"), [
    ("fixed-window", "fixed-window"), ("moving-window", "sliding-log"),
    ("sliding-window-counter", "sliding-window"),
])
def test_strategy_is_algorithm(strategy: str, algorithm: str) -> None:
    assert rl.Policy("1/second", algorithm=algorithm).algorithm == algorithm  # type: ignore[arg-type]
    assert rl.Policy("1/second").algorithm == "sliding-log"  # moving-window is the default


def test_tier_separators_read_as_in_limits() -> None:
    expected = rl.Policy("10/minute;100/hour").rates
    for text in ("10/minute, 100/hour", "10/minute|100/hour", "1/second;10/minute"):
        assert len(rl.Policy(text).rates) == 2
    assert rl.Policy("10/minute, 100/hour").rates == expected


def test_default_limits_is_one_budget_across_routes_unless_keyed_by_route() -> None:
    across = starlette(rl.AsyncLimiter(), default="2/minute")
    assert statuses(across, 1, "/") + statuses(across, 2, "/other") == [200, 200, 429]
    per_route = starlette(rl.AsyncLimiter(), default="2/minute",
                          key=keys.compose(keys.client_ip(), keys.route()))
    assert statuses(per_route, 2, "/") + statuses(per_route, 2, "/other") == [200] * 4


def test_application_limits_is_the_default() -> None:
    client = starlette(rl.AsyncLimiter(), default="1000/hour;2/minute")
    assert statuses(client, 1, "/") + statuses(client, 1, "/other") + statuses(client, 1) == [
        200, 200, 429]


def test_the_decorator_is_the_same_and_needs_no_request_parameter() -> None:
    from fastapi import FastAPI

    limiter = rl.AsyncLimiter()
    app = FastAPI()
    app.add_middleware(RateLimitMiddleware, limiter=limiter)

    @app.get("/search")
    @limiter.limit("1/minute")
    async def search() -> dict[str, str]:
        return {}

    with TestClient(app) as client:
        assert statuses(client, 2, "/search") == [200, 429]


def test_override_defaults_false_is_a_rule_that_adds() -> None:
    client = starlette(rl.AsyncLimiter(), default="3/minute",
                       rules=[Rule("/other", "1/second")])
    assert statuses(client, 2, "/other") == [200, 429]
    # The default counted /other's admitted hit (not its refused one): two left.
    assert statuses(client, 3, "/") == [200, 200, 429]


def test_cost_is_cost() -> None:
    limiter = rl.AsyncLimiter()
    client = starlette(limiter, {"/": limiter.limit("3/minute", cost=2)(fresh())})
    assert statuses(client, 2) == [200, 429]


def test_shared_limit_is_name() -> None:
    limiter = rl.AsyncLimiter()
    client = starlette(limiter, {"/": limiter.limit("2/minute", name="mysql")(fresh()),
                                 "/other": limiter.limit("2/minute", name="mysql")(fresh())})
    assert statuses(client, 1, "/") + statuses(client, 2, "/other") == [200, 200, 429]


def test_exempt_drops_the_default_and_rules_still_apply() -> None:
    limiter = rl.AsyncLimiter()
    client = starlette(limiter, {"/": limiter.exempt(fresh())}, default="1/minute",
                       rules=[Rule("/", "2/minute")])
    assert statuses(client, 3) == [200, 200, 429]


def test_exempt_when_on_the_middleware_a_rule_and_a_decorator() -> None:
    admin = {"x-admin": "yes"}

    def is_admin(request: Request) -> bool:
        return request.headers.get("x-admin") == "yes"

    limiter = rl.AsyncLimiter()
    client = starlette(limiter, {"/": limiter.limit("1/minute", exempt_when=is_admin)(fresh()),
                                 "/other": ok},
                       rules=[Rule("/other", "1/minute", exempt_when=is_admin)])
    assert statuses(client, 3, "/", **admin) + statuses(client, 3, "/other", **admin) == [
        200] * 6
    everywhere = starlette(rl.AsyncLimiter(), default="1/minute", exempt_when=is_admin)
    assert statuses(everywhere, 3, **admin) == [200] * 3


def test_methods_is_methods() -> None:
    limiter = rl.AsyncLimiter()
    client = starlette(limiter, {"/": limiter.limit("1/minute", methods=["POST"])(fresh())})
    assert statuses(client, 3) == [200] * 3
    assert statuses(client, 2, method="POST") == [200, 429]


def test_default_limits_per_method_is_per_method_and_head_counts_as_get() -> None:
    client = starlette(rl.AsyncLimiter(), default="1/minute", per_method=True)
    assert statuses(client, 1) + statuses(client, 1, method="POST") == [200, 200]
    assert statuses(client, 1, method="HEAD") == [429]


def test_default_limits_exempt_when_has_no_exact_counterpart() -> None:
    # exempt_when on the middleware skips the rules as well, not only the default.
    client = starlette(rl.AsyncLimiter(), default="1/minute", rules=[Rule("/", "1/minute")],
                       exempt_when=lambda request: True)
    assert statuses(client, 3) == [200] * 3


def test_dynamic_limits_are_a_callable_per_request() -> None:
    limiter = rl.AsyncLimiter()

    def plan(request: Request) -> str | None:
        return {"paid": "3/minute", "free": "1/minute"}.get(request.headers.get("x-plan", ""))

    client = starlette(limiter, {"/": limiter.limit(plan)(fresh())})
    assert statuses(client, 2, **{"x-plan": "free"}) == [200, 429]
    assert statuses(client, 3, **{"x-plan": "paid"}) == [200, 200, 200]
    assert statuses(client, 3) == [200] * 3  # None: no limit of that kind


def test_deduct_when_is_count_when_where_the_limit_is() -> None:
    async def login(request: Request) -> PlainTextResponse:
        return PlainTextResponse("no", status_code=int(request.query_params.get("s", 200)))

    client = starlette(rl.AsyncLimiter(), {"/": login}, default="100/minute",
                       rules=[Rule("/", "2/minute", count_when=lambda status: status >= 400)])
    assert statuses(client, 3, "/?s=200") == [200] * 3
    assert statuses(client, 3, "/?s=401") == [401, 401, 429]


def test_headers_enabled_is_on_by_default_and_legacy_headers_adds_x_ratelimit() -> None:
    client = starlette(rl.AsyncLimiter(), default="5/minute", legacy_headers=True)
    response = client.get("/")
    assert response.headers["ratelimit"] == '"minute";r=4;t=60'
    assert response.headers["x-ratelimit-limit"] == "5"
    assert response.headers["x-ratelimit-remaining"] == "4"


def test_the_exception_handler_is_built_in_and_on_blocked_replaces_it() -> None:
    client = starlette(rl.AsyncLimiter(), default="1/minute")
    client.get("/")
    assert client.get("/").json() == {"detail": "Too Many Requests", "retry_after": 60}
    own = starlette(rl.AsyncLimiter(), default="1/minute",
                    on_blocked=lambda request, decision: JSONResponse({"mine": True}, 429))
    own.get("/")
    refused = own.get("/")
    assert refused.json() == {"mine": True} and refused.headers["retry-after"] == "60"


def test_flasks_errorhandler_429_receives_ratelimited_with_the_decision() -> None:
    app = Flask("handler")
    app.add_url_rule("/", "root", lambda: "ok")

    @app.errorhandler(429)
    def handler(error: RateLimited) -> tuple[str, int]:
        return f"wait {error.retry_after}", 429

    RateLimit(app, limiter=rl.Limiter(), default="1/minute")
    client = app.test_client()
    client.get("/")
    refused = client.get("/")
    assert refused.get_data() == b"wait 60" and refused.headers["Retry-After"] == "60"


def test_swallow_errors_is_on_backend_error_allow_by_default_or_deny() -> None:
    from support import failing_backend

    down = failing_backend(rl.BackendError("down"))
    allow = starlette(rl.AsyncLimiter(down), default="1/minute")  # type: ignore[arg-type]
    deny = starlette(rl.AsyncLimiter(down), default="1/minute",  # type: ignore[arg-type]
                     on_backend_error="deny")
    assert statuses(allow, 2) == [200, 200] and statuses(deny, 1) == [503]


def test_in_memory_fallback_is_on_backend_error_memory() -> None:
    from support import failing_backend

    down = failing_backend(rl.BackendError("down"))
    client = starlette(rl.AsyncLimiter(down), default="1/minute",  # type: ignore[arg-type]
                       on_backend_error="memory")
    assert statuses(client, 2) == [200, 429]


def test_reset_is_one_identity_under_one_policy() -> None:
    limiter = rl.Limiter()
    limiter.hit("1/minute", "u")
    limiter.hit("1/minute", "v")
    limiter.reset("1/minute", "u")
    assert limiter.hit("1/minute", "u").allowed and not limiter.hit("1/minute", "v").allowed


def test_flask_limiters_ratelimit_config_keys_are_not_read() -> None:
    app = Flask("config")
    app.config["RATELIMIT_DEFAULT"] = "1/minute"
    app.add_url_rule("/", "root", lambda: "ok")
    RateLimit(app, limiter=rl.Limiter())
    assert statuses(app.test_client(), 3) == [200] * 3


def test_enabled_false_and_ratelimit_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    assert statuses(starlette(rl.AsyncLimiter(), default="1/minute", enabled=False), 3) == [
        200] * 3
    monkeypatch.setenv("RATELIMIT_ENABLED", "false")
    assert statuses(starlette(rl.AsyncLimiter(), default="1/minute"), 3) == [200] * 3


# -- What means something different -----------------------------------------------------------
def test_refused_hits_are_not_counted() -> None:
    limiter = rl.Limiter(deny_cache=0)
    policy = rl.Policy("1/second;3/minute", algorithm="fixed-window")
    limiter.hit(policy, "u")
    for _ in range(10):
        assert not limiter.hit(policy, "u").allowed  # refused by 1/second
    assert limiter.peek(policy, "u").tiers[1].remaining == 2  # 3/minute spent one, not 11


def test_windows_are_aligned_to_the_epoch() -> None:
    clock = [1_800_000_030.0]  # half a minute into a minute
    limiter = rl.Limiter(clock=lambda: clock[0])
    policy = rl.Policy("1/minute", algorithm="fixed-window")
    limiter.hit(policy, "u")
    assert limiter.hit(policy, "u").retry_after == 30.0  # to the boundary, not a full minute


def test_a_missing_framework_says_which_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from ratelimit_mw.http import extras

    real = importlib.util.find_spec
    monkeypatch.setattr(extras.importlib.util, "find_spec",
                        lambda name, *a: None if name == "starlette" else real(name, *a))
    with pytest.raises(ImportError, match=r"pip install 'ratelimit_mw\[starlette\]'"):
        extras.require("starlette", "starlette", "ratelimit_mw.asgi")


def test_counters_are_never_shared_by_accident() -> None:
    limiter = rl.AsyncLimiter()
    client = starlette(limiter, {"/": limiter.limit("1/minute")(fresh()),
                                 "/other": limiter.limit("1/minute")(fresh())})
    assert statuses(client, 1, "/") + statuses(client, 1, "/other") == [200, 200]


def test_decorators_only_attach_metadata() -> None:
    limiter = rl.AsyncLimiter()
    app = Starlette(routes=[Route("/", limiter.limit("1/minute")(fresh()))])
    assert statuses(TestClient(app), 3) == [200] * 3  # no middleware: nothing enforces
