"""The guard's caches against fresh answers, on random requests.

`Guard.select` caches a selection per request shape, and a flood's refusals are rendered
once per shape (`refusal_shape`: what the 429 reads of their Decision). Both must give
what a fresh guard gives: the same selection, the same verdicts, the same headers, for any
request a client can send (methods, paths, headers, peers, garbage included). A handler
keeps the plan a response carries per identity: each client's give-back stays its own.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ratelimit_mw as rl
from ratelimit_mw.asgi import RateLimitMiddleware, Rule
from ratelimit_mw.core.identity import CACHED_LENGTH
from ratelimit_mw.http.asgi_send import DefaultResponses
from ratelimit_mw.http.config import Config
from ratelimit_mw.http.guard import Guard
from ratelimit_mw.http.verdict import _PLANS_KEPT, keep
from ratelimit_mw.routing import RouteLimit
from tests.conftest import StepClock


def _route_limit(rates: str, name: str, methods: list[str] | None = None) -> RouteLimit:
    """A decorator's limit as the middleware finds it on an endpoint (bound: named)."""
    return RouteLimit.make(rates, key=None, cost=1, name=name,
                           methods=methods).bound_to(_route_limit)


_ROUTES: list[Any] = [
    None,
    "exempt",
    (_route_limit("2/minute", "dav", ["PROPFIND"]),),
    (_route_limit("2/minute", "dav", ["PROPFIND"]),
     _route_limit("3/minute", "mk", ["MKCOL", "get"])),
    (_route_limit("4/minute", "any"),),
]
_CUSTOM_METHODS = st.sampled_from(["GET", "HEAD", "POST", "PROPFIND", "MKCOL", "FOO", "BREW",
                                   "propfind", "OPTIONS"])


def _shape(selection: Any) -> Any:
    """What a selection decides: its limits in order, how many are routed, its fallback."""
    if selection is None:
        return None
    return ([(item.policy, item.label, item.cost) for item in selection.applied],
            selection.routed, _shape(selection.fallback))


@settings(max_examples=200, deadline=None)
@given(rules=st.booleans(),
       batch=st.lists(st.tuples(_CUSTOM_METHODS, st.sampled_from(range(len(_ROUTES))),
                                st.sampled_from(["/", "/dav", "/api/x"])),
                      min_size=1, max_size=12))
def test_the_selection_cache_selects_as_a_fresh_guard_does(
    rules: bool, batch: list[Any]
) -> None:
    # Methods a client invents share one cache entry; a method a route's limit names must
    # not (one PROPFIND-only limit was lost for good after one MKCOL or FOO request).
    config = Config(default="100/minute",
                    rules=[Rule("/api/*", "9/minute", methods=["FOO"])] if rules else None)
    limiter = rl.Limiter()
    cached = Guard(config, limiter, timeout=None)
    for method, route, path in batch:
        fresh = Guard(config, limiter, timeout=None)
        assert (_shape(cached.select(method, path, _ROUTES[route]))
                == _shape(fresh.select(method, path, _ROUTES[route])))


class _Fresh:
    """The ASGI middleware with its refusal memos cleared before every request: the plain
    path, rendering and encoding every 429 from scratch."""

    def __init__(self, middleware: Any) -> None:
        self.middleware = middleware

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.middleware.guard._last_refusal = None
        self.middleware._defaults = DefaultResponses()
        await self.middleware(scope, receive, send)


