"""Helpers the ASGI test modules import: fake backends, raw ASGI drivers, small apps."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import ratelimit_mw as rl
from ratelimit_mw.core import ScriptCall

REDIS_URL = os.environ.get("RATELIMIT_REDIS_URL", "redis://127.0.0.1:6379/0")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]


def free_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class CountingBackend:
    """Wraps a backend; counts calls and fails (or hangs) on demand.

    `failure` is an exception instance to raise, or "hang" to wait forever (until the
    middleware's deadline cancels the call).
    """

    is_cluster = False

    def __init__(self, inner: Any | None = None) -> None:
        self.inner = inner or rl.MemoryBackend()
        self.calls: list[str] = []
        self.failure: BaseException | str | None = None

    async def arun(self, call: ScriptCall) -> list[int]:
        self.calls.append(call.op)
        if self.failure == "hang":
            await asyncio.sleep(3600)
        elif isinstance(self.failure, BaseException):
            raise self.failure
        return await self.inner.arun(call)  # type: ignore[no-any-return]


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
