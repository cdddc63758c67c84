"""In-process apps and clients for the reliability tests: one ASGI and one WSGI stack.

Both answer ``{"decided": bool}``: whether the middleware left a Decision for the app (a
request admitted because the backend failed has none).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ratelimit_mw.http.breaker import Breaker
from ratelimit_mw.wsgi import DECISION_KEY
from reliability._support import TestClock

_REMAINING = re.compile(r";r=(\d+)")


async def _endpoint(request: Request) -> JSONResponse:
    decided = getattr(request.state, "ratelimit", None) is not None
    return JSONResponse({"decided": decided})


def asgi_app() -> Starlette:
    return Starlette(routes=[Route("/{path:path}", _endpoint,
                                   methods=["GET", "POST", "PUT", "DELETE"])])


def wsgi_app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    body = json.dumps({"decided": environ.get(DECISION_KEY) is not None}).encode()
    start_response("200 OK", [("Content-Type", "application/json"),
                              ("Content-Length", str(len(body)))])
    return [body]


def asgi_client(app: Any) -> httpx.AsyncClient:
    """An httpx client calling the ASGI app in this event loop (app exceptions propagate)."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app, client=("192.0.2.10", 4000)),
                             base_url="http://testserver")


def install_clock(middleware: Any) -> TestClock:
    """Give the middleware's circuit breaker a clock the test moves (same cool-down)."""
    clock = TestClock()
    old = middleware.guard.breaker
    middleware.guard.breaker = Breaker(old.cooldown, old.policy, clock)
    return clock


def remaining(headers: Any) -> int | None:
    """The ``r=`` of the RateLimit header, or None when the response carries none."""
    value = headers.get("RateLimit")
    if value is None:
        return None
    found = _REMAINING.search(value)
    return None if found is None else int(found.group(1))
