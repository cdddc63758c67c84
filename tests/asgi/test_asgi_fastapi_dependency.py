"""The FastAPI dependency form: Depends(RateLimitDependency(limiter, "2/minute"))."""

# No "from __future__ import annotations": FastAPI resolves the endpoints' annotations,
# which name local dependencies, at runtime.

from typing import Annotated, Any

import pytest
from fastapi import APIRouter, Depends, FastAPI, Request
from starlette.testclient import TestClient
from support import CountingBackend

import ratelimit_mw as rl
from ratelimit_mw import ConfigurationError, keys
from ratelimit_mw.fastapi import (
    RateLimitDependency,
    RateLimitHTTPException,
    rate_limit_exception_handler,
)


def make_app(limit: RateLimitDependency, *, handler: bool = True) -> FastAPI:
    app = FastAPI()
    if handler:
        app.add_exception_handler(RateLimitHTTPException, rate_limit_exception_handler)

    @app.get("/a", dependencies=[Depends(limit)])
    async def route_a() -> dict[str, Any]:
        return {"route": "a"}

    @app.get("/b")
    def route_b(decision: Annotated[rl.Decision | None, Depends(limit)]) -> dict[str, Any]:
        return {"remaining": None if decision is None else decision.remaining}

    @app.get("/state", dependencies=[Depends(limit)])
    async def state(request: Request) -> dict[str, Any]:
        return {"allowed": request.state.ratelimit.allowed}

    return app


def test_admits_the_limit_then_raises_a_429_like_the_middleware(alimiter, serve):
    client = serve(make_app(RateLimitDependency(alimiter, "2/minute")))
    admitted = [client.get("/a") for _ in range(2)]
    refused = client.get("/a")

    assert [r.status_code for r in admitted] == [200, 200]
    assert [r.headers["ratelimit"] for r in admitted] == [
        '"minute";r=1;t=60', '"minute";r=0;t=60',
    ]
    assert admitted[0].headers["ratelimit-policy"] == '"minute";q=2;w=60'
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "60"
    assert refused.headers["cache-control"] == "no-store"
    assert refused.headers["ratelimit"] == '"minute";r=0;t=60'
    assert refused.json() == {"detail": "Too Many Requests", "retry_after": 60}


def test_without_the_handler_fastapi_answers_the_same_status_and_headers(alimiter, serve):
    client = serve(make_app(RateLimitDependency(alimiter, "1/minute"), handler=False))
    client.get("/a")
    refused = client.get("/a")

    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "60"
    assert refused.json() == {"detail": "Too Many Requests"}


def test_each_endpoint_counts_apart_unless_the_dependency_is_named(alimiter, serve):
    per_route = RateLimitDependency(alimiter, "1/minute")
    shared = RateLimitDependency(alimiter, "1/minute", name="shared")
    app = FastAPI()

    @app.get("/x", dependencies=[Depends(per_route)])
    def x() -> dict[str, Any]:
        return {}

    @app.get("/y", dependencies=[Depends(per_route)])
    def y() -> dict[str, Any]:
        return {}

    @app.get("/s1", dependencies=[Depends(shared)])
    def s1() -> dict[str, Any]:
        return {}

    @app.get("/s2", dependencies=[Depends(shared)])
    def s2() -> dict[str, Any]:
        return {}

    client = serve(app)
    assert [client.get(p).status_code for p in ("/x", "/y", "/x")] == [200, 200, 429]
    assert [client.get(p).status_code for p in ("/s1", "/s2")] == [200, 429]


def test_the_dependency_returns_the_decision_and_leaves_it_in_state(alimiter, serve):
    client = serve(make_app(RateLimitDependency(alimiter, "3/minute")))
    assert client.get("/b").json() == {"remaining": 2}
    assert client.get("/state").json() == {"allowed": True}


def test_a_router_wide_dependency_with_route_keys_sees_the_include_prefix(alimiter, serve):
    seen: list[str] = []

    def key(request: Any) -> str:
        identity = keys.route()(request)
        seen.append(identity)
        return identity

    router = APIRouter(dependencies=[Depends(RateLimitDependency(alimiter, "5/minute",
                                                                 key=key, name="api"))])

    @router.get("/items/{item_id}")
    async def item(item_id: int) -> dict[str, Any]:
        return {}

    app = FastAPI()
    app.include_router(router, prefix="/api")
    client = serve(app)
    client.get("/api/items/1")
    client.get("/api/items/2")
    assert seen == ["route:/api/items/{item_id}"] * 2


