"""The ``ratelimit`` fixture's off switch: while limiting is switched off, every middleware of
the process (Starlette and Litestar under ASGI, the Flask extension and the plain middleware
under WSGI, Django under both) lets requests through untouched, defaults and decorated routes
alike: no 429, no headers, nothing counted. Switched on again, counting starts where it stood
(the Flask extension and the plain WSGI middleware keep what applies per endpoint: a request
seen while off must not leave its endpoint unlimited).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flask
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient
from support.django_site import Site, configure
from werkzeug.test import Client

import ratelimit_mw as rl
from ratelimit_mw.asgi import RateLimitMiddleware
from ratelimit_mw.django import limit
from ratelimit_mw.flask import RateLimit
from ratelimit_mw.limiter import SWITCH
from ratelimit_mw.testing import Isolation, isolated
from ratelimit_mw.wsgi import RateLimitMiddleware as WsgiMiddleware

configure()

from django.http import HttpResponse  # noqa: E402
from django.urls import path  # noqa: E402

# (status, whether it carries rate-limit headers) per request
Answers = list[tuple[int, bool]]


def switched_off_then_on(ratelimit: Isolation, get: Callable[[str], Any], url: str
                         ) -> tuple[Answers, Answers]:
    """Three requests with limiting off (the context manager), then three with it on."""
    def answers() -> Answers:
        return [(r.status_code, "RateLimit" in r.headers) for r in map(get, [url] * 3)]

    with ratelimit.disabled():
        off = answers()
    return off, answers()


UNTOUCHED = [(200, False)] * 3
LIMITED = [(200, True), (200, True), (429, True)]  # 2 a minute: nothing was counted while off


@pytest.mark.parametrize("url", ["/", "/decorated"])
def test_starlette(ratelimit: Isolation, url: str) -> None:
    limiter = rl.AsyncLimiter()

    async def hello(request: object) -> PlainTextResponse:
        return PlainTextResponse("hi")

    @limiter.limit("2/minute")
    async def decorated(request: object) -> PlainTextResponse:
        return PlainTextResponse("hi")

    app = RateLimitMiddleware(Starlette(routes=[Route("/", hello),
                                                Route("/decorated", decorated)]),
                              limiter, default="2/minute")
    with TestClient(app) as client:
        assert switched_off_then_on(ratelimit, client.get, url) == (UNTOUCHED, LIMITED)


@pytest.mark.parametrize("url", ["/", "/decorated"])
def test_litestar(ratelimit: Isolation, url: str) -> None:
    from litestar import Litestar, get
    from litestar.testing import TestClient as LitestarClient

    from ratelimit_mw.litestar import RateLimitPlugin

    limiter = rl.AsyncLimiter()

    @get("/", sync_to_thread=False)
    def hello() -> str:
        return "hi"

    @get("/decorated", sync_to_thread=False)
    @limiter.limit("2/minute")
    def decorated() -> str:
        return "hi"

    app = Litestar([hello, decorated],
                   plugins=[RateLimitPlugin(limiter, default="2/minute")],
                   openapi_config=None, logging_config=None)
    with LitestarClient(app) as client:
        assert switched_off_then_on(ratelimit, client.get, url) == (UNTOUCHED, LIMITED)


@pytest.mark.parametrize("url", ["/", "/decorated"])
def test_flask(ratelimit: Isolation, url: str) -> None:
    app, limiter = flask.Flask(__name__), rl.Limiter()
    app.add_url_rule("/", "hello", lambda: "hi")
    app.add_url_rule("/decorated", "decorated", limiter.limit("2/minute")(lambda: "hi"))
    RateLimit(app, limiter=limiter, default="2/minute")
    client = app.test_client()
    assert switched_off_then_on(ratelimit, client.get, url) == (UNTOUCHED, LIMITED)


def test_plain_wsgi(ratelimit: Isolation) -> None:
    def app(environ: Any, start_response: Any) -> list[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"hi"]

    client = Client(WsgiMiddleware(app, rl.Limiter(), default="2/minute"))
    assert switched_off_then_on(ratelimit, client.get, "/") == (UNTOUCHED, LIMITED)


@limit("2/minute")
def django_decorated(request: Any) -> HttpResponse:
    return HttpResponse(b"ok")


@pytest.mark.parametrize("url", ["/", "/decorated"])
@pytest.mark.parametrize("mode", ["wsgi", "asgi"])
def test_django(ratelimit: Isolation, mode: str, url: str) -> None:
    site = Site([path("", lambda request: HttpResponse(b"ok")),
                 path("decorated", django_decorated)],
                {"default": "2/minute"}, asynchronous=mode == "asgi")
    try:
        assert switched_off_then_on(ratelimit, lambda p: site.request("GET", p), url) == (
            UNTOUCHED, LIMITED)
    finally:
        site.close()


def test_disable_holds_until_enable_and_the_isolation_ends_it() -> None:
    limiter = rl.Limiter()
    app = flask.Flask(__name__)
    app.add_url_rule("/", "hello", lambda: "hi")
    RateLimit(app, limiter=limiter, default="1/minute")
    client = app.test_client()
    with isolated() as isolation:
        isolation.disable()
        assert [client.get("/").status_code for _ in range(2)] == [200, 200]
        isolation.enable()
        assert [client.get("/").status_code for _ in range(2)] == [200, 429]
        isolation.disable()
    assert SWITCH.off is False
