"""ratelimit_mw.testing isolates the limiters an app builds during a test: Django's middleware
(built on the first request), an app factory called in the test (Starlette, Flask). Each app
here counts on the real Redis under a private prefix; Redis's MONITOR proves that nothing
naming that prefix reaches it, and the counts are the same in every run whatever the order.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

import flask
import pytest
import redis
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient
from support import HOUSEKEEPER, REDIS_URL
from support.django_site import Site, configure

import ratelimit_mw as rl
from ratelimit_mw.asgi import RateLimitMiddleware
from ratelimit_mw.flask import RateLimit
from ratelimit_mw.testing import Isolation, isolated

configure()

from django.http import HttpResponse  # noqa: E402
from django.urls import path  # noqa: E402

PREFIX = "tiso" + uuid.uuid4().hex[:10]
HOUSEKEEPER.record(PREFIX)
# One settings dict per mode, kept across the runs: Django builds the limiter once, on the
# first request of whichever run comes first, and reuses it in the others.
DJANGO_SETTINGS = {mode: {"default": "2/minute", "backend": REDIS_URL,
                          "prefix": f"{PREFIX}{mode}"} for mode in ("wsgi", "asgi")}


@contextlib.contextmanager
def commands_naming(prefix: str) -> Iterator[list[str]]:
    """The commands naming `prefix` that the Redis server runs during the block (MONITOR),
    in the list yielded, filled when the block ends."""
    client = redis.Redis.from_url(REDIS_URL)
    seen: list[str] = []
    try:
        with client.monitor() as monitor:
            yield seen
            marker = "end-of-block-" + uuid.uuid4().hex
            client.echo(marker)  # the last command of the block, in the server's order
            while True:
                line = monitor.connection.read_response()
                text = line.decode(errors="replace") if isinstance(line, bytes) else str(line)
                if marker in text:
                    break
                if prefix in text:
                    seen.append(text)
    finally:
        client.close()


def django_ok(request: Any) -> HttpResponse:
    return HttpResponse(b"ok")


@pytest.mark.parametrize("run", [1, 2])
@pytest.mark.parametrize("mode", ["wsgi", "asgi"])
def test_the_limiter_django_builds_on_the_first_request_is_isolated(
        ratelimit: Isolation, mode: str, run: int) -> None:
    with commands_naming(PREFIX) as seen:
        site = Site([path("", django_ok)], DJANGO_SETTINGS[mode],
                    asynchronous=mode == "asgi")
        try:
            assert [site.request("GET", "/").status_code for _ in range(3)] == [200, 200, 429]
            ratelimit.clock.advance(60)
            assert site.request("GET", "/").status_code == 200
        finally:
            site.close()
    assert seen == []


async def hello(request: object) -> PlainTextResponse:
    return PlainTextResponse("hi")


def starlette_factory() -> Any:
    limiter = rl.AsyncLimiter(rl.AsyncRedisBackend.from_url(REDIS_URL), prefix=PREFIX)
    return RateLimitMiddleware(Starlette(routes=[Route("/", hello)]), limiter,
                               default="2/minute")


def flask_factory() -> flask.Flask:
    app = flask.Flask(__name__)
    app.add_url_rule("/", "hello", lambda: "hi")
    RateLimit(app, limiter=rl.Limiter(rl.RedisBackend.from_url(REDIS_URL), prefix=PREFIX),
              default="2/minute")
    return app


@pytest.mark.parametrize("run", [1, 2])
def test_a_starlette_app_made_in_the_test_is_isolated(ratelimit: Isolation, run: int) -> None:
    with commands_naming(PREFIX) as seen, TestClient(starlette_factory()) as client:
        assert [client.get("/").status_code for _ in range(3)] == [200, 200, 429]
        ratelimit.clock.advance(60)
        assert client.get("/").status_code == 200
    assert seen == []


@pytest.mark.parametrize("run", [1, 2])
def test_a_flask_app_made_in_the_test_is_isolated(ratelimit: Isolation, run: int) -> None:
    with commands_naming(PREFIX) as seen:
        client = flask_factory().test_client()
        assert [client.get("/").status_code for _ in range(3)] == [200, 200, 429]
        ratelimit.clock.advance(60)
        assert client.get("/").status_code == 200
    assert seen == []


@pytest.mark.parametrize("run", [1, 2])
def test_a_litestar_app_made_in_the_test_is_isolated(ratelimit: Isolation, run: int) -> None:
    from litestar import Litestar, get
    from litestar.testing import TestClient as LitestarClient

    from ratelimit_mw.litestar import RateLimitPlugin

    @get("/", sync_to_thread=False)
    def home() -> str:
        return "hi"

    limiter = rl.AsyncLimiter(rl.AsyncRedisBackend.from_url(REDIS_URL), prefix=PREFIX)
    app = Litestar([home], plugins=[RateLimitPlugin(limiter, default="2/minute")],
                   openapi_config=None, logging_config=None)
    with commands_naming(PREFIX) as seen, LitestarClient(app) as client:
        assert [client.get("/").status_code for _ in range(3)] == [200, 200, 429]
        ratelimit.clock.advance(60)
        assert client.get("/").status_code == 200
    assert seen == []


def test_a_limiter_made_during_the_isolation_has_its_own_store_back_after_it() -> None:
    store = rl.RedisBackend.from_url(REDIS_URL)
    with isolated() as isolation:
        limiter = rl.Limiter(store, prefix=PREFIX)
        alimiter = rl.AsyncLimiter(prefix=PREFIX)
        assert limiter.backend is isolation.backend and limiter.clock is isolation.clock
        assert alimiter.backend is isolation.backend
    assert limiter.backend is store and limiter.clock is None
    assert limiter._sleep is time.sleep
    assert alimiter.backend is not isolation.backend
    assert rl.Limiter(prefix=PREFIX).backend is not isolation.backend  # made after: its own


def test_a_new_limiter_goes_to_the_isolations_of_every_limiter_and_back_one_at_a_time(
        ) -> None:
    store, named = rl.MemoryBackend(), rl.Limiter()
    with isolated() as outer, isolated(named):  # the second: `named` only, not new ones
        with isolated() as inner:
            limiter = rl.Limiter(store)
            assert limiter.backend is inner.backend
        assert limiter.backend is outer.backend
    assert limiter.backend is store
