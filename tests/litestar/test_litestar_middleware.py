"""ratelimit_mw.litestar: the middleware and plugin the Litestar way (the HTTP behaviour every
adapter shares is in tests/conformance, where Litestar is one more adapter)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from litestar import Controller, Litestar, Request, Response, Router, get, websocket
from litestar.connection import WebSocket
from litestar.exceptions import HTTPException, WebSocketDisconnect
from litestar.middleware import DefineMiddleware
from litestar.testing import TestClient
from litestar.types import ASGIApp, Receive, Scope, Send
from support import failing_backend

import ratelimit_mw as rl
from ratelimit_mw import keys
from ratelimit_mw.litestar import (
    RateLimitHTTPException,
    RateLimitMiddleware,
    RateLimitPlugin,
    Rule,
    rate_limit_exception_handler,
)

NS = {"Request": Request, "Response": Response, "Any": Any, "WebSocket": WebSocket}


@pytest.fixture
def limiter() -> rl.AsyncLimiter:
    return rl.AsyncLimiter()


@pytest.fixture
def serve() -> Iterator[Any]:
    """``serve(app)``: a TestClient for the app, closed with the test."""
    clients: list[TestClient[Any]] = []

    def start(app: Litestar) -> TestClient[Any]:
        client = TestClient(app)
        client.__enter__()
        clients.append(client)
        return client

    yield start
    for client in clients:
        client.__exit__(None, None, None)


def statuses(client: TestClient[Any], path: str, count: int, **kwargs: Any) -> list[int]:
    return [client.get(path, **kwargs).status_code for _ in range(count)]


def app_of(limiter: rl.AsyncLimiter, handlers: list[Any], **options: Any) -> Litestar:
    return Litestar(handlers, plugins=[RateLimitPlugin(limiter, **options)],
                    openapi_config=None, logging_config=None)


# -- per-handler limits ----------------------------------------------------------------------
def test_the_decorator_under_and_above_get_limits_each_handler_apart(
        limiter: rl.AsyncLimiter, serve: Any) -> None:
    @get("/under", signature_namespace=NS)
    @limiter.limit("2/minute")
    async def under() -> str:
        return "u"

    @limiter.limit("2/minute")
    @get("/above", signature_namespace=NS)
    async def above() -> str:
        return "a"

    @limiter.limit("2/minute")
    @get("/also-above", signature_namespace=NS)
    async def also_above() -> str:
        return "a"

    client = serve(app_of(limiter, [under, above, also_above], default="100/minute"))
    for path in ("/under", "/above", "/also-above"):  # each its own quota, named after fn
        assert statuses(client, path, 3) == [200, 200, 429], path
    assert client.get("/under").headers["ratelimit-policy"] == '"minute";q=2;w=60'


def test_opt_limits_and_exempts_from_any_layer(limiter: rl.AsyncLimiter, serve: Any) -> None:
    @get("/opt", opt={"ratelimit": "2/minute"}, signature_namespace=NS)
    async def limited() -> str:
        return "o"

    @get("/free", opt={"ratelimit_exempt": True}, signature_namespace=NS)
    async def free() -> str:
        return "f"

    @get("/a", signature_namespace=NS)
    async def first() -> str:
        return "a"

    @get("/b", signature_namespace=NS)
    async def second() -> str:
        return "b"

    class Items(Controller):
        path = "/items"
        opt = {"ratelimit": ["1/minute"]}  # noqa: RUF012 - Litestar's own shape

        @get("/", signature_namespace=NS)
        async def list_items(self) -> str:
            return "i"

    api = Router("/api", route_handlers=[first, second], opt={"ratelimit": "1/minute"})
    client = serve(app_of(limiter, [limited, free, api, Items], default="1/minute"))
    assert statuses(client, "/opt", 3) == [200, 200, 429]
    assert statuses(client, "/free", 3) == [200] * 3
    assert "ratelimit" not in client.get("/free").headers
    # A router's opt gives each of its handlers that rate, each counted apart.
    assert statuses(client, "/api/a", 2) == [200, 429]
    assert statuses(client, "/api/b", 2) == [200, 429]
    assert statuses(client, "/items", 2) == [200, 429]


def test_a_mistyped_opt_stops_the_app_at_start_up(limiter: rl.AsyncLimiter) -> None:
    @get("/x", opt={"ratelimit": "5 per fortnight"}, signature_namespace=NS)
    async def x() -> str:
        return "x"

    with pytest.raises(rl.ConfigurationError, match=r"opt\['ratelimit'\] of the route handler"):
        app_of(limiter, [x])

    @get("/y", opt={"ratelimit_exempt": True}, signature_namespace=NS)
    @limiter.limit("1/minute")
    async def y() -> str:
        return "y"

    with pytest.raises(rl.ConfigurationError, match="both exempt and limited"):
        app_of(limiter, [y])


@pytest.mark.parametrize(("option", "hint"), [
    ({"on_blocked": lambda request, decision: None}, "exception_handlers="),
    ({"charge_method_not_allowed": True}, "drop the option"),
])
def test_options_only_a_whole_app_middleware_could_act_on_are_refused(
        limiter: rl.AsyncLimiter, option: dict[str, Any], hint: str) -> None:
    with pytest.raises(rl.ConfigurationError, match=hint):
        RateLimitPlugin(limiter, default="1/minute", **option)


def test_a_sync_limiter_is_refused_with_what_to_write() -> None:
    with pytest.raises(rl.ConfigurationError, match="needs an AsyncLimiter"):
        RateLimitPlugin(rl.Limiter(), default="1/minute")  # type: ignore[arg-type]


# -- keys --------------------------------------------------------------------------------------
def test_keys_read_litestars_request(limiter: rl.AsyncLimiter, serve: Any) -> None:
    seen: list[Any] = []

    @get("/users/{uid:int}", signature_namespace=NS)
    @limiter.limit("2/minute", key=keys.route())
    async def user() -> str:
        return "u"

    @get("/ip", signature_namespace=NS)
    @limiter.limit("1/minute", key=keys.client_ip(trusted_proxies=1))
    async def ip() -> str:
        return "i"

    @get("/seen", signature_namespace=NS)
    @limiter.limit("5/minute", key=lambda request: seen.append(request) or "k")
    async def look() -> str:
        return "s"

    client = serve(app_of(limiter, [user, ip, look]))
    # Keyed by the template: /users/1 and /users/2 share one counter, never the raw path.
    assert [client.get(f"/users/{n}").status_code for n in (1, 2, 3)] == [200, 200, 429]
    # The client behind one trusted proxy: each forwarded address its own quota.
    for address in ("203.0.113.7", "203.0.113.8"):
        assert statuses(client, "/ip", 2, headers={"X-Forwarded-For": address}) == [200, 429]
    client.get("/seen")
    assert isinstance(seen[0], Request)


@dataclass
class User:
    id: int


class Authenticate:
    """An app's authentication, before the limiter: ``scope["user"]`` from a header."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        for name, value in scope["headers"]:
            if name == b"x-user":
                scope["user"] = User(int(value))
        await self.app(scope, receive, send)


