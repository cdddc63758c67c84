"""A Starlette app rate-limited by ratelimit_mw.

    uvicorn examples.starlette_app:app        # or: python examples/starlette_app.py
    RATELIMIT_REDIS_URL=redis://localhost:6379/0 uvicorn examples.starlette_app:app
"""

from __future__ import annotations

import os

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

import ratelimit_mw as rl
from ratelimit_mw import keys
from ratelimit_mw.asgi import Config, RateLimitMiddleware, Rule

REDIS_URL = os.environ.get("RATELIMIT_REDIS_URL")
backend = rl.AsyncRedisBackend.from_url(REDIS_URL) if REDIS_URL else rl.MemoryBackend()
limiter = rl.AsyncLimiter(backend, prefix=os.environ.get("RATELIMIT_PREFIX", "demo"))


async def index(request: Request) -> Response:
    """The default limit: 60 a minute per client IP."""
    return JSONResponse({"hello": "world"})


@limiter.limit("5/minute")  # this endpoint: 5 a minute per client, instead of the default
async def search(request: Request) -> Response:
    return JSONResponse({"query": request.query_params.get("q", ""), "results": []})


@limiter.exempt  # never limited
async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def user(request: Request) -> Response:
    # Keyed by route template: /api/users/1 and /api/users/2 share one quota per client.
    return JSONResponse({"user": request.path_params["user_id"],
                         "route": request.scope.get(keys.ROUTE_SCOPE_KEY)})


async def login(request: Request) -> Response:
    return JSONResponse({"token": "demo"})


# Built (and checked) at import time: a mistyped option fails at start-up.
RATE_LIMITS = Config(
    default="60/minute",
    rules=[
        Rule("/login", "5/minute", methods=["POST"]),
        # Each API endpoint its own 30 a minute per client, by route template.
        Rule("/api/*", "30/minute", key=keys.compose(keys.client_ip(), keys.route())),
    ],
)

app = Starlette(
    routes=[
        Route("/", index),
        Route("/search", search),
        Route("/health", health),
        Route("/login", login, methods=["POST"]),
        Mount("/api", routes=[Route("/users/{user_id:int}", user)]),
    ],
    middleware=[Middleware(RateLimitMiddleware, limiter=limiter, config=RATE_LIMITS)],
)


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=8000)
