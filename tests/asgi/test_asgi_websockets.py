"""WebSocket handshakes through the ASGI middleware: each is one hit, selected as a GET to its
path; a refused one is answered before accept. Through real uvicorn with a real WebSocket
client (the server offers the denial-response extension: a 429 with Retry-After), and in
process without the extension (a close with code 1008 that says when to retry)."""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from reliability._support import AppServer, free_port
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

import ratelimit_mw as rl
from ratelimit_mw.asgi import RateLimitMiddleware
from tests.conftest import REDIS_URL, forget_prefix


@pytest.fixture(scope="module")
def server() -> Iterator[AppServer]:
    prefix = "ws" + uuid.uuid4().hex[:8]
    port = free_port()
    app = AppServer([sys.executable, "-m", "uvicorn", "asgi._ws_app:make_app", "--factory",
                     "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
                    {"RL_REDIS_URL": REDIS_URL, "RL_PREFIX": prefix}, port)
    try:
        yield app
    finally:
        app.stop()
        forget_prefix(prefix)


def handshake(server: AppServer, path: str) -> int | str:
    """The greeting of an accepted connection, or the status of a refused handshake."""
    try:
        with connect(f"ws://127.0.0.1:{server.port}{path}", open_timeout=10) as websocket:
            return str(websocket.recv(timeout=10))
    except InvalidStatus as refused:
        return refused.response.status_code


def test_handshakes_are_limited_like_gets_and_refused_with_a_429(server: AppServer) -> None:
    assert [handshake(server, "/ws") for _ in range(3)] == ["hello", "hello", 429]
    try:
        with connect(f"ws://127.0.0.1:{server.port}/ws", open_timeout=10):
            pytest.fail("a refused handshake was accepted")
    except InvalidStatus as refused:
        headers = refused.response.headers
        assert int(headers["Retry-After"]) >= 1
        assert headers["RateLimit-Policy"].endswith(";q=2;w=60")
        assert json.loads(refused.response.body)["retry_after"] >= 1


def test_a_decorated_endpoint_has_its_limit_and_an_exempt_one_none(server: AppServer) -> None:
    assert [handshake(server, "/once") for _ in range(2)] == ["hello", 429]
    assert [handshake(server, "/free") for _ in range(4)] == ["hello"] * 4


def test_messages_are_limited_per_connection(server: AppServer) -> None:
    for _ in range(2):  # a second connection has a budget of its own
        with connect(f"ws://127.0.0.1:{server.port}/chat", open_timeout=10) as websocket:
            answers = []
            for n in range(12):
                websocket.send(f"m{n}")
                answers.append(websocket.recv(timeout=10))
        assert answers[:10] == [f"echo m{n}" for n in range(10)]
        assert [json.loads(a)["error"] for a in answers[10:]] == ["slow down"] * 2


async def _handshake_in_process(app: Any, extensions: dict[str, Any]) -> list[Any]:
    sent: list[Any] = []
    incoming = [{"type": "websocket.connect"}]

    async def receive() -> Any:
        return incoming.pop(0) if incoming else {"type": "websocket.disconnect"}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "websocket", "path": "/ws", "root_path": "", "query_string": b"",
             "headers": [], "client": ("203.0.113.5", 5000), "extensions": extensions}
    await app(scope, receive, send)
    return sent


async def test_without_the_extension_a_refused_handshake_is_a_close_1008() -> None:
    async def accepting(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "websocket.accept"})

    app = RateLimitMiddleware(accepting, rl.AsyncLimiter(), default="1/minute")
    assert await _handshake_in_process(app, {}) == [{"type": "websocket.accept"}]
    refused = await _handshake_in_process(app, {})
    assert refused == [{"type": "websocket.close", "code": 1008,
                        "reason": "rate limited; retry after 60 s"}]
    denied = await _handshake_in_process(app, {"websocket.http.response": {}})
    assert [m["type"] for m in denied] == ["websocket.http.response.start",
                                           "websocket.http.response.body"]
    assert denied[0]["status"] == 429


async def test_websockets_false_leaves_handshakes_alone() -> None:
    async def accepting(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "websocket.accept"})

    app = RateLimitMiddleware(accepting, rl.AsyncLimiter(), default="1/minute",
                              websockets=False)
    for _ in range(3):
        assert await _handshake_in_process(app, {}) == [{"type": "websocket.accept"}]


async def test_hooks_see_the_handshake_as_a_get() -> None:
    async def accepting(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "websocket.accept"})

    seen: list[str] = []

    def by_method(request: Any) -> str:
        seen.append(request.method)
        return "m:" + request.method

    app = RateLimitMiddleware(accepting, rl.AsyncLimiter(), default="1/minute", key=by_method)
    assert await _handshake_in_process(app, {}) == [{"type": "websocket.accept"}]
    assert seen == ["GET"]