def test_the_user_key_reads_the_user_litestars_authentication_left(
        limiter: rl.AsyncLimiter, serve: Any) -> None:
    @get("/me", signature_namespace=NS)
    async def me(request: Request[Any, Any, Any]) -> str:
        return str(request.state.ratelimit.remaining)

    app = Litestar([me], middleware=[
        Authenticate,
        DefineMiddleware(RateLimitMiddleware, limiter=limiter, default="1/minute",
                         key=keys.first(keys.user(), keys.client_ip()))],
        openapi_config=None, logging_config=None)
    client = serve(app)
    assert statuses(client, "/me", 2, headers={"X-User": "7"}) == [200, 429]
    assert statuses(client, "/me", 2, headers={"X-User": "8"}) == [200, 429]
    assert statuses(client, "/me", 2) == [200, 429]  # no user: the client address


# -- the 429 through Litestar's exception handling -------------------------------------------
@get("/", signature_namespace=NS)
async def index() -> str:
    return "ok"


def test_define_middleware_refuses_through_litestars_own_handler(
        limiter: rl.AsyncLimiter, serve: Any) -> None:
    app = Litestar([index], middleware=[
        DefineMiddleware(RateLimitMiddleware, limiter=limiter, default="1/minute")],
        openapi_config=None, logging_config=None)
    client = serve(app)
    admitted, refused = client.get("/"), client.get("/")
    assert admitted.headers["ratelimit-policy"] == '"minute";q=1;w=60'
    assert admitted.headers["ratelimit"].startswith('"minute";r=0;t=')
    assert refused.status_code == 429
    retry = int(refused.headers["retry-after"])
    assert refused.headers["ratelimit"] == f'"minute";r=0;t={retry}'
    assert refused.headers["cache-control"] == "no-store"
    assert refused.json() == {"status_code": 429, "detail": "Too Many Requests",
                              "extra": {"retry_after": retry}}


