"""Helpers for tests/wsgi: backends that count or fail, a WSGI app that echoes the decision."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from werkzeug.test import Client, TestResponse

from ratelimit_mw.wsgi import DECISION_KEY

Environ = dict[str, Any]


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