async def _respond(app: Any, peer: str) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The response to one GET (status, headers, body)."""
    scope = {"type": "http", "method": "GET", "path": "/", "root_path": "",
             "query_string": b"", "headers": [], "client": (peer, 50000)}
    sent: list[Any] = []

    async def receive() -> Any:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    await app(scope, receive, send)
    start, body = sent
    return start["status"], start["headers"], body["body"]


async def _hello(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"hello"})


def _middleware(clock: StepClock, legacy: bool) -> RateLimitMiddleware:
    limiter = rl.AsyncLimiter(rl.MemoryBackend(), clock=clock)
    return RateLimitMiddleware(_hello, limiter=limiter, default="2/10s;5/minute",
                               legacy_headers=legacy)


@settings(max_examples=80, deadline=None)
@given(legacy=st.booleans(),
       steps=st.lists(st.tuples(st.sampled_from([0, 0, 0, 1, 999, 1_000, 400_000, 1_000_000,
                                                 9_000_000]),
                                st.sampled_from(["203.0.113.1", "203.0.113.2"])),
                      min_size=1, max_size=40))
def test_a_floods_refusals_rendered_once_are_the_refusals_rendered_fresh(
    legacy: bool, steps: list[tuple[int, str]]
) -> None:
    async def play() -> None:
        memo_clock, fresh_clock = StepClock(), StepClock()
        memo = _middleware(memo_clock, legacy)
        fresh = _Fresh(_middleware(fresh_clock, legacy))
        for advance_us, peer in steps:
            memo_clock.us += advance_us
            fresh_clock.us += advance_us
            assert await _respond(memo, peer) == await _respond(fresh, peer)

    asyncio.run(play())


async def test_a_flood_at_a_standing_clock_reuses_one_rendering_in_fresh_lists() -> None:
    clock = StepClock()
    app = _middleware(clock, legacy=False)
    for _ in range(3):  # admitted, admitted, refused by the store (then held by the cache)
        await _respond(app, "203.0.113.1")
    first = await _respond(app, "203.0.113.1")  # replayed by the deny cache
    refusal = app.guard._last_refusal
    assert first[0] == 429 and refusal is not None
    first[1].append((b"x-added-by-an-outer-middleware", b"1"))
    second = await _respond(app, "203.0.113.1")
    assert app.guard._last_refusal is refusal  # rendered once
    assert second[0] == 429
    assert (b"x-added-by-an-outer-middleware", b"1") not in second[1]
    assert second[1] == first[1][:-1]


async def test_a_floods_refusals_a_millisecond_apart_share_one_rendering() -> None:
    """Without the deny cache each refusal is the store's own Decision, its wait a
    millisecond shorter each time: the 429 is still rendered once while Retry-After's whole
    seconds stand, and each request keeps its own Decision."""
    clock = StepClock()
    limiter = rl.AsyncLimiter(rl.MemoryBackend(), clock=clock, deny_cache=0)
    app = RateLimitMiddleware(_hello, limiter=limiter, default="2/10s")
    for _ in range(3):
        await _respond(app, "203.0.113.1")
    refusal = app.guard._last_refusal
    assert refusal is not None
    answers = []
    for _ in range(3):
        clock.us += 1_000
        answers.append(await _respond(app, "203.0.113.1"))
        assert app.guard._last_refusal is refusal
    assert answers[0] == answers[1] == answers[2]
    assert answers[0][0] == 429


# -- the plan a response carries, kept per identity (`verdict.keep`) -------------------------

async def _status_app(scope: Any, receive: Any, send: Any) -> None:
    """Answers the status the path names ("/405" -> 405)."""
    await send({"type": "http.response.start", "status": int(scope["path"][1:]),
                "headers": []})
    await send({"type": "http.response.body", "body": b""})


@pytest.mark.parametrize("client_a, client_b, key", [
    ("203.0.113.1", "203.0.113.2", None),  # short: their plans are kept
    ("a" * 80, "b" * 80, rl.keys.header("X-Api-Key")),  # past the cached length: built anew
])
async def test_a_kept_plan_gives_back_its_own_clients_hit_only(client_a: str, client_b: str,
                                                               key: Any) -> None:
    # Plans are kept per identity: a 405 of one client, after another's request, must give
    # back the first client's hit, never the one whose plan was made last.
    limiter = rl.AsyncLimiter(rl.MemoryBackend(), clock=StepClock(), deny_cache=0)
    app = RateLimitMiddleware(_status_app, limiter=limiter, default="5/minute", key=key)
    for client, path in [(client_a, "/200"), (client_b, "/200"), (client_a, "/405"),
                         (client_b, "/200"), (client_a, "/405")]:
        scope = {"type": "http", "method": "GET", "path": path, "root_path": "",
                 "query_string": b"", "headers": [(b"x-api-key", client.encode())],
                 "client": (client if key is None else "192.0.2.1", 50000)}
        sent: list[Any] = []

        async def receive() -> Any:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: Any, sent: list[Any] = sent) -> None:
            sent.append(message)

        await app(scope, receive, send)
        assert sent[0]["status"] == int(path[1:])
    prefix = "ip:" if key is None else "h:x-api-key:"
    policy = rl.Policy("5/minute")
    # Each 405 of the first client gave back its own hit; the second's two stay counted.
    assert (await limiter.peek(policy, prefix + client_a)).remaining == 4
    assert (await limiter.peek(policy, prefix + client_b)).remaining == 3


@pytest.mark.parametrize("identity, kept_after", [
    ("ip:203.0.113.1", True),
    ("k" * CACHED_LENGTH, True),
    ("k" * (CACHED_LENGTH + 1), False),  # client text past the cached length: built anew
])
def test_a_plan_is_kept_for_a_short_identity_only(identity: str, kept_after: bool) -> None:
    kept: dict[str, Any] = {}
    plan = object()
    assert keep(kept, identity, plan) is plan  # type: ignore[arg-type]
    assert (identity in kept) is kept_after


def test_the_kept_plans_are_emptied_whole_when_full() -> None:
    kept: dict[str, Any] = {f"ip:{i}": object() for i in range(_PLANS_KEPT)}
    plan = object()
    keep(kept, "ip:new", plan)  # type: ignore[arg-type]
    assert kept == {"ip:new": plan}
