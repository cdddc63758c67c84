"""Keys under the ASGI middleware: hostile forwarding headers, odd header bytes, key bugs."""

from __future__ import annotations

import logging

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

import ratelimit_mw as rl
from ratelimit_mw import keys
from ratelimit_mw.asgi import RateLimitMiddleware

PEER = ("203.0.113.7", 50000)
PROXY = ("10.0.0.1", 50000)

HOSTILE_VALUES: list[bytes] = [
    b"",
    b"unknown",
    b"198.51.100.1",
    b"198.51.100.1, 198.51.100.2, 198.51.100.3",
    b"for=198.51.100.9",
    b'for="[2001:db8::1]:4711"',
    b'for="[::1',
    b"for=",
    b'"',
    b",,,,,,,,",
    b"999.999.999.999",
    b"::ffff:999.1.1.1",
    b"_hidden, for=_obfuscated",
    b"\x00\x01\x02",
    "ünïcødé, ☃".encode(),
    b"\xff\xfe\xfd",
    b"1.2.3.4 " * 4000,
    b"for=1.2.3.4;proto=http;by=" + b"x" * 20000,
    b", ".join(b"10.0.0.%d" % (i % 250) for i in range(5000)),
]


async def hello(request: Request) -> Response:
    return PlainTextResponse("hello")


def app_with(limiter: rl.AsyncLimiter, **options) -> Starlette:
    app = Starlette(routes=[Route("/", hello)])
    app.add_middleware(RateLimitMiddleware, limiter=limiter, **options)
    return app


def test_spoofed_forwarding_headers_do_not_change_the_key_without_trusted_proxies(
        alimiter, serve):
    client = serve(app_with(alimiter, default="2/minute"), client=PEER)
    statuses = [
        client.get("/", headers={"X-Forwarded-For": f"198.51.100.{i}",
                                 "Forwarded": f"for=198.51.100.{i}"}).status_code
        for i in range(4)
    ]
    assert statuses == [200, 200, 429, 429]


def test_behind_a_trusted_proxy_each_forwarded_client_has_its_own_quota(alimiter, serve):
    key = keys.client_ip(trusted_proxies=["10.0.0.0/8"])
    client = serve(app_with(alimiter, default="1/minute", key=key), client=PROXY)
    first = [client.get("/", headers={"X-Forwarded-For": f"198.51.100.{i}"}).status_code
             for i in range(3)]
    repeat = client.get("/", headers={"X-Forwarded-For": "198.51.100.0"})

    assert first == [200, 200, 200]
    assert repeat.status_code == 429


def test_a_client_cannot_escape_the_trusted_proxy_by_prepending_addresses(alimiter, serve):
    key = keys.client_ip(trusted_proxies=["10.0.0.0/8"])
    client = serve(app_with(alimiter, default="1/minute", key=key), client=PROXY)
    statuses = [
        client.get("/", headers={"X-Forwarded-For": f"192.0.2.{i}, 198.51.100.5"}).status_code
        for i in range(3)
    ]
    assert statuses == [200, 429, 429]


@pytest.mark.parametrize("trusted", [None, ["10.0.0.0/8"], 2], ids=["none", "cidr", "hops"])
def test_garbage_in_forwarding_headers_never_raises(trusted, alimiter, serve):
    key = keys.client_ip(trusted_proxies=trusted)
    client = serve(app_with(alimiter, default="1000/minute", key=key), client=PROXY)
    for value in HOSTILE_VALUES:
        for name in ("x-forwarded-for", "forwarded"):
            response = client.get("/", headers=[(name.encode(), value)])
            assert response.status_code == 200, (name, value[:40])


def test_huge_and_non_ascii_key_headers_are_limited_like_any_other(alimiter, serve):
    client = serve(app_with(alimiter, default="1/minute", key=keys.header("X-Api-Key")))
    for value in ["ключ-🔑".encode(), b"k" * 65536, b"\xff{}\x00"]:
        first = client.get("/", headers=[(b"x-api-key", value)])
        second = client.get("/", headers=[(b"x-api-key", value)])
        assert (first.status_code, second.status_code) == (200, 429), value[:20]


async def test_a_key_function_that_raises_falls_back_to_the_client_ip(caplog):
    from asgi_support import call_asgi, http_scope

    def broken(request: Request) -> str:
        raise KeyError("bug in the key function")

    async def app(scope, receive, send):
        await PlainTextResponse("ok")(scope, receive, send)

    middleware = RateLimitMiddleware(app, rl.AsyncLimiter(), default="1/minute", key=broken)
    with caplog.at_level(logging.WARNING, logger="ratelimit_mw"):
        first = await call_asgi(middleware, http_scope(client=("198.51.100.1", 1)))
        second = await call_asgi(middleware, http_scope(client=("198.51.100.1", 1)))
        other = await call_asgi(middleware, http_scope(client=("198.51.100.2", 1)))

    assert [m[0]["status"] for m in (first, second, other)] == [200, 429, 200]
    assert "key function raised" in caplog.text


def test_key_functions_get_one_starlette_request_per_request(alimiter, serve):
    from ratelimit_mw.asgi import Rule

    seen: list[int] = []

    def remember(request: Request) -> str:
        assert isinstance(request, Request)
        seen.append(id(request))
        return "same"

    def remember_too(request: Request) -> str:
        return remember(request)

    client = serve(app_with(alimiter, default="5/minute", key=remember,
                            rules=[Rule("/", "7/minute", key=remember_too)]))
    client.get("/")
    assert len(seen) == 2
    assert seen[0] == seen[1]


def test_a_key_shared_by_several_limits_is_asked_once_per_request(alimiter, serve):
    from ratelimit_mw.asgi import Rule

    asked: list[str] = []

    def remember(request: Request) -> str:
        asked.append(request.url.path)
        return "same"

    client = serve(app_with(alimiter, default="5/minute", key=remember,
                            rules=[Rule("/", "7/minute", key=remember)]))
    response = client.get("/")
    assert asked == ["/"]
    assert ";r=4;" in response.headers["RateLimit"]
