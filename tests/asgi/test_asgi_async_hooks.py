"""Hooks may be ``async def`` under ASGI: awaited, never taken for their coroutine.

Before, an async ``exempt_when`` switched the limit off (a coroutine is truthy: 8 of 8
admitted at 3/minute, nothing logged), an async dynamic limit was skipped, an async key
counted everyone under the client IP and an async cost answered 500. Each hook kind, in
each place it is given (middleware-wide, a rule, a route decorator, the FastAPI
dependency), is held to what its sync twin does. Under WSGI and Flask an async hook is a
ConfigurationError at configuration that names it.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

import ratelimit_mw as rl
from ratelimit_mw import asgi, keys


async def endpoint(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


async def statuses(app: Any, count: int, headers: dict[str, str] | None = None,
                   path: str = "/") -> list[int]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        return [(await client.get(path, headers=headers or {})).status_code
                for _ in range(count)]


async def user_key(request: Request) -> str:
    return "u:" + request.headers.get("x-user", "none")


async def never_exempt(request: Request) -> bool:
    return False


async def always_exempt(request: Request) -> bool:
    return True


async def three_a_minute(request: Request) -> str:
    return "3/minute"


async def cost_of_two(request: Request) -> int:
    return 2


class Awaitable:
    """An object whose __call__ is async, as a hook."""

    async def __call__(self, request: Request) -> bool:
        return False


def app(limiter: rl.AsyncLimiter, **options: Any) -> Any:
    return asgi.RateLimitMiddleware(Starlette(routes=[Route("/", endpoint)]), limiter,
                                    **options)


@pytest.fixture
def limiter(prefix: str) -> rl.AsyncLimiter:
    return rl.AsyncLimiter(rl.MemoryBackend(), prefix=prefix)


@pytest.mark.parametrize("exempt_when", [never_exempt, Awaitable()], ids=["def", "callable"])
async def test_an_async_exempt_when_that_says_no_leaves_the_limit_on(
    limiter: rl.AsyncLimiter, exempt_when: Any,
) -> None:
    got = await statuses(app(limiter, default="3/minute", exempt_when=exempt_when), 8)
    assert got == [200] * 3 + [429] * 5


async def test_an_async_exempt_when_that_says_yes_exempts(limiter: rl.AsyncLimiter) -> None:
    got = await statuses(app(limiter, default="3/minute", exempt_when=always_exempt), 5)
    assert got == [200] * 5


async def test_an_async_key_counts_per_its_answer(limiter: rl.AsyncLimiter) -> None:
    middleware = app(limiter, default="2/minute", key=user_key)
    a = await statuses(middleware, 3, {"x-user": "a"})
    b = await statuses(middleware, 3, {"x-user": "b"})
    assert a == b == [200, 200, 429]
    assert (await limiter.peek("2/minute", "u:a")).remaining == 0


async def test_an_async_rule_hooks_are_awaited(limiter: rl.AsyncLimiter) -> None:
    rule = asgi.Rule("/", three_a_minute, key=user_key, cost=cost_of_two,
                     exempt_when=never_exempt)
    got = await statuses(app(limiter, rules=[rule]), 3, {"x-user": "r"})
    assert got == [200, 429, 429]  # cost 2 of 3: one admitted


async def test_async_hooks_on_a_route_decorator_are_awaited(limiter: rl.AsyncLimiter) -> None:
    @limiter.limit(three_a_minute, key=user_key, cost=cost_of_two, exempt_when=never_exempt)
    async def limited(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    middleware = asgi.RateLimitMiddleware(Starlette(routes=[Route("/l", limited)]), limiter)
    assert await statuses(middleware, 3, {"x-user": "d"}, "/l") == [200, 429, 429]


async def test_an_async_hook_that_raises_fails_like_a_sync_one(
    limiter: rl.AsyncLimiter, caplog: pytest.LogCaptureFixture,
) -> None:
    async def broken(request: Request) -> bool:
        raise RuntimeError("hook bug")

    with caplog.at_level(logging.WARNING, logger="ratelimit_mw"):
        got = await statuses(app(limiter, default="2/minute", exempt_when=broken), 3)
    assert got == [200, 200, 429]  # limited, as when a sync exempt_when raises
    assert "exempt_when raised" in caplog.text


async def test_the_fastapi_dependency_awaits_async_hooks(prefix: str) -> None:
    from fastapi import Depends, FastAPI

    from ratelimit_mw.fastapi import RateLimitDependency

    limiter = rl.AsyncLimiter(rl.MemoryBackend(), prefix=prefix)
    api = FastAPI()
    limited = RateLimitDependency(limiter, "2/minute", key=user_key,
                                  exempt_when=never_exempt)

    @api.get("/", dependencies=[Depends(limited)])
    async def root() -> dict[str, str]:
        return {"ok": "yes"}

    assert await statuses(api, 3, {"x-user": "f"}) == [200, 200, 429]


async def test_an_uncharged_preflight_runs_no_async_hook(prefix: str) -> None:
    from fastapi import Depends, FastAPI

    from ratelimit_mw.fastapi import RateLimitDependency

    asked: list[str] = []

    async def counting_key(request: Request) -> str:
        asked.append(request.method)
        return "k"

    limiter = rl.AsyncLimiter(rl.MemoryBackend(), prefix=prefix)
    api = FastAPI()

    @api.api_route("/", methods=["GET", "OPTIONS"],
                   dependencies=[Depends(RateLimitDependency(limiter, "5/minute",
                                                             key=counting_key))])
    async def root() -> dict[str, str]:
        return {"ok": "yes"}

    preflight = {"origin": "http://x", "access-control-request-method": "GET"}
    middleware = app(limiter, default="5/minute", key=counting_key)
    for target in (api, middleware):
        transport = httpx.ASGITransport(app=target)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            for _ in range(3):
                await client.options("/", headers=preflight)
    assert asked == []


def test_async_hooks_are_a_configuration_error_under_wsgi_and_flask(prefix: str) -> None:
    from flask import Blueprint, Flask

    from ratelimit_mw import wsgi
    from ratelimit_mw.flask import RateLimit

    sync_limiter = rl.Limiter(rl.MemoryBackend(), prefix=prefix)

    def wsgi_app(environ: Any, start_response: Any) -> list[bytes]:
        start_response("200 OK", [])
        return [b"ok"]

    cases: list[tuple[str, Any]] = [
        ("exempt_when=never_exempt", lambda: wsgi.RateLimitMiddleware(
            wsgi_app, sync_limiter, default="1/minute", exempt_when=never_exempt)),
        ("key=user_key", lambda: wsgi.RateLimitMiddleware(
            wsgi_app, sync_limiter, default="1/minute", key=user_key)),
        ("cost of the rule '/x'=cost_of_two", lambda: wsgi.RateLimitMiddleware(
            wsgi_app, sync_limiter, rules=[wsgi.Rule("/x", "1/minute", cost=cost_of_two)])),
        ("exempt_when=Awaitable", lambda: RateLimit(
            Flask(__name__), limiter=sync_limiter, exempt_when=Awaitable())),
        ("key=user_key", lambda: sync_limiter.limit("1/minute", key=user_key)),
        ("rates=three_a_minute", lambda: sync_limiter.limit(three_a_minute)),
        ("cost=cost_of_two", lambda: RateLimit(Flask(__name__), limiter=sync_limiter)
         .limit_blueprint(Blueprint("b", __name__), "1/minute", cost=cost_of_two)),
    ]
    for named, build in cases:
        with pytest.raises(rl.ConfigurationError) as raised:
            build()
        assert named in str(raised.value) and "plain def" in str(raised.value), raised.value


def test_a_plain_hook_returning_a_coroutine_is_never_taken_for_its_answer(
    prefix: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """A lambda around an async function passes the configuration check; under WSGI its
    coroutine is closed and the hook fails as if it had raised: the limit stays on."""
    from ratelimit_mw import wsgi

    limiter = rl.Limiter(rl.MemoryBackend(), prefix=prefix)

    def wsgi_app(environ: Any, start_response: Any) -> list[bytes]:
        start_response("200 OK", [])
        return [b"ok"]

    middleware = wsgi.RateLimitMiddleware(
        wsgi_app, limiter, default="2/minute",
        exempt_when=lambda request: always_exempt(request))  # returns a coroutine
    transport = httpx.WSGITransport(app=middleware)
    with caplog.at_level(logging.WARNING, logger="ratelimit_mw"), \
            httpx.Client(transport=transport, base_url="http://t") as client:
        got = Counter(client.get("/").status_code for _ in range(4))
    assert got == {200: 2, 429: 2}
    assert "exempt_when raised" in caplog.text
    assert keys  # the keys module is what a user would reach for instead
