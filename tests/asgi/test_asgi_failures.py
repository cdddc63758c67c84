"""Backend failures under the ASGI middleware: never a 500, a deadline, a cool-down."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from asgi_support import call_asgi, http_scope
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient
from support import CountingBackend, free_port

import ratelimit_mw as rl
from ratelimit_mw.asgi import RateLimitMiddleware


async def echo(request: Request) -> Response:
    return JSONResponse({"decision": repr(request.state.ratelimit)})


async def plain_app(scope, receive, send):
    await JSONResponse({"ok": True})(scope, receive, send)


@pytest.fixture
def down_url() -> str:
    """A Redis URL on a loopback port nobody listens on."""
    return f"redis://127.0.0.1:{free_port()}/0"


@pytest.fixture
def hung_url() -> Iterator[str]:
    """A Redis URL whose server accepts connections (the kernel does) and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    try:
        yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    finally:
        listener.close()


def serve_down(url: str, **options: Any) -> tuple[Starlette, rl.AsyncRedisBackend]:
    backend = rl.AsyncRedisBackend.from_url(url)
    app = Starlette(routes=[Route("/", echo, methods=["GET", "POST"])])
    app.add_middleware(RateLimitMiddleware, limiter=rl.AsyncLimiter(backend),
                       default="1/minute", **options)
    return app, backend


def test_an_on_backend_error_callable_decides_per_request(down_url):
    errors: list[BaseException] = []

    def policy(request: Request, error: BaseException) -> bool:
        errors.append(error)
        return request.method == "GET"

    app, backend = serve_down(down_url, on_backend_error=policy)
    with TestClient(app) as client:
        get = client.get("/")
        post = client.post("/")
        client.portal.call(backend.aclose)

    assert (get.status_code, post.status_code) == (200, 503)
    assert len(errors) == 2
    assert all(isinstance(e, Exception) for e in errors)


def test_an_on_backend_error_callable_that_raises_admits(down_url):
    def policy(request: Request, error: BaseException) -> bool:
        raise RuntimeError("bug")

    app, backend = serve_down(down_url, on_backend_error=policy)
    with TestClient(app) as client:
        response = client.get("/")
        client.portal.call(backend.aclose)
    assert response.status_code == 200


def test_a_hung_redis_is_cut_off_by_backend_timeout_whatever_the_client_timeouts(hung_url):
    backend = rl.AsyncRedisBackend.from_url(hung_url, socket_timeout=30,
                                            socket_connect_timeout=30)
    app = RateLimitMiddleware(Starlette(routes=[Route("/", echo)]), rl.AsyncLimiter(backend),
                              default="1/minute", backend_timeout=0.05, backend_cooldown=60)
    with TestClient(app) as client:
        response = client.get("/")
        client.portal.call(backend.aclose)

    assert response.status_code == 200
    # Cut off by the deadline (a timeout): counted, but one timeout alone does not open the
    # breaker (http/breaker.py TIMEOUTS).
    assert app.guard.breaker.timeouts == 1
    assert not app.guard.breaker.is_open


@pytest.mark.parametrize("failure", [
    rl.BackendError("down"),
    TimeoutError("slow"),
    ConnectionRefusedError("refused"),
    OSError("network unreachable"),
    redis.ConnectionError("redis-py"),
    redis.ResponseError("OOM command not allowed"),
    RuntimeError("a bug in a custom backend"),
    "hang",
], ids=lambda f: type(f).__name__ if not isinstance(f, str) else f)
@pytest.mark.parametrize("on_error", ["allow", "deny"])
async def test_no_backend_failure_becomes_a_500(failure, on_error):
    backend = CountingBackend()
    backend.failure = failure
    middleware = RateLimitMiddleware(plain_app, rl.AsyncLimiter(backend), default="1/minute",
                                     on_backend_error=on_error, backend_timeout=0.02)
    sent = await call_asgi(middleware, http_scope())

    assert sent[0]["status"] == (200 if on_error == "allow" else 503)
    assert backend.ops == ["H"]


class SteppedClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_while_cooling_down_the_callable_is_still_asked_and_told_why():
    backend = CountingBackend()
    backend.failure = rl.BackendError("down")
    errors: list[BaseException] = []
    middleware = RateLimitMiddleware(
        plain_app, rl.AsyncLimiter(backend), default="2/minute", backend_cooldown=30,
        on_backend_error=lambda request, error: errors.append(error) or False)
    statuses = [(await call_asgi(middleware, http_scope()))[0]["status"] for _ in range(3)]

    assert statuses == [503, 503, 503]
    assert backend.calls == 1
    assert [type(e) for e in errors] == [rl.BackendError] * 3
    assert "cool-down" in str(errors[1])


async def test_a_recurring_failure_is_logged_once_per_interval(caplog):
    backend = CountingBackend()
    backend.failure = rl.BackendError("down")
    middleware = RateLimitMiddleware(plain_app, rl.AsyncLimiter(backend), default="2/minute",
                                     backend_cooldown=0)
    with caplog.at_level(logging.WARNING, logger="ratelimit_mw"):
        for _ in range(5):
            await call_asgi(middleware, http_scope())

    assert backend.calls == 5  # no cool-down: every request tried the backend
    failures = [r for r in caplog.records if "backend failed" in r.getMessage()]
    assert len(failures) == 1


async def test_the_503_body_and_headers_are_fresh_for_every_response():
    backend = CountingBackend()
    backend.failure = rl.BackendError("down")
    middleware = RateLimitMiddleware(plain_app, rl.AsyncLimiter(backend), default="2/minute",
                                     on_backend_error="deny")
    first = await call_asgi(middleware, http_scope())
    first[0]["headers"].append((b"x-added-outside", b"1"))
    second = await call_asgi(middleware, http_scope())

    assert (b"x-added-outside", b"1") not in second[0]["headers"]
    assert json.loads(second[1]["body"])["detail"] == "Rate limiter unavailable"
