"""A Starlette app with WebSocket routes, for uvicorn (``--factory make_app``), on the Redis of
RL_REDIS_URL under RL_PREFIX: the default (2 a minute per client address) on ``/ws``, a
decorated endpoint (1 a minute) on ``/once``, an exempt one on ``/free``, and ``/chat``, whose
messages are limited per connection (10 a second) with `AsyncLimiter.messages`."""

from __future__ import annotations

import os
from typing import Any

from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

import ratelimit_mw as rl
from ratelimit_mw.asgi import RateLimitMiddleware


def make_app() -> Any:
    limiter = rl.AsyncLimiter(rl.AsyncRedisBackend.from_url(os.environ["RL_REDIS_URL"]),
                              prefix=os.environ["RL_PREFIX"])

    async def echo(websocket: WebSocket) -> None:
        await websocket.accept()
        await websocket.send_text("hello")
        await websocket.close()

    @limiter.limit("1/minute")
    async def once(websocket: WebSocket) -> None:
        await echo(websocket)

    @limiter.exempt
    async def free(websocket: WebSocket) -> None:
        await echo(websocket)

    @limiter.exempt  # its handshakes are not counted; its messages are, per connection
    async def chat(websocket: WebSocket) -> None:
        await websocket.accept()
        messages = limiter.messages("10/second")
        async for text in websocket.iter_text():
            decision = await messages.hit()
            if decision:
                await websocket.send_text(f"echo {text}")
            else:
                await websocket.send_json({"error": "slow down",
                                           "retry_after": decision.retry_after})

    async def healthz(request: Any) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = Starlette(routes=[WebSocketRoute("/ws", echo), WebSocketRoute("/once", once),
                            WebSocketRoute("/free", free), WebSocketRoute("/chat", chat),
                            Route("/healthz", limiter.exempt(healthz))])
    return RateLimitMiddleware(app, limiter, default="2/minute")