def test_the_plugin_answers_with_the_asgi_middlewares_body(
        limiter: rl.AsyncLimiter, serve: Any) -> None:
    client = serve(app_of(limiter, [index], default="1/minute"))
    client.get("/")
    refused = client.get("/")
    assert refused.status_code == 429
    assert refused.json() == {"detail": "Too Many Requests",
                              "retry_after": int(refused.headers["retry-after"])}


@pytest.mark.parametrize("registered", [429, HTTPException, RateLimitHTTPException])
def test_an_apps_own_handler_for_the_429_is_respected(
        limiter: rl.AsyncLimiter, serve: Any, registered: Any) -> None:
    decisions: list[Any] = []

    def mine(request: Request[Any, Any, Any], exc: Exception) -> Response[str]:
        assert isinstance(exc, RateLimitHTTPException)
        decisions.append(exc.decision)
        return Response("slow down", status_code=429, headers=exc.headers,
                        media_type="text/plain")

    app = Litestar([index], plugins=[RateLimitPlugin(limiter, default="1/minute")],
                   exception_handlers={registered: mine}, openapi_config=None,
                   logging_config=None)
    client = serve(app)
    client.get("/")
    refused = client.get("/")
    assert (refused.status_code, refused.text) == (429, "slow down")
    assert "retry-after" in refused.headers and "ratelimit" in refused.headers
    assert decisions[0].allowed is False


def test_the_handler_passes_other_exceptions_on() -> None:
    error = ValueError("not ours")
    with pytest.raises(ValueError, match="not ours"):
        rate_limit_exception_handler(None, error)  # type: ignore[arg-type]


# -- backend failures --------------------------------------------------------------------------
def test_backend_down_allow_admits_and_deny_answers_503(serve: Any) -> None:
    allow = serve(app_of(rl.AsyncLimiter(failing_backend("down")), [index], default="1/minute"))
    assert statuses(allow, "/", 3) == [200] * 3
    deny = serve(app_of(rl.AsyncLimiter(failing_backend("down")), [index], default="1/minute",
                        on_backend_error="deny", backend_cooldown=5))
    reply = deny.get("/")
    assert (reply.status_code, reply.headers["retry-after"]) == (503, "5")
    assert reply.json()["detail"] == "Rate limiter unavailable"


# -- OpenAPI -----------------------------------------------------------------------------------
def test_the_schema_documents_the_429_of_limited_operations(limiter: rl.AsyncLimiter) -> None:
    @get("/limited", signature_namespace=NS)
    @limiter.limit("1/minute")
    async def limited() -> str:
        return "l"

    @get("/free", signature_namespace=NS)
    @limiter.exempt
    async def free() -> str:
        return "f"

    @get("/login", opt={"ratelimit": "5/minute"}, responses={}, signature_namespace=NS)
    async def login() -> str:
        return "l"

    plain = Litestar([limited, free, login], plugins=[RateLimitPlugin(limiter)])
    paths = plain.openapi_schema.to_schema()["paths"]
    assert set(paths["/limited"]["get"]["responses"]) == {"200", "429"}
    assert set(paths["/free"]["get"]["responses"]) == {"200"}
    too_many = paths["/login"]["get"]["responses"]["429"]
    assert set(too_many["headers"]) == {"Retry-After", "RateLimit", "RateLimit-Policy"}
    assert too_many["content"]["application/json"]["schema"]["properties"]["retry_after"] == {
        "type": "integer"}
    # A default limits every operation; an exempt one stays undocumented.
    defaulted = Litestar([limited, free], middleware=[
        DefineMiddleware(RateLimitMiddleware, limiter=rl.AsyncLimiter(), default="9/minute")])
    paths = defaulted.openapi_schema.to_schema()["paths"]
    assert "429" in paths["/limited"]["get"]["responses"]
    assert "429" not in paths["/free"]["get"]["responses"]


# -- WebSockets --------------------------------------------------------------------------------
def test_a_websocket_handshake_is_one_hit_refused_before_accept(
        limiter: rl.AsyncLimiter, serve: Any) -> None:
    @websocket("/ws", signature_namespace=NS)
    async def echo(socket: WebSocket[Any, Any, Any]) -> None:
        await socket.accept()
        await socket.send_text(str(socket.scope["state"]["ratelimit"].remaining))
        await socket.close()

    client = serve(app_of(limiter, [echo], default="1/minute"))
    with client.websocket_connect("/ws") as socket:
        assert socket.receive_text() == "0"
    with pytest.raises(WebSocketDisconnect) as refused, client.websocket_connect("/ws") as ws:
        ws.receive_text()
    assert refused.value.code == 1008
    assert "rate limited; retry after" in str(refused.value.detail)


