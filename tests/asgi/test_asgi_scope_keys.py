"""Which requests build a Starlette Request: decided per selection when it is made.

Built-in keys read the scope; a callable of the app (a key, a cost, exempt_when, a dynamic
limit, a hook) is always handed a Starlette ``Request``.
"""

from __future__ import annotations

from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

import ratelimit_mw as rl
from ratelimit_mw import keys
from ratelimit_mw.asgi import RateLimitMiddleware

PEER = ("203.0.113.7", 50000)


async def hello(request: Request) -> Response:
    return PlainTextResponse("hello")


def app_with(limiter: rl.AsyncLimiter, **options: Any) -> tuple[Starlette, list[Any]]:
    app = Starlette(routes=[Route("/", hello)])
    app.add_middleware(RateLimitMiddleware, limiter=limiter, **options)
    return app, []


@pytest.mark.parametrize(("key", "expected"), [
    (keys.client_ip(), True),
    (keys.client_ip(trusted_proxies=1), True),
    (keys.header("X-Api-Key"), True),
    (keys.user(), True),
    (keys.route(), True),
    (keys.compose(keys.client_ip(), keys.route()), True),
    (keys.first(keys.header("X-Api-Key"), keys.client_ip()), True),
    (keys.shared_route(keys.compose(keys.client_ip(), keys.route()), "n"), True),
    (keys.user(lambda request: request.state.account), False),
    (keys.compose(keys.client_ip(), lambda request: "x"), False),
    (lambda request: "x", False),
])
def test_reads_scope_is_true_for_built_in_keys_only(key: Any, expected: bool) -> None:
    assert keys.reads_scope(key) is expected


def test_a_key_of_the_app_is_handed_a_starlette_request(alimiter, serve) -> None:
    seen: list[Any] = []

    def key(request: Any) -> str:
        seen.append(request)
        return "k"

    app, _ = app_with(alimiter, default="5/minute", key=key)
    client = serve(app, client=PEER)
    assert client.get("/").status_code == 200
    assert [type(request) for request in seen] == [Request]


def test_built_in_keys_count_from_the_scope_and_hooks_get_a_request(alimiter, serve) -> None:
    told: list[Any] = []
    app, _ = app_with(alimiter, default="2/minute",
                      key=keys.first(keys.header("X-Api-Key"), keys.client_ip()),
                      on_refusal=lambda request, decision: told.append(request))
    client = serve(app, client=PEER)
    statuses = [client.get("/", headers={"X-Api-Key": "a"}).status_code for _ in range(3)]
    assert statuses == [200, 200, 429]
    # Another header value is another identity; no header counts by the peer.
    assert client.get("/", headers={"X-Api-Key": "b"}).status_code == 200
    assert [client.get("/").status_code for _ in range(3)] == [200, 200, 429]
    assert [type(request) for request in told] == [Request, Request]
    assert told[0].headers["x-api-key"] == "a"


def test_selection_made_for_built_in_keys_builds_no_request(alimiter) -> None:
    app, _ = app_with(alimiter, default="2/minute")
    middleware = RateLimitMiddleware(app, alimiter, default="2/minute")
    assert middleware.guard.select("GET", "/", None).scope_only  # type: ignore[union-attr]
    hooked = RateLimitMiddleware(app, alimiter, default="2/minute",
                                 on_refusal=lambda request, decision: None)
    assert not hooked.guard.select("GET", "/", None).scope_only  # type: ignore[union-attr]
    costly = RateLimitMiddleware(app, alimiter, rules=[
        rl.asgi.Rule("/", "2/minute", cost=lambda request: 1)])
    assert not costly.guard.select("GET", "/", None).scope_only  # type: ignore[union-attr]
