"""FastAPI's generated OpenAPI schema documents the 429 (with Retry-After and the RateLimit
headers) of every operation a limit applies to, and of no other."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import APIRouter, Depends, FastAPI
from starlette.testclient import TestClient

import ratelimit_mw as rl
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