def test_a_websocket_holds_its_in_flight_slot_for_its_whole_connection(
        limiter: rl.AsyncLimiter, serve: Any) -> None:
    @websocket("/ws", signature_namespace=NS)
    async def echo(socket: WebSocket[Any, Any, Any]) -> None:
        await socket.accept()
        await socket.send_text(await socket.receive_text())
        await socket.close()

    client = serve(app_of(limiter, [echo], concurrency=1))
    with client.websocket_connect("/ws") as first:
        with pytest.raises(WebSocketDisconnect) as refused, \
                client.websocket_connect("/ws") as second:
            second.receive_text()
        assert refused.value.code == 1008
        first.send_text("still here")
        assert first.receive_text() == "still here"
    with client.websocket_connect("/ws") as again:  # the slot came back with the connection
        again.send_text("hi")
        assert again.receive_text() == "hi"


def test_websockets_false_leaves_them_alone(limiter: rl.AsyncLimiter, serve: Any) -> None:
    @websocket("/ws", signature_namespace=NS)
    async def echo(socket: WebSocket[Any, Any, Any]) -> None:
        await socket.accept()
        await socket.send_text("hi")
        await socket.close()

    client = serve(app_of(limiter, [echo], default="1/minute", websockets=False))
    for _ in range(3):
        with client.websocket_connect("/ws") as socket:
            assert socket.receive_text() == "hi"


# -- packaging ---------------------------------------------------------------------------------
def test_importing_ratelimit_mw_imports_no_litestar() -> None:
    code = ("import sys, ratelimit_mw, ratelimit_mw.keys, ratelimit_mw.http.guard; "
            "print(json.dumps('litestar' in sys.modules))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], check=True,
                         capture_output=True, text=True).stdout
    assert json.loads(out) is False


def test_the_generic_asgi_middleware_in_define_middleware_is_refused_at_start_up(
        limiter: rl.AsyncLimiter) -> None:
    # Built per route handler, it could not see @limiter.limit: on efbcb84 six of six were
    # admitted at 3/minute. Refused with what to write instead.
    from ratelimit_mw.asgi import RateLimitMiddleware as GenericMiddleware

    @get("/report")
    @limiter.limit("3/minute")
    async def report() -> str:
        return "ok"

    with pytest.raises(rl.ConfigurationError, match=r"RateLimitPlugin\(limiter.*ratelimit_mw"
                                                    r"\.litestar"):
        Litestar([report], middleware=[
            DefineMiddleware(GenericMiddleware, limiter=limiter, default="100/minute")])


def test_the_generic_asgi_middleware_around_the_whole_app_still_limits_by_path(
        limiter: rl.AsyncLimiter) -> None:
    from ratelimit_mw.asgi import RateLimitMiddleware as GenericMiddleware

    @get("/items")
    async def items() -> str:
        return "ok"

    app = GenericMiddleware(Litestar([items]), limiter=limiter, default="2/minute")
    with TestClient(app) as client:  # type: ignore[arg-type]
        assert [client.get("/nowhere").status_code for _ in range(3)] == [404, 404, 429]


def test_the_migrated_spelling_keeps_litestars_per_handler_limit_adding_to_the_app_wide_one(
        limiter: rl.AsyncLimiter, serve: Any) -> None:
    # Litestar: RateLimitConfig(("minute", 15)) app-wide and ("minute", 5) on POST /login add
    # up. The rule spelling does the same; a decorator would replace the app-wide limit.
    from litestar import post

    @post("/login")
    async def login() -> str:
        return "ok"

    @get("/items")
    async def items() -> str:
        return "ok"

    client = serve(Litestar([login, items], plugins=[RateLimitPlugin(
        limiter, default="15/minute", rules=[Rule("/login", "5/minute", methods=["POST"])])]))
    logins = [client.post("/login").status_code for _ in range(7)]
    items_ = [client.get("/items").status_code for _ in range(25)]
    assert logins == [201] * 5 + [429] * 2
    # Litestar admitted 8 more (it also charged the two refused logins); a refusal here
    # charges nothing, so 10 remain.
    assert items_.count(200) == 10 and items_[10:] == [429] * 15
