"""Per-route limits (`ratelimit_mw.routing`): what a decorator accepts, and which
methods its limit applies to."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

import ratelimit_mw as rl
from ratelimit_mw.asgi import Config, RateLimitMiddleware
from ratelimit_mw.routing import route_limits, validate_methods


@pytest.mark.parametrize(
    ("methods", "mentions"),
    [
        ("POST", "not the string 'POST'"),
        ([], "at least one method"),
        ([""], "HTTP method names"),
        (["GET POST"], "HTTP method names"),
        (["GET\r\n"], "HTTP method names"),
        ([b"GET"], "HTTP method names"),
        ([None], "HTTP method names"),
    ],
)
def test_a_decorator_with_methods_it_could_never_match_fails_at_import(
    methods: Any, mentions: str
) -> None:
    with pytest.raises(rl.ConfigurationError, match=mentions):
        rl.AsyncLimiter().limit("1/minute", methods=methods)


@pytest.mark.parametrize(
    ("methods", "normalised"),
    [
        (None, None),
        (["post"], frozenset({"POST"})),
        (["GET"], frozenset({"GET", "HEAD"})),  # HEAD is served by the GET handler
        (("PROPFIND", "MKCOL"), frozenset({"PROPFIND", "MKCOL"})),
    ],
)
def test_methods_are_upper_cased_and_get_covers_head(
    methods: Any, normalised: frozenset[str] | None
) -> None:
    assert validate_methods(methods) == normalised


def _dav_app() -> TestClient:
    limiter = rl.AsyncLimiter(rl.MemoryBackend())

    @limiter.limit("2/minute", methods=["PROPFIND"])
    async def dav(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/dav", dav, methods=["PROPFIND", "MKCOL"])])
    app.add_middleware(RateLimitMiddleware, limiter=limiter, default="100/minute")
    return TestClient(app)


@pytest.mark.parametrize("first", [None, "MKCOL", "FOO"])
def test_a_limit_for_an_unusual_method_holds_whatever_methods_came_first(
    first: str | None,
) -> None:
    # Methods outside the common ones share one selection cache entry, except one that a
    # route's limit names: one MKCOL (or invented FOO) request used to put PROPFIND on the
    # default for good.
    client = _dav_app()
    if first is not None:
        client.request(first, "/dav")
    statuses = [client.request("PROPFIND", "/dav").status_code for _ in range(3)]
    assert statuses == [200, 200, 429]
    assert client.request("MKCOL", "/dav").headers["ratelimit-policy"] == '"minute";q=100;w=60'


def test_decorators_sharing_a_sliding_log_name_must_keep_it_for_one_window() -> None:
    # One name, one log in the store: a 1-second namesake would trim the hits a 3/hour
    # limit still counts, and /a would admit ten requests in 20 s.
    limiter = rl.AsyncLimiter(rl.MemoryBackend())
    limiter.limit("3/hour", name="shared")(_endpoint("a"))
    with pytest.raises(rl.ConfigurationError, match="share the name 'shared'"):
        limiter.limit("3/second", name="shared")(_endpoint("b"))
    limiter.limit("5/hour", name="shared")(_endpoint("c"))  # the same window: one log is right
    limiter.limit("3/second", name="shared")  # a decorator not yet applied checks nothing


@pytest.mark.parametrize("decorated_first", [True, False])
def test_a_decorator_and_the_middleware_on_one_limiter_must_agree_on_a_log(
    decorated_first: bool,
) -> None:
    limiter = rl.AsyncLimiter(rl.MemoryBackend())
    config = Config(default=rl.Policy("3/second", name="shared"))

    def decorate() -> None:
        limiter.limit("3/hour", name="shared")(_endpoint("a"))

    def install() -> None:
        RateLimitMiddleware(Starlette(), limiter, config=config)

    first, second = (decorate, install) if decorated_first else (install, decorate)
    first()
    with pytest.raises(rl.ConfigurationError, match="share the name 'shared'"):
        second()


def test_other_limiters_and_other_algorithms_keep_their_own_names() -> None:
    # One name for two rates refuses only where they would count in one log: the same
    # limiter's sliding log. Here each keeps its name and its rate.
    endpoints = [
        rl.AsyncLimiter().limit("3/hour", name="n")(_endpoint("a")),
        rl.AsyncLimiter().limit("3/second", name="n")(_endpoint("b")),  # another limiter
    ]
    limiter = rl.AsyncLimiter()
    endpoints += [
        limiter.limit(rl.Policy("3/hour", name="n", algorithm="gcra"))(_endpoint("c")),
        limiter.limit(rl.Policy("3/second", name="n", algorithm="gcra"))(_endpoint("d")),
    ]
    bound = [route_limits(endpoint) for endpoint in endpoints]
    policies = [limits[0].policy for limits in bound if isinstance(limits, tuple)]
    assert [(p.name, str(p.rates[0])) for p in policies if p is not None] == [
        ("n", "3/hour"), ("n", "3/second"), ("n", "3/hour"), ("n", "3/second")]


def _endpoint(name: str) -> Any:
    async def endpoint(request: Request) -> PlainTextResponse:
        return PlainTextResponse(name)

    endpoint.__qualname__ = name
    return endpoint


@pytest.mark.parametrize("key", [
    rl.keys.compose(rl.keys.client_ip(), rl.keys.route()),   # what docs/migration.md advises
    None,                                                     # the middleware's key
])
def test_a_limit_shared_by_name_is_one_counter_across_routes_whatever_the_key(key: Any) -> None:
    limiter = rl.AsyncLimiter()

    @limiter.limit("3/minute", name="db")
    async def one(request: Request) -> PlainTextResponse:
        return PlainTextResponse("one")

    @limiter.limit("3/minute", name="db")
    async def two(request: Request) -> PlainTextResponse:
        return PlainTextResponse("two")

    @limiter.limit("1/minute")
    async def own(request: Request) -> PlainTextResponse:
        return PlainTextResponse("own")

    app = RateLimitMiddleware(
        Starlette(routes=[Route("/one", one), Route("/two", two), Route("/own", own),
                          Route("/also-own", own)]),
        limiter, config=Config(key=key) if key is not None else None)
    with TestClient(app) as client:
        # slowapi's shared limit answers so: one counter for both routes.
        assert [client.get(path).status_code for path in ("/one", "/two", "/one", "/two")] == [
            200, 200, 200, 429]
        # An unnamed limit keyed by route still counts per route.
        own_statuses = [client.get(path).status_code for path in ("/own", "/also-own")]
        assert own_statuses == ([200, 200] if key is not None else [200, 429])
