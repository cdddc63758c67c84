"""Per-route limits: decorators found wherever Starlette or FastAPI routes to the endpoint.

Each app has a generous default (10/minute) so that a decorated route (2/minute) and an
exempt one are told apart from the default by how many requests they admit.
"""

# No "from __future__ import annotations": FastAPI resolves the endpoints' annotations,
# which name local dependencies, at runtime.

import functools
from collections.abc import Callable
from typing import Annotated, Any

import pytest
from asgi_support import call_asgi, http_scope
from fastapi import APIRouter, Depends, FastAPI
from starlette.applications import Starlette
from starlette.endpoints import HTTPEndpoint
from starlette.middleware import Middleware
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Host, Mount, Route, Router, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocket

import ratelimit_mw as rl
from ratelimit_mw import keys
from ratelimit_mw.asgi import RateLimitMiddleware
from ratelimit_mw.keys import ROUTE_SCOPE_KEY

DEFAULT = "10/minute"


def count_admitted(client: TestClient, path: str, n: int = 12, method: str = "GET") -> int:
    return sum(client.request(method, path).status_code != 429 for _ in range(n))


def limited_app(app: Any, limiter: rl.AsyncLimiter, **options: Any) -> Any:
    app.add_middleware(RateLimitMiddleware, limiter=limiter, default=DEFAULT, **options)
    return app


async def template(request: Request) -> Response:
    return PlainTextResponse(str(request.scope.get(ROUTE_SCOPE_KEY)))


async def ws_endpoint(websocket: WebSocket) -> None:
    await websocket.accept()
    await websocket.close()


# -- Starlette ------------------------------------------------------------------------------
def starlette_app(limiter: rl.AsyncLimiter) -> Starlette:
    @limiter.limit("2/minute")
    async def limited(request: Request) -> Response:
        return PlainTextResponse("limited")

    @limiter.limit("2/minute")
    def limited_sync(request: Request) -> Response:
        return PlainTextResponse("limited sync")

    @limiter.exempt
    async def free(request: Request) -> Response:
        return PlainTextResponse("free")

    async def plain(request: Request) -> Response:
        return PlainTextResponse("plain")

    @limiter.limit("2/minute")
    async def in_sub_app(request: Request) -> Response:
        return PlainTextResponse("sub app")

    @limiter.exempt
    async def exempt_in_wrapped_sub_app(request: Request) -> Response:
        return PlainTextResponse("wrapped")

    class Things(HTTPEndpoint):
        @limiter.limit("2/minute")
        async def get(self, request: Request) -> Response:
            return PlainTextResponse("get")

        async def post(self, request: Request) -> Response:
            return PlainTextResponse("post")

    @limiter.limit("2/minute")
    class Everything(HTTPEndpoint):
        async def get(self, request: Request) -> Response:
            return PlainTextResponse("class-wide")

    sub_app = Starlette(routes=[Route("/deep/{id}", in_sub_app)])
    wrapped_sub_app = Starlette(routes=[Route("/free", exempt_in_wrapped_sub_app)],
                                middleware=[Middleware(GZipMiddleware)])
    return Starlette(routes=[
        Route("/limited", limited),
        Route("/limited-sync", limited_sync),
        Route("/free", free),
        Route("/plain", plain),
        Route("/things", Things),
        Route("/everything", Everything),
        WebSocketRoute("/ws", ws_endpoint),
        Mount("/mounted", routes=[
            Route("/limited/{id:int}", limited),
            Route("/template/{id}", template),
            Mount("/nested", routes=[Route("/free", free)]),
        ]),
        Mount("/router", app=Router(routes=[Route("/limited", limited)])),
        Mount("/sub/{tenant}", app=sub_app),
        Mount("/wrapped", app=GZipMiddleware(wrapped_sub_app)),
    ])


STARLETTE_CASES = [
    ("/limited", 2),
    ("/limited-sync", 2),
    ("/free", 12),
    ("/plain", 10),
    ("/things", 2),
    ("/everything", 2),
    ("/mounted/limited/7", 2),
    ("/mounted/nested/free", 12),
    ("/router/limited", 2),
    ("/sub/acme/deep/1", 2),
    ("/wrapped/free", 12),
    ("/mounted/limited/not-an-int", 10),  # no route matches inside the mount: defaults
    ("/nowhere", 10),  # unresolved: defaults, never exempt
]


@pytest.mark.parametrize(("path", "admitted"), STARLETTE_CASES)
def test_starlette_decorators_are_found_wherever_the_router_sends_the_request(
        path, admitted, alimiter, serve):
    client = serve(limited_app(starlette_app(alimiter), alimiter))
    assert count_admitted(client, path) == admitted


