"""Outages through the ASGI and WSGI middleware, with clients built from a URL as documented.

Three faults, each on a PRIVATE server (or a port nobody listens on):

- ``refused``: nothing listens (the kernel answers RST at once);
- ``hung``: the server is alive but answers nothing (``CLIENT PAUSE 5000 ALL``); and, for a
  worker that has no connection yet, a server that accepts connections and never writes a
  byte (TCP, TLS, a unix socket), whatever timeouts the client was built with;
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

import asyncio
import contextlib
import logging
import socket
import statistics
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import redis.asyncio
from werkzeug.test import Client

import ratelimit_mw as rl
from ratelimit_mw import asgi, wsgi
from ratelimit_mw.http.breaker import TIMEOUTS
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
DEADLINE = 0.1  # backend_timeout's default: how far apart timeouts count in a row
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


async def _opening(stack: Stack, fault: str) -> list[Result]:
    """The requests until the breaker opens: one for a failure that opens it at once,
    TIMEOUTS for a hung Redis, each a deadline after the last on the breaker's clock."""
    results = [await stack.get()]
    for _ in range(TIMEOUTS - 1 if fault == "hung" else 0):
        assert stack.clock is not None
        stack.clock.advance(DEADLINE)
        results.append(await stack.get())
    return results


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
        opening = await _opening(stack, fault)
        first = opening[0]
        rest = [await stack.get() for _ in range(19)]
        calls_in_cool_down = stack.calls
        assert stack.clock is not None
        stack.clock.advance(1.01)  # the cool-down is over: Redis is tried once more
        later = [await stack.get() for _ in range(5)]
        calls_after = stack.calls

    for result in [*opening, *rest, *later]:
        _assert_admitted_undecided(result)
        assert result.seconds < BOUND
    assert calls_in_cool_down == len(opening)
    assert calls_after == len(opening) + 1
    warnings = [r for r in caplog.records if r.name == "ratelimit_mw"]
    # Logged once, not once per request (a hung Redis: once more, for the timeouts before
    # the breaker opened).
    assert len(warnings) == (2 if fault == "hung" else 1)
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
        opening = await _opening(stack, fault)
        results = [*opening, *[await stack.get() for _ in range(10)]]
        calls = stack.calls
    for result in results:
        _assert_unavailable(result)
        assert result.seconds < BOUND
    assert calls == len(opening)


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


class HungServer:
    """A server that accepts connections, on a loopback port and on a unix socket, and never
    writes a byte: a hung Redis as a worker that has no connection yet meets it (the
    handshake, or over TLS the TLS handshake, is never answered)."""

    def __init__(self, directory: Any) -> None:
        self.path = str(directory / "hung.sock")
        self.listeners = [socket.create_server(("127.0.0.1", 0)),
                          socket.create_server(self.path, family=socket.AF_UNIX)]
        self.port = int(self.listeners[0].getsockname()[1])
        self.accepted: list[socket.socket] = []
        self.stopped = threading.Event()
        self.threads = [threading.Thread(target=self._accept, args=(listener,), daemon=True)
                        for listener in self.listeners]
        for thread in self.threads:
            thread.start()

    def _accept(self, listener: socket.socket) -> None:
        listener.settimeout(0.05)  # to see `stopped`: closing a socket wakes no accept()
        while not self.stopped.is_set():
            with contextlib.suppress(TimeoutError):
                self.accepted.append(listener.accept()[0])

    def close(self) -> None:
        self.stopped.set()
        for thread in self.threads:
            thread.join()
        for sock in [*self.listeners, *self.accepted]:
            sock.close()


@pytest.fixture
def hung_server(tmp_path: Any) -> Iterator[HungServer]:
    server = HungServer(tmp_path)
    try:
        yield server
    finally:
        server.close()


def _url(server: HungServer, transport: str) -> str:
    if transport == "unix":
        return f"unix://{server.path}?db=0"
    return f"{'rediss' if transport == 'tls' else 'redis'}://127.0.0.1:{server.port}/0"


