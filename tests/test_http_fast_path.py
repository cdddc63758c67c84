"""The guard's fast paths against its generic ones, on random requests.

`Guard.plan` takes a shortcut for a selection of one fixed policy (`Selection.single`), and
the adapters render the common headers from bytes prepared per selection. Both must give what
the generic path gives: the same checks, the same verdicts, the same headers, for any request
a client can send (methods, paths, headers, peers, garbage included).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
import redis
import redis.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.requests import Request

import ratelimit_mw as rl
from ratelimit_mw import keys
from ratelimit_mw.asgi import RateLimitMiddleware, Rule
from ratelimit_mw.http.config import Config
from ratelimit_mw.http.drive import check_sync
from ratelimit_mw.http.guard import Admit, Guard, Refuse
from ratelimit_mw.http.routing import RouteLimit
from tests.conftest import REDIS_URL, FakeClock, StepClock


def _raising(request: Any) -> str:
    raise RuntimeError("a key function's bug")


def _by_header(request: Any) -> Any:
    # None, a non-string, or a string, depending on the request: every branch of the plan.
    value = request.headers.get("x-kind")
    if value == "none":
        return None
    if value == "int":
        return 7
    if value == "raise":
        raise ValueError(value)
    return "k:" + (value or "")


KEYS = {
    "client_ip": keys.client_ip(),
    "client_ip_trusted": keys.client_ip(trusted_proxies=["10.0.0.0/8", "::1"]),
    "header": keys.header("X-Api-Key"),
    "header_required": keys.header("X-Api-Key", required=True),
    "by_header": _by_header,
    "raising": _raising,
    "first": keys.first(keys.header("X-Api-Key"), keys.client_ip()),
}

methods = st.sampled_from(["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS",
                           "TRACE", "BREW", "get"])
paths = st.sampled_from(["/", "/login", "/items/7", "/a/b/c", "", "/%00", "/ü"])
peers = st.one_of(
    st.none(),
    st.sampled_from(["127.0.0.1", "203.0.113.9", "10.0.0.5", "::1", "2001:db8:1:2::99",
                     "fe80::1%eth0", "testclient", "", "999.1.1.1", "1.2.3.4:80"]),
)
header_names = st.sampled_from([b"x-api-key", b"x-forwarded-for", b"forwarded", b"x-kind",
                                b"host", b"access-control-request-method"])
header_values = st.one_of(
    st.sampled_from([b"", b"k-1", b"none", b"int", b"raise", b"203.0.113.7, 10.0.0.7",
                     b"for=198.51.100.1", b"for=\"[2001:db8::1]\"", b"garbage,,", b"GET"]),
    st.binary(max_size=12),
)
requests = st.tuples(methods, paths, peers,
                     st.lists(st.tuples(header_names, header_values), max_size=4))


def _request(method: str, path: str, peer: str | None, headers: list[tuple[bytes, bytes]]
             ) -> Request:
    scope: dict[str, Any] = {"type": "http", "method": method, "path": path, "root_path": "",
                             "query_string": b"", "headers": headers,
                             "client": None if peer is None else (peer, 50000)}
    return Request(scope)


def _guard(key: str, per_method: bool, legacy: bool, limit: str) -> Guard:
    config = Config(default=limit, key=KEYS[key], per_method=per_method,
                    legacy_headers=legacy)
    return Guard(config, rl.Limiter(), timeout=None)


# Routes whose limits name methods, standard and not: the selection cache keys on the verb.
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


@settings(max_examples=150, deadline=None)
@given(key=st.sampled_from(sorted(KEYS)), per_method=st.booleans(),
       routed=st.booleans(), batch=st.lists(requests, min_size=1, max_size=8))
def test_a_single_policy_plans_as_the_generic_loop_does(
    key: str, per_method: bool, routed: bool, batch: list[Any]
) -> None:
    guard = _guard(key, per_method, False, "10/minute")
    # A decorated route whose key may say None falls back to the default: the fallback is a
    # single selection reached from a generic one.
    route = (RouteLimit.make("5/minute", key=_by_header, cost=1, name="r"),) if routed else None
    for method, path, peer, headers in batch:
        request = _request(method, path, peer, headers)
        selection = guard.select(method, path, route)
        assert selection is not None
        fast = guard.plan(selection, request, method)
        generic = guard._plan_generic(selection, request, method, None)
        assert (fast is None) == (generic is None)
        if fast is not None and generic is not None:
            assert fast.checks == generic.checks
            assert fast.selection is generic.selection
        if not routed:
            assert selection.single is not None


@settings(max_examples=60, deadline=None)
@given(key=st.sampled_from(["client_ip", "header_required", "by_header"]),
       per_method=st.booleans(), legacy=st.booleans(),
       batch=st.lists(st.tuples(requests, st.floats(0, 30)), min_size=1, max_size=12))
def test_fast_and_generic_plans_give_the_same_verdicts_and_headers(
    key: str, per_method: bool, legacy: bool, batch: list[Any]
) -> None:
    # Two guards, two limiters on their own memory backends and clocks, a limit small enough
    # to refuse: one plans through the shortcut, the other through the loop.
    fast_guard, generic_guard = (_guard(key, per_method, legacy, "3/10s") for _ in range(2))
    fast_clock, generic_clock = FakeClock(), FakeClock()
    fast_limiter = rl.Limiter(rl.MemoryBackend(), clock=fast_clock)
    generic_limiter = rl.Limiter(rl.MemoryBackend(), clock=generic_clock)
    for (method, path, peer, headers), pause in batch:
        fast_clock.advance(pause)
        generic_clock.advance(pause)
        request = _request(method, path, peer, headers)
        fast_selection = fast_guard.select(method, path, None)
        generic_selection = generic_guard.select(method, path, None)
        assert fast_selection is not None and generic_selection is not None
        fast_plan = fast_guard.plan(fast_selection, request, method)
        generic_plan = generic_guard._plan_generic(generic_selection, request, method, None)
        if fast_plan is None or generic_plan is None:
            assert fast_plan is generic_plan is None
            continue
        fast = check_sync(fast_guard, fast_limiter, fast_plan, request)
        generic = check_sync(generic_guard, generic_limiter, generic_plan, request)
        assert type(fast) is type(generic)
        assert isinstance(fast, (Admit, Refuse))
        assert fast.headers == generic.headers
        if isinstance(fast, Refuse) and isinstance(generic, Refuse):
            assert (fast.status, fast.body) == (generic.status, generic.body)


# -- a flood's 429, rendered once per Decision ------------------------------------------------
# The guard hands back the Refuse it rendered last when the deny cache replays the same
# Decision object for the same selection, and the ASGI middleware the bytes it encoded for it.
# Against a twin whose memos are cleared before every request, every response must be the
# same, byte for byte.


class _Fresh:
    """The ASGI middleware with its refusal memos cleared before every request: the plain
    path, rendering and encoding every 429 from scratch."""

    def __init__(self, middleware: Any) -> None:
        self.middleware = middleware

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.middleware.guard._last_refusal = None
        self.middleware._last_raw = None
        await self.middleware(scope, receive, send)


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


# -- lanes: the ASGI middleware's common request through core.lane --------------------------
# A selection of one policy whose arguments depend on the cost alone gets a Lane; the
# middleware then asks `Guard.identity` and `AsyncLimiter.lane_hit` instead of `Guard.plan` and
# `check_async`. Against a twin without lanes, every response and every decision left for the
# app must be the same, on the memory backend and on the real Redis (where the lane posts
# packed bytes on the pipelined connection).


def _lane_middleware(backend: Any, prefix: str, clock: StepClock, lanes: bool, legacy: bool,
                     per_method: bool, policy: rl.Policy) -> RateLimitMiddleware:
    limiter = rl.AsyncLimiter(backend, prefix=prefix, clock=clock)
    # The answers are compared, not their timing: a deadline far above any stall of a busy
    # test machine keeps one side from failing open where the other did not (seen in CI at
    # the default 100 ms).
    middleware = RateLimitMiddleware(_hello, limiter=limiter, legacy_headers=legacy,
                                     per_method=per_method, default=policy,
                                     charge_preflight=per_method, backend_timeout=10.0)
    if not lanes:
        middleware.guard._lane_prefix = None
    return middleware


async def _respond_to(app: Any, method: str, peer: str, headers: list[tuple[bytes, bytes]]
                      ) -> tuple[int, list[tuple[bytes, bytes]], bytes, Any]:
    """The response to one request (status, headers, body) and the decision left for the
    app."""
    scope = {"type": "http", "method": method, "path": "/", "root_path": "",
             "query_string": b"", "headers": headers, "client": (peer, 50000)}
    sent: list[Any] = []

    async def receive() -> Any:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    await app(scope, receive, send)
    start, body = sent
    return start["status"], start["headers"], body["body"], scope["state"]["ratelimit"]


async def _respond(app: Any, peer: str) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    status, headers, body, _ = await _respond_to(app, "GET", peer, [])
    return status, headers, body


lane_requests = st.lists(
    st.tuples(st.sampled_from([0, 0, 0, 1, 999, 1_000, 400_000, 3_000_000, 11_000_000]),
              st.sampled_from(["GET", "GET", "HEAD", "POST", "OPTIONS", "BREW"]),
              st.sampled_from(["203.0.113.1", "203.0.113.2", "2001:db8::7", "garbage"]),
              st.sampled_from([[], [(b"access-control-request-method", b"GET")]])),
    min_size=1, max_size=30)


@pytest.mark.parametrize("store", ["memory", "redis"])
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(legacy=st.booleans(), per_method=st.booleans(),
       algorithm=st.sampled_from(sorted(rl.ALGORITHMS)), requests=lane_requests)
def test_the_middleware_through_lanes_answers_as_through_plans(
    store: str, legacy: bool, per_method: bool, algorithm: str, requests: list[Any]
) -> None:
    if store == "redis":
        # Real TTLs against a test clock: only the sliding log's (one period from the last
        # write) never end inside a window the clock still sees.
        algorithm = "sliding-log"
    prefix = f"lanemw-{uuid.uuid4().hex[:8]}"

    async def play() -> None:
        def backend() -> Any:
            if store == "memory":
                return rl.MemoryBackend()
            return rl.AsyncRedisBackend(redis.asyncio.Redis.from_url(REDIS_URL))

        lane_clock, plan_clock = StepClock(), StepClock()
        # One policy object for both: a Decision names the policy that governed it.
        policy = rl.Policy("3/10s;5/minute", algorithm=algorithm, name="d")  # type: ignore[arg-type]
        through_lanes = _lane_middleware(backend(), prefix + "a", lane_clock, True, legacy,
                                         per_method, policy)
        through_plans = _lane_middleware(backend(), prefix + "b", plan_clock, False, legacy,
                                         per_method, policy)
        try:
            for advance_us, method, peer, headers in requests:
                lane_clock.us += advance_us
                plan_clock.us += advance_us
                laned = await _respond_to(through_lanes, method, peer, headers)
                planned = await _respond_to(through_plans, method, peer, headers)
                assert laned == planned
            assert all(s.lane is not None for s in through_lanes.guard._selection_cache.values()
                       if s is not None)
        finally:
            for middleware in (through_lanes, through_plans):
                close = getattr(middleware.limiter.backend, "aclose", None)
                if close is not None:
                    await close()

    try:
        asyncio.run(play())
    finally:
        if store == "redis":
            client = redis.Redis.from_url(REDIS_URL)
            for key in client.scan_iter(match=f"{prefix}*"):
                client.delete(key)
            client.close()
