"""RateLimitMiddleware on Starlette: limits, responses, headers, modes and hooks.

Behaviour tests run on the memory backend and on the real Redis (the `abackend` fixture),
with the fake clock moving time.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from asgi_support import call_asgi, header_values, http_scope
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket
from support import CountingBackend

import ratelimit_mw as rl
from ratelimit_mw import ConfigurationError
from ratelimit_mw.asgi import RateLimitMiddleware, Rule


async def hello(request: Request) -> Response:
    return PlainTextResponse("hello")


async def status_from_query(request: Request) -> Response:
    status = int(request.query_params.get("status", "200"))
    return PlainTextResponse("x", status_code=status)


async def boom(request: Request) -> Response:
    raise RuntimeError("the app failed")


async def echo_state(request: Request) -> Response:
    decision = request.state.ratelimit
    return JSONResponse({"remaining": None if decision is None else decision.remaining,
                         "allowed": None if decision is None else decision.allowed})


async def ws_echo(websocket: WebSocket) -> None:
    await websocket.accept()
    await websocket.send_text(await websocket.receive_text())
    await websocket.close()


def make_app(limiter: rl.AsyncLimiter, **options: Any) -> Starlette:
    app = Starlette(routes=[
        Route("/", hello),
        Route("/login", status_from_query, methods=["GET", "POST"]),
        Route("/boom", boom),
        Route("/state", echo_state),
        WebSocketRoute("/ws", ws_echo),
    ])
    app.add_middleware(RateLimitMiddleware, limiter=limiter, **options)
    return app


# -- the limit and the 429 ---------------------------------------------------------------
def test_retry_after_counts_down_on_the_clock_and_the_quota_comes_back(alimiter, serve, clock):
    client = serve(make_app(alimiter, default="2/minute"))
    client.get("/")
    client.get("/")
    clock.advance(25.5)
    later = client.get("/")
    clock.advance(35)
    again = client.get("/")

    assert later.status_code == 429
    assert later.headers["retry-after"] == "35"  # 34.5 s rounded up
    assert later.json()["retry_after"] == 35
    assert again.status_code == 200


def test_no_legacy_headers_by_default(alimiter, serve):
    client = serve(make_app(alimiter, default="2/minute"))
    assert "x-ratelimit-limit" not in client.get("/").headers


def test_the_decision_is_left_in_request_state(alimiter, serve):
    client = serve(make_app(alimiter, default="5/minute"))
    assert client.get("/state").json() == {"remaining": 4, "allowed": True}
    assert client.get("/state").json() == {"remaining": 3, "allowed": True}


async def test_a_scope_without_state_gets_one_holding_the_decision():
    seen: dict[str, Any] = {}

    async def app(scope, receive, send):
        seen.update(scope["state"])
        await PlainTextResponse("ok")(scope, receive, send)

    middleware = RateLimitMiddleware(app, rl.AsyncLimiter(), default="5/minute")
    scope = http_scope("/")
    assert "state" not in scope
    sent = await call_asgi(middleware, scope)

    assert sent[0]["status"] == 200
    assert seen["ratelimit"].remaining == 4


async def test_a_response_reused_across_requests_does_not_accumulate_headers():
    shared = PlainTextResponse("same object every time")

    async def app(scope, receive, send):
        await shared(scope, receive, send)

    middleware = RateLimitMiddleware(app, rl.AsyncLimiter(), default="5/minute")
    for _ in range(3):
        sent = await call_asgi(middleware, http_scope("/"))

    assert len(header_values(sent[0]["headers"], b"ratelimit")) == 1
    assert header_values(sent[0]["headers"], b"ratelimit") == [b'"minute";r=2;t=60']
    assert not any(name == b"ratelimit" for name, _ in shared.raw_headers)


# -- rules and several policies -----------------------------------------------------------
# -- shadow mode and hooks ----------------------------------------------------------------
def test_on_refusal_is_told_of_each_real_refusal_with_the_request(alimiter, serve):
    seen: list[tuple[str, int]] = []

    def hook(request: Request, decision: rl.Decision) -> None:
        seen.append((request.url.path, decision.limit))

    client = serve(make_app(alimiter, default="1/minute", on_refusal=hook))
    statuses = [client.get("/").status_code for _ in range(3)]

    assert statuses == [200, 429, 429]
    assert seen == [("/", 1), ("/", 1)]


def test_an_on_refusal_hook_that_raises_does_not_change_the_answer(alimiter, serve):
    def hook(request: Request, decision: rl.Decision) -> None:
        raise RuntimeError("hook bug")

    client = serve(make_app(alimiter, default="1/minute", on_refusal=hook))
    assert [client.get("/").status_code for _ in range(2)] == [200, 429]


async def test_an_async_on_blocked_is_awaited():
    async def blocked(request: Request, decision: rl.Decision) -> Response:
        return PlainTextResponse("later", status_code=429,
                                 headers={"Retry-After": str(int(decision.retry_after))})

    middleware = RateLimitMiddleware(hello_app, rl.AsyncLimiter(), default="1/minute",
                                     on_blocked=blocked)
    await call_asgi(middleware, http_scope())
    sent = await call_asgi(middleware, http_scope())

    assert sent[0]["status"] == 429
    assert sent[1]["body"] == b"later"
    headers = dict(sent[0]["headers"])
    # The handler's own Retry-After wins; what it left out is added.
    assert [name for name, _ in sent[0]["headers"]].count(b"retry-after") == 1
    assert b"ratelimit" in headers


@pytest.mark.parametrize("broken", [
    pytest.param(lambda request, decision: 1 / 0, id="raises"),
    pytest.param(lambda request, decision: "not an app", id="returns-a-string"),
])
async def test_a_failing_on_blocked_falls_back_to_the_default_429(broken):
    middleware = RateLimitMiddleware(hello_app, rl.AsyncLimiter(), default="1/minute",
                                     on_blocked=broken)
    await call_asgi(middleware, http_scope())
    sent = await call_asgi(middleware, http_scope())

    assert sent[0]["status"] == 429
    assert json.loads(sent[1]["body"])["retry_after"] == 60


async def hello_app(scope, receive, send):
    await PlainTextResponse("hello")(scope, receive, send)


# -- count_when -----------------------------------------------------------------------------
def test_count_when_counts_an_exception_as_a_server_error(alimiter, serve):
    app = make_app(alimiter, default="1/minute", count_when=lambda status: status >= 500)
    client = serve(app, raise_server_exceptions=False)
    failed = client.get("/boom")
    after = client.get("/")

    assert failed.status_code == 500
    assert after.status_code == 429


def test_count_when_headers_are_still_added(alimiter, serve):
    client = serve(make_app(alimiter, default="3/minute", count_when=lambda s: s >= 400))
    response = client.get("/login?status=401")
    assert response.headers["ratelimit"] == '"minute";r=2;t=60'


async def test_a_refund_that_fails_is_logged_never_raised(caplog):
    backend = CountingBackend()

    async def app(scope, receive, send):
        backend.failure = rl.BackendError("down during the refund")
        await PlainTextResponse("ok")(scope, receive, send)

    middleware = RateLimitMiddleware(app, rl.AsyncLimiter(backend), default="3/minute",
                                     count_when=lambda status: status >= 400)
    with caplog.at_level(logging.WARNING, logger="ratelimit_mw"):
        sent = await call_asgi(middleware, http_scope())

    assert sent[0]["status"] == 200
    assert backend.ops == ["H", "R"]
    assert "could not give back a hit" in caplog.text


# -- WebSockets (through real uvicorn: test_asgi_websockets.py) ------------------------------
def test_a_websocket_handshake_counts_as_a_get_and_is_refused_before_accept(alimiter, serve):
    from starlette.testclient import WebSocketDenialResponse

    client = serve(make_app(alimiter, default="2/minute"))
    with client.websocket_connect("/ws") as ws:
        ws.send_text("one")
        assert ws.receive_text() == "one"
    assert client.get("/").status_code == 200  # the client's second hit of two
    with pytest.raises(WebSocketDenialResponse) as refused:
        client.websocket_connect("/ws").__enter__()
    assert refused.value.status_code == 429
    assert refused.value.headers["retry-after"] == "60"


# -- what passes through untouched ------------------------------------------------------------
def test_websockets_false_passes_them_through_uncounted(alimiter, serve):
    client = serve(make_app(alimiter, default="1/minute", websockets=False))
    for text in ("one", "two"):
        with client.websocket_connect("/ws") as ws:
            ws.send_text(text)
            assert ws.receive_text() == text
    assert client.get("/").status_code == 200


def test_lifespan_passes_through_a_wrapped_app():
    from contextlib import asynccontextmanager

    from starlette.testclient import TestClient

    events: list[str] = []

    @asynccontextmanager
    async def lifespan(app):
        events.append("startup")
        yield
        events.append("shutdown")

    inner = Starlette(routes=[Route("/", hello)], lifespan=lifespan)
    app = RateLimitMiddleware(inner, rl.AsyncLimiter(), default="1/minute")
    with TestClient(app) as client:
        assert events == ["startup"]
        assert [client.get("/").status_code for _ in range(2)] == [200, 429]
    assert events == ["startup", "shutdown"]


def test_requests_no_policy_applies_to_pass_through_without_headers(alimiter, serve):
    client = serve(make_app(alimiter, rules={"/login": "1/minute"}))
    response = client.get("/state")
    assert response.json() == {"remaining": None, "allowed": None}
    assert "ratelimit" not in response.headers


def test_a_key_returning_none_means_the_policy_does_not_apply(alimiter, serve):
    client = serve(make_app(alimiter, default="1/minute",
                            key=lambda request: request.headers.get("x-user")))
    anonymous = [client.get("/").status_code for _ in range(3)]
    named = [client.get("/", headers={"x-user": "ann"}).status_code for _ in range(2)]

    assert anonymous == [200, 200, 200]
    assert named == [200, 429]


def test_cost_from_a_rule_spends_that_much(alimiter, serve):
    client = serve(make_app(alimiter, rules=[Rule("/", "5/minute", cost=2)]))
    remaining = [client.get("/").headers.get("ratelimit") for _ in range(2)]
    assert remaining == ['"minute";r=3;t=60', '"minute";r=1;t=60']
    assert client.get("/").status_code == 429


# -- configuration --------------------------------------------------------------------------
@pytest.mark.parametrize(("options", "message"), [
    ({"limiter": rl.Limiter()}, "AsyncLimiter"),
    ({"limiter": object()}, "AsyncLimiter"),
    ({"mode": "audit"}, "enforce"),
    ({"on_backend_error": "ignore"}, "on_backend_error"),
    ({"backend_timeout": 0}, "backend_timeout"),
    ({"backend_timeout": -1}, "backend_timeout"),
    ({"backend_timeout": True}, "backend_timeout"),
    ({"backend_timeout": "0.1"}, "backend_timeout"),
    ({"backend_cooldown": -1}, "backend_cooldown"),
    ({"on_blocked": "429"}, "on_blocked"),
    ({"on_refusal": 3}, "on_refusal"),
    ({"count_when": 400}, "count_when"),
    ({"default": "5 a minute"}, "cannot read the rate"),
    ({"key": "ip"}, "key"),
])
def test_bad_options_fail_at_construction_saying_what_to_write(options, message):
    kwargs: dict[str, Any] = {"limiter": rl.AsyncLimiter(), "default": "1/minute", **options}
    with pytest.raises(ConfigurationError, match=message):
        RateLimitMiddleware(hello_app, **kwargs)


def test_add_middleware_and_wrapping_give_the_same_limits():
    from starlette.testclient import TestClient

    wrapped = RateLimitMiddleware(Starlette(routes=[Route("/", hello)]), rl.AsyncLimiter(),
                                  default="2/minute")
    added = Starlette(routes=[Route("/", hello)])
    added.add_middleware(RateLimitMiddleware, limiter=rl.AsyncLimiter(), default="2/minute")
    for app in (wrapped, added):
        with TestClient(app) as client:
            assert [client.get("/").status_code for _ in range(3)] == [200, 200, 429]
