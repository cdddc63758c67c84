"""FastAPI's generated OpenAPI schema documents the 429 (with Retry-After and the RateLimit
headers) of every operation a limit applies to, and of no other."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import APIRouter, Depends, FastAPI
from starlette.testclient import TestClient

import ratelimit_mw as rl
from ratelimit_mw import asgi
from ratelimit_mw.asgi import RateLimitMiddleware
from ratelimit_mw.fastapi import RateLimitDependency, document_rate_limits

# A route of two methods: FastAPI warns that both operations share one operationId.
pytestmark = pytest.mark.filterwarnings("ignore:Duplicate Operation ID")


def build(limiter: rl.AsyncLimiter) -> FastAPI:
    app = FastAPI()
    router = APIRouter(prefix="/v1")

    @app.get("/decorated")
    @limiter.limit("5/minute")
    async def decorated() -> dict[str, Any]:
        return {}

    @app.api_route("/posts", methods=["GET", "POST"])
    @limiter.limit("5/minute", methods=["POST"])
    async def posts() -> dict[str, Any]:
        return {}

    @app.get("/plain")
    async def plain() -> dict[str, Any]:
        return {}

    @app.get("/health")
    @limiter.exempt
    async def health() -> dict[str, Any]:
        return {}

    @router.get("/depends/{id}", dependencies=[Depends(RateLimitDependency(limiter, "1/second"))])
    async def depends(id: int) -> dict[str, Any]:
        return {}

    app.include_router(router)
    return app


def documented(app: Any, middleware: bool, **options: Any) -> set[tuple[str, str]]:
    served = RateLimitMiddleware(app, app.state.limiter, **options) if middleware else app
    with TestClient(served) as client:
        schema = client.get("/openapi.json").json()
    return {(path, method) for path, operations in schema["paths"].items()
            for method, operation in operations.items() if "429" in operation["responses"]}


def test_decorated_routes_and_the_dependency_document_their_429() -> None:
    limiter = rl.AsyncLimiter()
    app = build(limiter)
    app.state.limiter = limiter
    assert documented(app, middleware=True) == {
        ("/decorated", "get"), ("/posts", "post"), ("/v1/depends/{id}", "get")}


def test_the_middleware_default_documents_every_operation_it_limits() -> None:
    limiter = rl.AsyncLimiter()
    app = build(limiter)
    app.state.limiter = limiter
    assert documented(app, middleware=True, default="100/minute") == {
        ("/decorated", "get"), ("/posts", "get"), ("/posts", "post"), ("/plain", "get"),
        ("/v1/depends/{id}", "get")}  # /health is exempt


def test_an_app_with_the_dependency_alone_documents_with_one_call() -> None:
    limiter = rl.AsyncLimiter()
    app = document_rate_limits(build(limiter))
    with TestClient(app) as client:
        schema = client.get("/openapi.json").json()
    operation = schema["paths"]["/v1/depends/{id}"]["get"]
    refused = operation["responses"]["429"]
    assert set(refused["headers"]) == {"Retry-After", "RateLimit", "RateLimit-Policy"}
    assert refused["content"]["application/json"]["schema"]["properties"]["retry_after"] == {
        "type": "integer"}
    assert "429" not in schema["paths"]["/plain"]["get"]["responses"]
    assert document_rate_limits(app) is app  # once is enough


def limited_operations(schema: dict[str, Any]) -> set[tuple[str, str]]:
    return {(path, method) for path, operations in schema["paths"].items()
            for method, operation in operations.items() if "429" in operation["responses"]}


def test_a_schema_exported_before_any_request_documents_the_429() -> None:
    """A script generating clients calls app.openapi() on an app that never served: the
    middleware added with add_middleware is not built yet (Starlette builds it on the
    first request), and its default and rules count all the same."""
    limiter = rl.AsyncLimiter()
    app = build(limiter)
    app.add_middleware(RateLimitMiddleware, limiter=limiter,
                       rules=[asgi.Rule("/plain", "10/minute")])
    assert limited_operations(app.openapi()) == {
        ("/decorated", "get"), ("/posts", "post"), ("/plain", "get"),
        ("/v1/depends/{id}", "get")}  # not /health (exempt) nor GET /posts (POST only)
    assert app.middleware_stack is None  # nothing served, nothing built


def test_a_schema_rebuilt_for_routes_added_later_documents_them_too() -> None:
    limiter = rl.AsyncLimiter()
    app = build(limiter)
    app.add_middleware(RateLimitMiddleware, limiter=limiter)
    with TestClient(app) as client:
        assert ("/decorated", "get") in limited_operations(client.get("/openapi.json").json())

        @app.get("/later")
        @limiter.limit("5/minute")
        async def later() -> dict[str, Any]:
            return {}

        assert ("/later", "get") in limited_operations(client.get("/openapi.json").json())


def test_an_app_s_own_openapi_function_is_documented_once_it_says_so() -> None:
    """FastAPI's recipe for a customised schema replaces app.openapi; document_rate_limits
    then wraps that function, and the middleware's default counts before any request."""
    from fastapi.openapi.utils import get_openapi

    limiter = rl.AsyncLimiter()
    app = build(limiter)
    app.add_middleware(RateLimitMiddleware, limiter=limiter, default="100/minute")

    def custom_openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = get_openapi(title="custom", version="1", routes=app.routes)
        return app.openapi_schema

    app.openapi = custom_openapi  # type: ignore[method-assign]
    document_rate_limits(app)
    assert limited_operations(app.openapi()) == {
        ("/decorated", "get"), ("/posts", "get"), ("/posts", "post"), ("/plain", "get"),
        ("/v1/depends/{id}", "get")}
