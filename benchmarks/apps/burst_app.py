"""The app of transport_burst.py: library defaults on the backend URL in RL_REDIS_URL.

``AsyncRedisBackend.from_url(RL_REDIS_URL)`` and the middleware's defaults, but for
``on_backend_error`` (RL_ON_ERROR: "allow" or "deny"). One default policy, RL_LIMIT (100)
a minute per ``X-Client``; ``/block`` holds the event loop for 150 ms first (an app's
blocking call). Each worker runs the documented start-up check in its lifespan. A response
says whether a Decision was made (``decided``): one let through by the failure policy has
none.
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
                               default=Policy(f"{os.environ.get('RL_LIMIT', LIMIT)}/minute"),
                               key=keys.header("x-client"),
                               on_backend_error=os.environ.get("RL_ON_ERROR", "allow"))


async def started(app: Any) -> None:
    """Run the app's lifespan start-up (its start-up check), as a server does first."""
    import asyncio

    messages: asyncio.Queue[dict[str, str]] = asyncio.Queue()
    messages.put_nowait({"type": "lifespan.startup"})
    done = asyncio.get_running_loop().create_future()

    async def send(message: dict[str, Any]) -> None:
        if message["type"].startswith("lifespan.startup") and not done.done():
            done.set_result(message)

    task = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}},
                                   messages.get, send))
    message = await done
    if message["type"] != "lifespan.startup.complete":
        raise RuntimeError(f"start-up failed: {message}")
    task.cancel()


async def in_process(requests: int) -> dict[str, int]:
    """REQUESTS requests at once through the middleware in this process (httpx's ASGI
    transport: no server, no sockets between client and app), on the backend in
    RL_REDIS_URL, after the app's start-up: the statuses counted (-1: an exception)."""
    import asyncio
    import uuid

    import httpx

    app = make_app()
    await started(app)
    identity = uuid.uuid4().hex
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://bench") as client:
        responses = await asyncio.gather(*(client.get("/burst", headers={"x-client": identity})
                                           for _ in range(requests)), return_exceptions=True)
    counts: dict[str, int] = {}
    for response in responses:
        status = -1 if isinstance(response, BaseException) else response.status_code
        counts[str(status)] = counts.get(str(status), 0) + 1
    return counts


if __name__ == "__main__":
    import asyncio
    import json
    import sys

    print(json.dumps(asyncio.run(in_process(int(sys.argv[1])))))
