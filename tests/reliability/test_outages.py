"""Outages through the ASGI and WSGI middleware, with clients built from a URL as documented.

Three faults, each on a PRIVATE server (or a port nobody listens on):

- ``refused``: nothing listens (the kernel answers RST at once);
- ``hung``: the server is alive but answers nothing (``CLIENT PAUSE 5000 ALL``);
- ``oom``: ``--maxmemory 2mb --maxmemory-policy noeviction`` (1mb is less than an idle
  server with the script loaded already holds), then filled megabytes past the limit, so
  every write is refused with an OOM error.

For each: fail-open admits every request (no decision, no rate-limit headers); fail-closed
answers 503 with ``Retry-After``; the circuit breaker calls Redis once and then not at all
during the cool-down (counted with a wrapping backend; the breaker's clock is the test's);
nothing ever answers 500 (an exception escaping the middleware would fail the test, since
the test clients re-raise them). The time each request takes is measured and reported (see
the figures at the end of the run); only a generous bound of one second is asserted.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from werkzeug.test import Client

import ratelimit_mw as rl
from ratelimit_mw import asgi, wsgi
from reliability._apps import asgi_app, asgi_client, install_clock, remaining, wsgi_app
from reliability._support import (
    CountingAsyncBackend,
    CountingBackend,
    Figures,
    PrivateRedis,
    TestClock,
    ms,
    refused_port,
)

pytestmark = pytest.mark.slow

KINDS = ["refused", "hung", "oom"]
STACKS = ["asgi", "wsgi"]
POLICY = rl.Policy("5/minute", name="outage")
OOM_ARGS = ("--maxmemory", "2mb", "--maxmemory-policy", "noeviction",
            "--enable-debug-command", "local")
BOUND = 1.0  # seconds: a sanity bound on any single request, never a performance claim
PEER = "192.0.2.10"


@dataclass
class Result:
    status: int
    headers: Any
    body: Any
    seconds: float

    @property
    def decided(self) -> bool:
        return self.status == 200 and bool(self.body["decided"])


class Stack:
    """One app behind one middleware (or none), and a client calling it in process."""

    def __init__(self, kind: str, url: str | None, prefix: str, client_kwargs: dict[str, Any],
                 **options: Any) -> None:
        self.kind = kind
        self.backend: Any = None
        self.counting: Any = None
        self.mw: Any = None
        self.clock: TestClock | None = None
        if kind == "asgi":
            app: Any = asgi_app()
            if url is not None:
                self.backend = rl.AsyncRedisBackend.from_url(url, **client_kwargs)
                self.counting = CountingAsyncBackend(self.backend)
                app = self.mw = asgi.RateLimitMiddleware(
                    app, rl.AsyncLimiter(self.counting, prefix=prefix), default=POLICY,
                    **options)
            self._aclient = asgi_client(app)
        else:
            wapp: Any = wsgi_app
            if url is not None:
                self.backend = rl.RedisBackend.from_url(url, **client_kwargs)
                self.counting = CountingBackend(self.backend)
                wapp = self.mw = wsgi.RateLimitMiddleware(
                    wapp, rl.Limiter(self.counting, prefix=prefix), default=POLICY, **options)
            self._client = Client(wapp)
        if self.mw is not None:
            self.clock = install_clock(self.mw)

    @property
    def calls(self) -> int:
        return int(self.counting.calls)

    async def get(self) -> Result:
        started = time.perf_counter()
        if self.kind == "asgi":
            response = await self._aclient.get("/")
            seconds = time.perf_counter() - started
            return Result(response.status_code, response.headers, response.json(), seconds)
        wresponse = self._client.get("/", environ_base={"REMOTE_ADDR": PEER})
        seconds = time.perf_counter() - started
        return Result(wresponse.status_code, wresponse.headers, wresponse.get_json(), seconds)

    async def close(self) -> None:
        if self.kind == "asgi":
            await self._aclient.aclose()
            if self.backend is not None:
                await self.backend.aclose()
        elif self.backend is not None:
            self.backend.close()


@asynccontextmanager
async def broken(fault: str, kind: str, private_redis: Callable[..., PrivateRedis],
                 prefix: str, client_kwargs: dict[str, Any] | None = None,
                 **options: Any) -> AsyncIterator[Stack]:
    """A stack whose Redis suffers `fault`; it served one decided request first if it could."""
    client_kwargs = client_kwargs or {}
    if fault == "refused":
        with refused_port() as port:
            stack = Stack(kind, f"redis://127.0.0.1:{port}/0", prefix, client_kwargs,
                          **options)
            try:
                yield stack
            finally:
                await stack.close()
        return
    server = private_redis(*(OOM_ARGS if fault == "oom" else ()))
    stack = Stack(kind, server.url, prefix, client_kwargs, **options)
    try:
        healthy = await stack.get()  # connected, script loaded: the app was running
        assert healthy.decided and remaining(healthy.headers) == 4
        if fault == "hung":
            pauser = server.client()
            pauser.execute_command("CLIENT", "PAUSE", "5000", "ALL")
            pauser.close()
        else:
            server.fill_memory()
        stack.counting.calls = 0
        yield stack
    finally:
        await stack.close()


def _assert_admitted_undecided(result: Result) -> None:
    assert result.status == 200
    assert not result.decided
    assert remaining(result.headers) is None  # no made-up rate-limit headers


def _assert_unavailable(result: Result) -> None:
    assert result.status == 503
    assert result.headers["Retry-After"] == "1"  # the cool-down, rounded up
    assert result.body["retry_after"] == 1


@pytest.mark.parametrize("kind", STACKS)
@pytest.mark.parametrize("fault", KINDS)
async def test_fail_open_admits_and_the_breaker_skips_redis_during_the_cool_down(
    fault: str, kind: str, private_redis: Callable[..., PrivateRedis], prefix: str,
    figures: Figures, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="ratelimit_mw")
    async with broken(fault, kind, private_redis, prefix) as stack:
        first = await stack.get()
        rest = [await stack.get() for _ in range(19)]
        calls_in_cool_down = stack.calls
        assert stack.clock is not None
        stack.clock.advance(1.01)  # the cool-down is over: Redis is tried once more
        later = [await stack.get() for _ in range(5)]
        calls_after = stack.calls

    for result in [first, *rest, *later]:
        _assert_admitted_undecided(result)
        assert result.seconds < BOUND
    assert calls_in_cool_down == 1
    assert calls_after == 2
    warnings = [r for r in caplog.records if r.name == "ratelimit_mw"]
    assert len(warnings) == 1  # logged once, not once per request
    figures.record(f"outage.{fault}.{kind}.breaker", {
        "first_request_ms": ms(first.seconds),
        "cool_down_request_ms_mean": ms(statistics.mean(r.seconds for r in rest)),
        "redis_calls_for_20_requests": calls_in_cool_down,
    })


@pytest.mark.parametrize("kind", STACKS)
@pytest.mark.parametrize("fault", KINDS)
async def test_fail_closed_answers_503_with_retry_after(
    fault: str, kind: str, private_redis: Callable[..., PrivateRedis], prefix: str
) -> None:
    async with broken(fault, kind, private_redis, prefix, on_backend_error="deny") as stack:
        results = [await stack.get() for _ in range(10)]
        calls = stack.calls
    for result in results:
        _assert_unavailable(result)
        assert result.seconds < BOUND
    assert calls == 1


@pytest.mark.parametrize("kind", STACKS)
@pytest.mark.parametrize("fault", KINDS)
async def test_without_the_breaker_every_request_pays_a_bounded_failure(
    fault: str, kind: str, private_redis: Callable[..., PrivateRedis], prefix: str,
    figures: Figures, caplog: pytest.LogCaptureFixture,
) -> None:
    """backend_cooldown=0: each request tries Redis; what one failure costs is measured."""
    caplog.set_level(logging.WARNING, logger="ratelimit_mw")
    bare = Stack(kind, None, prefix, {})
    await bare.get()  # warm
    baseline = [(await bare.get()).seconds for _ in range(20)]
    await bare.close()
    async with broken(fault, kind, private_redis, prefix, backend_cooldown=0) as stack:
        results = [await stack.get() for _ in range(6)]
        calls = stack.calls

    for result in results:
        _assert_admitted_undecided(result)
        assert result.seconds < BOUND
    assert calls == len(results)
    assert len([r for r in caplog.records if r.name == "ratelimit_mw"]) == 1
    per_request = [r.seconds for r in results]
    figures.record(f"outage.{fault}.{kind}.no_breaker", {
        "request_ms_mean": ms(statistics.mean(per_request)),
        "request_ms_max": ms(max(per_request)),
        "bare_app_request_ms_mean": ms(statistics.mean(baseline)),
        "added_ms_per_request": ms(statistics.mean(per_request) - statistics.mean(baseline)),
    })


async def test_the_asgi_deadline_bounds_a_hung_call_whatever_the_client_timeouts(
    private_redis: Callable[..., PrivateRedis], prefix: str, figures: Figures
) -> None:
    """A client built with 10 s timeouts still costs a request ~backend_timeout (0.1 s)."""
    async with broken("hung", "asgi", private_redis, prefix,
                      client_kwargs={"socket_timeout": 10, "socket_connect_timeout": 10},
                      backend_cooldown=0) as stack:
        results = [await stack.get() for _ in range(3)]
    for result in results:
        _assert_admitted_undecided(result)
        assert result.seconds < BOUND
    figures.record("outage.hung.asgi.client_timeouts_10s.request_ms_max",
                   ms(max(r.seconds for r in results)))


@pytest.mark.parametrize("kind", STACKS)
async def test_out_of_memory_still_refuses_a_client_over_its_limit(
    kind: str, private_redis: Callable[..., PrivateRedis], prefix: str
) -> None:
    """A refusal writes nothing, so Redis out of memory still answers it with a real 429."""
    server = private_redis(*OOM_ARGS)
    stack = Stack(kind, server.url, prefix, {}, on_backend_error="deny")
    try:
        statuses = [(await stack.get()).status for _ in range(6)]
        assert statuses == [200] * 5 + [429]
        server.fill_memory()
        # A new process (no in-process memory of the refusal) asks Redis itself.
        fresh = Stack(kind, server.url, prefix, {}, on_backend_error="deny")
        try:
            refused = await fresh.get()
            assert fresh.calls == 1
        finally:
            await fresh.close()
    finally:
        await stack.close()
    assert refused.status == 429
    assert int(refused.headers["Retry-After"]) >= 1