def test_key_and_cost_functions_are_used(alimiter, serve):
    limit = RateLimitDependency(alimiter, "5/minute",
                                key=lambda request: request.headers.get("x-user"),
                                cost=lambda request: int(request.query_params.get("n", "1")))
    client = serve(make_app(limit))
    assert client.get("/a?n=3", headers={"x-user": "ann"}).headers["ratelimit"] == \
        '"minute";r=2;t=60'
    assert client.get("/a?n=3", headers={"x-user": "ann"}).status_code == 429
    assert client.get("/a?n=3", headers={"x-user": "bob"}).status_code == 200
    anonymous = client.get("/a")  # key None: the policy does not apply
    assert anonymous.status_code == 200
    assert "ratelimit" not in anonymous.headers


def test_shadow_mode_never_raises_and_reports_the_refusal(alimiter, serve):
    refusals: list[rl.Decision] = []
    client = serve(make_app(RateLimitDependency(
        alimiter, "1/minute", mode="shadow",
        on_refusal=lambda request, decision: refusals.append(decision))))
    statuses = [client.get("/a").status_code for _ in range(3)]
    last = client.get("/a")

    assert statuses == [200, 200, 200]
    assert last.headers["ratelimit"] == '"minute";r=0;t=60'
    assert "retry-after" not in last.headers
    assert len(refusals) == 3


def test_enabled_false_turns_the_dependency_off(alimiter, serve):
    client = serve(make_app(RateLimitDependency(alimiter, "1/minute", enabled=False)))
    answers = [client.get("/b") for _ in range(3)]
    assert [r.status_code for r in answers] == [200, 200, 200]
    assert [r.json() for r in answers] == [{"remaining": None}] * 3
    assert "ratelimit" not in answers[0].headers


@pytest.mark.parametrize(("on_error", "status"), [("allow", 200), ("deny", 503)])
def test_a_backend_failure_follows_on_backend_error(on_error, status):
    backend = CountingBackend()
    backend.failure = rl.BackendError("down")
    limit = RateLimitDependency(rl.AsyncLimiter(backend), "1/minute",
                                on_backend_error=on_error, backend_cooldown=60)
    with TestClient(make_app(limit)) as client:
        responses = [client.get("/b") for _ in range(3)]

    assert [r.status_code for r in responses] == [status] * 3
    assert backend.calls == 1  # the cool-down skipped the backend afterwards
    if status == 503:
        assert responses[0].headers["retry-after"] == "60"
        assert responses[0].json() == {"detail": "Rate limiter unavailable", "retry_after": 60}
    else:
        assert responses[0].json() == {"remaining": None}


@pytest.mark.parametrize(("args", "options", "message"), [
    (("5 a minute",), {}, "cannot read the rate"),
    ((rl.Policy("5/minute"),), {"name": "x"}, "already named"),
    ((42,), {}, "rate string"),
    (("5/minute",), {"cost": 6}, "exceeds the limit"),
    (("5/minute",), {"mode": "audit"}, "enforce"),
    (("5/minute",), {"backend_timeout": 0}, "backend_timeout"),
    # The middleware's own options: a dependency could only ignore them.
    (("5/minute",), {"default": "1/second"}, "belong to the middleware"),
    (("5/minute",), {"count_when": lambda status: True}, "belong to the middleware"),
    (("5/minute",), {"on_blocked": lambda request, decision: None}, "add_exception_handler"),
    (("5/minute",), {"per_method": True}, "its own RateLimitDependency"),
    (("5/minute",), {"charge_method_not_allowed": True}, "before any dependency runs"),
])
def test_bad_options_fail_at_construction(args, options, message):
    with pytest.raises(ConfigurationError, match=message):
        RateLimitDependency(rl.AsyncLimiter(), *args, **options)


def test_a_sync_limiter_is_refused_with_a_hint():
    with pytest.raises(ConfigurationError, match="AsyncLimiter"):
        RateLimitDependency(rl.Limiter(), "5/minute")  # type: ignore[arg-type]
