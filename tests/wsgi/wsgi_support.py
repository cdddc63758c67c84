"""Helpers for tests/wsgi: backends that count or fail, a WSGI app that echoes the decision."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from typing import Any

from werkzeug.test import Client, TestResponse

from ratelimit_mw.core import ScriptCall
from ratelimit_mw.wsgi import DECISION_KEY

Environ = dict[str, Any]


def free_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class CountingBackend:
    """Wraps a backend and counts the script calls that reach it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.is_cluster = inner.is_cluster
        self.calls = 0

    def run(self, call: ScriptCall) -> list[int]:
        self.calls += 1
        return self.inner.run(call)  # type: ignore[no-any-return]


class FailingBackend:
    """A backend whose every call raises `error` (not necessarily a BackendError)."""

    is_cluster = False

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def run(self, call: ScriptCall) -> list[int]:
        raise self.error


def echo_app(environ: Environ, start_response: Callable[..., Any]) -> list[bytes]:
    """A plain WSGI app answering what the middleware told it (remaining quota or null)."""
    decision = environ.get(DECISION_KEY)
    body = json.dumps({
        "remaining": None if decision is None else decision.remaining,
        "path": environ.get("PATH_INFO"),
    }).encode()
    start_response("200 OK", [("Content-Type", "application/json"), ("X-App", "echo")])
    return [body]


def retry_after_of(body: bytes) -> int:
    return int(json.loads(body)["retry_after"])


class ServerClient(Client):
    """werkzeug's test Client acting like a server: a peer address, and the body closed.

    The plain EnvironBuilder sets no REMOTE_ADDR (every request would be "ip:unknown"), and
    an unbuffered response is never closed, so close()-time work (refunds) would not run.
    """

    def __init__(self, app: Any, peer: str = "127.0.0.1") -> None:
        super().__init__(app)
        self.peer = peer

    def open(self, *args: Any, **kwargs: Any) -> TestResponse:
        kwargs.setdefault("buffered", True)
        kwargs.setdefault("environ_base", {"REMOTE_ADDR": self.peer})
        return super().open(*args, **kwargs)
