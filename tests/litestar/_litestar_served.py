"""The Litestar app the multi-worker tests serve (``uvicorn _litestar_served:make_app
--factory --app-dir tests/litestar``), configured by the environment: RL_REDIS_URL,
RL_PREFIX, and RL_LIMITER: ``ratelimit_mw``, or ``litestar`` for Litestar's own
``RateLimitConfig`` on a Redis store shared by every worker.

- ``/burst``: the app's default, 100 a minute per client address;
- ``/handler``: ratelimit_mw only, its own limit, 10 a minute (``@limiter.limit``);
- ``/healthz``: never limited (the server's readiness probe).
"""

from __future__ import annotations

import os
from typing import Any

from litestar import Litestar, get
from litestar.middleware.rate_limit import RateLimitConfig
from litestar.stores.redis import RedisStore

from ratelimit_mw import AsyncLimiter, AsyncRedisBackend
from ratelimit_mw.litestar import RateLimitPlugin

BURST_LIMIT = 100
HANDLER_LIMIT = 10


def make_app() -> Litestar:
    url, prefix = os.environ["RL_REDIS_URL"], os.environ["RL_PREFIX"]
    # Generous timeouts: this proves counting under contention; a slow call must show up as
    # a 503 (deny), never as an admission.
    limiter = AsyncLimiter(AsyncRedisBackend.from_url(url, socket_timeout=5,
                                                      socket_connect_timeout=5), prefix=prefix)

    @get("/healthz", opt={"ratelimit_exempt": True}, signature_namespace={"Any": Any})
    async def healthz() -> str:
        return "ok"

    @get("/burst")
    async def burst() -> dict[str, int]:
        return {"pid": os.getpid()}

    @get("/handler")
    @limiter.limit(f"{HANDLER_LIMIT}/minute")
    async def handler() -> dict[str, int]:
        return {"pid": os.getpid()}

    if os.environ.get("RL_LIMITER") == "litestar":
        theirs = RateLimitConfig(rate_limit=("minute", BURST_LIMIT), exclude=["/healthz"],
                                 store="shared")
        return Litestar([healthz, burst], middleware=[theirs.middleware],
                        stores={"shared": RedisStore.with_client(url, namespace=prefix)},
                        openapi_config=None)
    return Litestar([healthz, burst, handler], openapi_config=None, plugins=[RateLimitPlugin(
        limiter, default=f"{BURST_LIMIT}/minute", on_backend_error="deny",
        backend_timeout=5)])
