"""Helpers the ASGI test modules import: fake backends, raw ASGI drivers, small apps."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

REDIS_URL = os.environ.get("RATELIMIT_REDIS_URL", "redis://127.0.0.1:6379/0")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]


async def call_asgi(app: Callable[[Scope, Any, Any], Awaitable[None]], scope: Scope,
                    receive_messages: list[Message] | None = None) -> list[Message]:
    """Drive a raw ASGI app once; return what it sent."""
    inbox = list(receive_messages or [{"type": "http.request", "body": b"", "more_body": False}])
    sent: list[Message] = []

    async def receive() -> Message:
        if inbox:
            return inbox.pop(0)
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


def http_scope(path: str = "/", method: str = "GET", headers: list[tuple[bytes, bytes]] | None
               = None, client: tuple[str, int] | None = ("192.0.2.10", 4000)) -> Scope:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": headers or [(b"host", b"testserver")],
        "client": client,
        "server": ("testserver", 80),
    }


def header_values(headers: list[tuple[bytes, bytes]], name: bytes) -> list[bytes]:
    return [value for key, value in headers if key.lower() == name]