def test_a_class_based_endpoint_limits_only_its_decorated_method(alimiter, serve):
    client = serve(limited_app(starlette_app(alimiter), alimiter))
    assert count_admitted(client, "/things", method="POST") == 10
    assert count_admitted(client, "/things", method="HEAD") == 2  # HEAD runs get()


def test_one_decorated_endpoint_on_two_routes_shares_one_quota(alimiter, serve):
    client = serve(limited_app(starlette_app(alimiter), alimiter))
    assert count_admitted(client, "/limited", n=1) == 1
    assert count_admitted(client, "/mounted/limited/1", n=1) == 1
    assert count_admitted(client, "/router/limited", n=1) == 0


def test_the_template_includes_every_mount_prefix(alimiter, serve):
    client = serve(limited_app(starlette_app(alimiter), alimiter))
    assert client.get("/mounted/template/42").text == "/mounted/template/{id}"


def test_a_websocket_route_in_the_tree_is_not_in_the_way(alimiter, serve):
    client = serve(limited_app(starlette_app(alimiter), alimiter))
    with client.websocket_connect("/ws"):
        pass
    assert count_admitted(client, "/limited") == 2


def test_wrapped_endpoints_keep_their_limits():
    limiter = rl.AsyncLimiter()

    def logged(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        async def wrapper(request: Request) -> Response:
            return await func(request)  # type: ignore[no-any-return]
        return wrapper

    @logged
    @limiter.limit("2/minute")
    async def decorated_inside(request: Request) -> Response:
        return PlainTextResponse("inside")

    @limiter.limit("2/minute")
    @logged
    async def decorated_outside(request: Request) -> Response:
        return PlainTextResponse("outside")

    async def base(request: Request, greeting: str) -> Response:
        return PlainTextResponse(greeting)

    partial = limiter.limit("2/minute")(functools.partial(base, greeting="hi"))
    app = limited_app(Starlette(routes=[
        Route("/inside", decorated_inside),
        Route("/outside", decorated_outside),
        Route("/partial", partial),
    ]), limiter)
    with TestClient(app) as client:
        assert [count_admitted(client, p) for p in ("/inside", "/outside", "/partial")] == \
            [2, 2, 2]


def test_host_routes_are_resolved_per_host():
    limiter = rl.AsyncLimiter()

    @limiter.limit("2/minute")
    async def api(request: Request) -> Response:
        return PlainTextResponse("api")

    async def site(request: Request) -> Response:
        return PlainTextResponse("site")

    app = limited_app(Starlette(routes=[
        Host("api.example.com", app=Router(routes=[Route("/", api)])),
        Host("{sub}.example.com", app=Router(routes=[Route("/", site)])),
    ]), limiter)
    with TestClient(app, base_url="http://api.example.com") as client:
        assert count_admitted(client, "/") == 2
        www = sum(client.get("http://www.example.com/").status_code == 200 for _ in range(12))
        assert www == 10


# -- FastAPI ----------------------------------------------------------------------------------
def fastapi_app(limiter: rl.AsyncLimiter) -> FastAPI:
    app = FastAPI()
    users = APIRouter()

    def current_user(x_user: str = "anon") -> str:
        return x_user

    @users.get("/{user_id}")
    @limiter.limit("2/minute")
    async def get_user(user_id: int,
                       who: Annotated[str, Depends(current_user)]) -> dict[str, Any]:
        return {"id": user_id, "who": who}

    @limiter.limit("2/minute")  # above the route decorator works as well
    @users.post("/{user_id}")
    def update_user(user_id: int) -> dict[str, Any]:
        return {"id": user_id}

    @users.get("/{user_id}/ping")
    @limiter.exempt
    async def ping(user_id: int) -> dict[str, Any]:
        return {}

    @users.get("/{user_id}/template")
    async def user_template(user_id: int, request: Request) -> str:
        return str(request.scope.get(ROUTE_SCOPE_KEY))

    admin = APIRouter(prefix="/admin")

    @admin.get("/stats")
    @limiter.limit("2/minute")
    def stats() -> dict[str, Any]:
        return {}

    users.include_router(admin)
    app.include_router(users, prefix="/api/users")

    sub = FastAPI()

    @sub.get("/items/{item_id}")
    @limiter.limit("2/minute")
    async def sub_item(item_id: str) -> dict[str, Any]:
        return {}

    sub_router = APIRouter()

    @sub_router.get("/free")
    @limiter.exempt
    async def sub_free() -> dict[str, Any]:
        return {}

    sub.include_router(sub_router, prefix="/r")
    app.mount("/v2", sub)

    @app.get("/plain")
    async def plain() -> dict[str, Any]:
        return {}

    return app


FASTAPI_CASES = [
    ("GET", "/api/users/1", 2),
    ("POST", "/api/users/1", 2),
    ("GET", "/api/users/1/ping", 12),
    ("GET", "/api/users/admin/stats", 2),
    ("GET", "/v2/items/abc", 2),
    ("GET", "/v2/r/free", 12),
    ("GET", "/plain", 10),
    ("GET", "/api/users/not-an-int", 2),  # FastAPI answers 422, but the route matched
    ("GET", "/api/nothing", 10),
]


@pytest.mark.parametrize(("method", "path", "admitted"), FASTAPI_CASES)
def test_fastapi_decorators_are_found_in_included_routers_and_sub_apps(
        method, path, admitted, alimiter, serve):
    client = serve(limited_app(fastapi_app(alimiter), alimiter))
    assert count_admitted(client, path, method=method) == admitted


def test_all_ids_of_one_fastapi_route_count_together(alimiter, serve):
    client = serve(limited_app(fastapi_app(alimiter), alimiter))
    statuses = [client.get(f"/api/users/{i}").status_code for i in range(3)]
    assert statuses == [200, 200, 429]


def test_the_fastapi_template_carries_the_include_prefix(alimiter, serve):
    client = serve(limited_app(fastapi_app(alimiter), alimiter))
    assert client.get("/api/users/5/template").json() == "/api/users/{user_id}/template"


# -- route keying ---------------------------------------------------------------------------
def test_keying_by_route_counts_every_path_of_one_template_together(alimiter, serve):
    async def user(request: Request) -> Response:
        return PlainTextResponse("user")

    async def item(request: Request) -> Response:
        return PlainTextResponse("item")

    app = Starlette(routes=[Route("/users/{id}", user), Route("/items/{id}", item)])
    app.add_middleware(RateLimitMiddleware, limiter=alimiter, default="2/minute",
                       key=keys.compose(keys.client_ip(), keys.route()))
    client = serve(app)
    users = [client.get(f"/users/{i}").status_code for i in range(3)]
    items = [client.get(f"/items/{i}").status_code for i in range(3)]
    unmatched = [client.get(f"/random/{i}").status_code for i in range(3)]

    assert users == [200, 200, 429]
    assert items == [200, 200, 429]
    assert unmatched == [404, 404, 429]  # every unmatched path shares one bucket


# -- resolution mechanics ---------------------------------------------------------------------
def echo_template_app(**options: Any) -> tuple[Starlette, RateLimitMiddleware]:
    inner = Starlette(routes=[Route("/users/{id}", template)])
    middleware = RateLimitMiddleware(inner, rl.AsyncLimiter(), default=DEFAULT, **options)
    return inner, middleware


async def test_nothing_is_resolved_when_no_route_is_decorated_and_no_key_needs_it():
    _, middleware = echo_template_app()
    sent = await call_asgi(middleware, http_scope("/users/1"))
    assert sent[1]["body"] == b"None"
    assert middleware._resolver._cache == {}


async def test_a_key_that_may_read_the_route_turns_resolution_on():
    _, middleware = echo_template_app(key=lambda request: keys.route()(request))
    sent = await call_asgi(middleware, http_scope("/users/1"))
    assert sent[1]["body"] == b"/users/{id}"


async def test_a_route_added_after_the_first_request_is_seen():
    inner, middleware = echo_template_app()
    await call_asgi(middleware, http_scope("/late"))

    @middleware.limiter.limit("1/minute")
    async def late(request: Request) -> Response:
        return PlainTextResponse("late")

    inner.add_route("/late", late)
    statuses = [(await call_asgi(middleware, http_scope("/late")))[0]["status"]
                for _ in range(2)]
    assert statuses == [200, 429]


async def test_the_resolution_cache_stays_bounded_whatever_paths_clients_send():
    limiter = rl.AsyncLimiter()

    @limiter.limit("1000/minute")
    async def user(request: Request) -> Response:
        return PlainTextResponse("u")

    middleware = RateLimitMiddleware(Starlette(routes=[Route("/users/{id}", user)]), limiter)
    for i in range(5000):
        await call_asgi(middleware, http_scope(f"/users/{i}"))

    assert 0 < len(middleware._resolver._cache) <= 4096


async def test_an_app_without_a_router_gets_the_defaults():
    async def bare(scope, receive, send):
        await PlainTextResponse("bare")(scope, receive, send)

    middleware = RateLimitMiddleware(bare, rl.AsyncLimiter(), default="1/minute",
                                     key=keys.compose(keys.client_ip(), keys.route()))
    statuses = [(await call_asgi(middleware, http_scope("/x")))[0]["status"] for _ in range(2)]
    assert statuses == [200, 429]