# The ways an app builds its async backend: redis-py's own client (5 s socket and connect
# timeouts), redis-py's from_url (no timeouts at all), and the library's from_url.
ASYNC_BUILDS: dict[str, Callable[[HungServer, str], Any]] = {
    "redis.asyncio.Redis": lambda server, transport: rl.AsyncRedisBackend(
        redis.asyncio.Redis(unix_socket_path=server.path) if transport == "unix" else
        redis.asyncio.Redis(host="127.0.0.1", port=server.port, ssl=transport == "tls")),
    "redis.asyncio.from_url": lambda server, transport: rl.AsyncRedisBackend(
        redis.asyncio.from_url(_url(server, transport))),
    "AsyncRedisBackend.from_url": lambda server, transport: rl.AsyncRedisBackend.from_url(
        _url(server, transport)),
}


def _counted(backend: Any) -> list[str]:
    """The calls that reach `backend`, counted on its own way in (`arun`), which keeps the
    deadline itself."""
    calls: list[str] = []
    arun = backend.arun

    async def counted(call: Any, deadline: float | None = None) -> Any:
        calls.append(call.op)
        return await arun(call, deadline)

    backend.arun = counted
    return calls


def _assert_failure_policy(result: Result, on_backend_error: str) -> None:
    if on_backend_error == "allow":
        _assert_admitted_undecided(result)
    else:
        _assert_unavailable(result)


@pytest.mark.parametrize("on_backend_error", ["allow", "deny"])
@pytest.mark.parametrize("transport", ["tcp", "tls", "unix"])
@pytest.mark.parametrize("build", list(ASYNC_BUILDS))
async def test_a_cold_asgi_worker_meeting_a_hung_redis_answers_within_a_few_deadlines(
    build: str, transport: str, on_backend_error: str, hung_server: HungServer, prefix: str,
    figures: Figures,
) -> None:
    """The first request of a worker with no connection yet waits for the connection at most
    three times its deadline (300 ms), whatever the client's own timeouts (redis-py's
    5 s, or none), then takes the failure policy; after TIMEOUTS of them, each a deadline
    after the last, the breaker keeps the next one off Redis."""
    backend = ASYNC_BUILDS[build](hung_server, transport)
    calls = _counted(backend)
    mw = asgi.RateLimitMiddleware(asgi_app(), rl.AsyncLimiter(backend, prefix=prefix),
                                  default=POLICY, on_backend_error=on_backend_error)
    clock = install_clock(mw)  # the cool-down lasts until the test moves its clock
    client = asgi_client(mw)
    try:
        results = []
        for _ in range(TIMEOUTS + 1):
            clock.advance(DEADLINE)
            started = time.perf_counter()
            # A failure, not a hung suite: a client without timeouts waited forever.
            response = await asyncio.wait_for(client.get("/"), 30)
            results.append(Result(response.status_code, response.headers, response.json(),
                                  time.perf_counter() - started))
    finally:
        await client.aclose()
        await backend.aclose()
    first = results[0]
    for result in results:
        _assert_failure_policy(result, on_backend_error)
    assert first.seconds < BOUND
    assert len(calls) == TIMEOUTS  # the next request found the breaker open
    figures.record(f"outage.hung_cold.asgi.{build}.{transport}.first_request_ms",
                   ms(first.seconds))


@pytest.mark.parametrize("on_backend_error", ["allow", "deny"])
@pytest.mark.parametrize("transport", ["tcp", "unix"])
async def test_a_cold_wsgi_worker_meeting_a_hung_redis_pays_the_from_url_timeouts(
    transport: str, on_backend_error: str, hung_server: HungServer, prefix: str,
    figures: Figures,
) -> None:
    """The sync backend cannot be interrupted: built from a URL, its 100 ms connect and read
    timeouts bound the first request of a worker with no connection yet."""
    stack = Stack("wsgi", _url(hung_server, transport), prefix, {},
                  on_backend_error=on_backend_error)
    try:
        results = await _opening(stack, "hung")
        results.append(await stack.get())  # the breaker is open
        calls = stack.calls
    finally:
        await stack.close()
    first = results[0]
    for result in results:
        _assert_failure_policy(result, on_backend_error)
    assert first.seconds < BOUND
    assert calls == TIMEOUTS
    figures.record(f"outage.hung_cold.wsgi.from_url.{transport}.first_request_ms",
                   ms(first.seconds))
