"""The app of transport_burst.py: library defaults on the backend URL in RL_REDIS_URL.

``AsyncRedisBackend.from_url(RL_REDIS_URL)`` and the middleware's defaults, but for
``on_backend_error`` (RL_ON_ERROR: "allow" or "deny"). One default policy, 100/minute per
``X-Client``; ``/block`` holds the event loop for 150 ms first (an app's blocking call). Each
worker runs the documented start-up check in its lifespan. A response says whether a
Decision was made (``decided``): one let through by the failure policy has none.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

LIMIT = 100


def make_app() -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from ratelimit_mw import AsyncLimiter, AsyncRedisBackend, Policy, keys
    from ratelimit_mw.asgi import RateLimitMiddleware

    async def endpoint(request: Request) -> JSONResponse:
        if request.url.path == "/block":
            time.sleep(0.15)
        return JSONResponse({"decided": getattr(request.state, "ratelimit", None) is not None})

    backend = AsyncRedisBackend.from_url(os.environ["RL_REDIS_URL"])

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        await backend.aping()
        yield

    app = Starlette(routes=[Route("/{path:path}", endpoint)], lifespan=lifespan)
    return RateLimitMiddleware(app, AsyncLimiter(backend, prefix=os.environ["RL_PREFIX"]),
                               default=Policy(f"{LIMIT}/minute"), key=keys.header("x-client"),
                               on_backend_error=os.environ.get("RL_ON_ERROR", "allow"))
