"""Hello-world ASGI apps for the throughput benchmark, one per configuration.

uvicorn imports ``bench_asgi_app:app``; the environment picks the configuration:

- ``BENCH_APP``: one of `BUILDERS` (``starlette-bare``, ``starlette-rl-redis``, ...)
- ``BENCH_REDIS_URL``: the Redis every limiter uses
- ``BENCH_PREFIX``: a key prefix of this server's own (its counters are its alone)
- ``BENCH_LIMIT``: the rate every request is checked against (huge: all admitted;
  ``1/hour``: a flood from one client, every request after the first refused)

Every configuration limits every request by client IP, as each library does by default
(all the load comes from 127.0.0.1: one identity), with the fixed-window algorithm, the
default of slowapi and Flask-Limiter, so that all of them do the same work in Redis.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("BENCH_PREFIX", "rlbench")
LIMIT = os.environ.get("BENCH_LIMIT", "1000000000/hour")
ALGORITHM = "fixed-window"

# The naive floor: one INCR (+ EXPIRE on the first hit) in one EVALSHA per request.
FLOOR_SCRIPT = """
local n = redis.call('INCR', KEYS[1])
if n == 1 then redis.call('EXPIRE', KEYS[1], ARGV[1]) end
return n
"""


async def hello(request: Request) -> Response:
    return PlainTextResponse("Hello, world!")


def _starlette(middleware: list[Middleware] | None = None) -> Starlette:
    return Starlette(routes=[Route("/", hello)], middleware=middleware)


def _limit_parts() -> tuple[int, int]:
    from ratelimit_mw import Rate

    rate = Rate.parse(LIMIT)
    return rate.limit, max(1, rate.period_ms // 1000)


def _ratelimit_mw(backend_name: str, concurrency: int | None = None) -> list[Middleware]:
    from ratelimit_mw import AsyncLimiter, AsyncRedisBackend, MemoryBackend, Policy
    from ratelimit_mw.asgi import RateLimitMiddleware

    backend: Any = (AsyncRedisBackend.from_url(REDIS_URL) if backend_name == "redis"
                    else MemoryBackend())
    limiter = AsyncLimiter(backend, prefix=PREFIX)
    return [Middleware(RateLimitMiddleware, limiter=limiter,
                       default=Policy(LIMIT, algorithm=ALGORITHM), concurrency=concurrency)]


class FloorMiddleware:
    """What any Redis-backed limiter must at least do: one EVALSHA on redis.asyncio."""

    def __init__(self, app: Any) -> None:
        import redis.asyncio

        self.app = app
        self.client = redis.asyncio.Redis.from_url(REDIS_URL)
        self.limit, self.window = _limit_parts()
        self.sha: str | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.sha is None:
            self.sha = await self.client.script_load(FLOOR_SCRIPT)
        key = f"{PREFIX}:floor:{scope['client'][0]}"
        count = await self.client.evalsha(self.sha, 1, key, self.window)
        if count > self.limit:
            await PlainTextResponse("Too Many Requests", status_code=429)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _slowapi_app(middleware_name: str) -> Starlette:
    import slowapi.middleware
    from slowapi import Limiter, _rate_limit_exceeded_handler
    from slowapi.errors import RateLimitExceeded
    from slowapi.util import get_remote_address

    limiter = Limiter(key_func=get_remote_address, default_limits=[LIMIT],
                      storage_uri=REDIS_URL, key_prefix=PREFIX, strategy=ALGORITHM)
    app = _starlette([Middleware(getattr(slowapi.middleware, middleware_name))])
    app.state.limiter = limiter
    app.add_exception_handler(RateLimitExceeded, _rate_limit_exceeded_handler)  # type: ignore[arg-type]
    return app


def _fastapi(rate_limited: bool) -> Any:
    from fastapi import FastAPI

    app = FastAPI(middleware=_ratelimit_mw("redis") if rate_limited else None)

    @app.get("/")
    async def root() -> dict[str, str]:
        return {"message": "Hello World"}

    return app


def _litestar(kind: str) -> Any:
    """Litestar bare, with the floor, with ratelimit_mw's plugin, or with its own
    ``RateLimitConfig`` on a Redis store (Litestar's logging off in all four alike)."""
    from litestar import Litestar, get
    from litestar.middleware import DefineMiddleware

    @get("/", media_type="text/plain", sync_to_thread=False)
    def root() -> str:
        return "Hello, world!"

    middleware: list[Any] = []
    options: dict[str, Any] = {}
    if kind == "floor":
        middleware.append(DefineMiddleware(FloorMiddleware))
    elif kind == "rl-redis":
        from ratelimit_mw import AsyncLimiter, AsyncRedisBackend, Policy
        from ratelimit_mw.litestar import RateLimitPlugin

        limiter = AsyncLimiter(AsyncRedisBackend.from_url(REDIS_URL), prefix=PREFIX)
        options["plugins"] = [RateLimitPlugin(limiter,
                                              default=Policy(LIMIT, algorithm=ALGORITHM))]
    elif kind == "own":
        from litestar.middleware.rate_limit import RateLimitConfig
        from litestar.stores.redis import RedisStore

        limit, window = _limit_parts()
        unit = {1: "second", 60: "minute", 3600: "hour", 86400: "day"}[window]
        middleware.append(RateLimitConfig(rate_limit=(unit, limit), store="bench").middleware)  # type: ignore[arg-type]
        options["stores"] = {"bench": RedisStore.with_client(REDIS_URL, namespace=PREFIX)}
    return Litestar([root], middleware=middleware, openapi_config=None, logging_config=None,
                    **options)


BUILDERS: dict[str, Callable[[], Any]] = {
    "starlette-bare": lambda: _starlette(),
    "starlette-floor": lambda: _starlette([Middleware(FloorMiddleware)]),
    "starlette-rl-redis": lambda: _starlette(_ratelimit_mw("redis")),
    "starlette-rl-memory": lambda: _starlette(_ratelimit_mw("memory")),
    # The rate plus an in-flight limit that never binds (more slots than the load's
    # connections): a slot taken in the same call, given back after each response.
    "starlette-rl-inflight": lambda: _starlette(_ratelimit_mw("redis", concurrency=10_000)),
    "starlette-slowapi": lambda: _slowapi_app("SlowAPIMiddleware"),
    "starlette-slowapi-asgi": lambda: _slowapi_app("SlowAPIASGIMiddleware"),
    "fastapi-bare": lambda: _fastapi(False),
    "fastapi-rl-redis": lambda: _fastapi(True),
    "litestar-bare": lambda: _litestar("bare"),
    "litestar-floor": lambda: _litestar("floor"),
    "litestar-rl-redis": lambda: _litestar("rl-redis"),
    "litestar-own": lambda: _litestar("own"),
}

app = BUILDERS[os.environ.get("BENCH_APP", "starlette-bare")]()
