"""An ASGI app at the library's defaults, for uvicorn workers (``--factory make_asgi_app``).

Nothing tuned: ``AsyncRedisBackend.from_url(RL_REDIS_URL)`` (100 ms socket timeouts),
``on_backend_error="allow"``, the middleware's 100 ms deadline, the deny cache on. One
default policy, ``LIMIT`` per minute per ``X-Client``. Each response says whether the
request was decided by the store (``decided``: a request let through by the failure policy
carries no Decision) and which worker answered (``pid``). ``/block`` holds the event loop
for 150 ms (``time.sleep``) before answering, as a slow synchronous call in an app does.

Each worker runs the start-up check (``aping()``: connect, load the script on every primary)
in its lifespan, as the documentation recommends, unless RL_STARTUP_CHECK=0: then the first
requests of a fresh worker also pay the connection set-up inside their deadline.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

LIMIT = 100


def make_asgi_app() -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from ratelimit_mw import AsyncLimiter, AsyncRedisBackend, Policy, keys
    from ratelimit_mw.asgi import RateLimitMiddleware

    async def endpoint(request: Request) -> JSONResponse:
        if request.url.path == "/block":
            time.sleep(0.15)  # the whole worker stalls, every request in flight with it
        decided = getattr(request.state, "ratelimit", None) is not None
        return JSONResponse({"decided": decided, "pid": os.getpid()})

    backend = AsyncRedisBackend.from_url(os.environ["RL_REDIS_URL"])

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        if os.environ.get("RL_STARTUP_CHECK", "1") == "1":
            await backend.aping()  # a wrong URL stops the worker here, at deploy time
        yield

    app = Starlette(routes=[Route("/{path:path}", endpoint)], lifespan=lifespan)
    limiter = AsyncLimiter(backend, prefix=os.environ["RL_PREFIX"])
    return RateLimitMiddleware(app, limiter, default=Policy(f"{LIMIT}/minute"),
                               key=keys.header("x-client"))
