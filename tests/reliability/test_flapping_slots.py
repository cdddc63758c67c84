"""A flapping Redis does not leak in-flight slots (issue 43, item 4).

With ``on_backend_error="memory"`` and an in-flight limit of 3, a private Redis that keeps its
data across a restart (``SHUTDOWN SAVE``, as a default redis-server does) is stopped and
started three times. Each time three requests hold slots in Redis and end while it is out:
their give-backs are owed to it and sent before the next request's call once it is back, so
three requests at once are admitted right after the breaker's probe (at efbcb84 they were
refused until the 60 s leases ran out). While Redis is out, the memory fallback takes slots
in this process (3 at once, a fourth refused), and gives them back there, never in Redis.
ASGI and WSGI alike (one mechanism: `ratelimit_mw.http.slots`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from werkzeug.test import create_environ

import ratelimit_mw as rl
from ratelimit_mw import asgi, keys, wsgi
from reliability._apps import install_clock
from reliability._support import PrivateRedis

pytestmark = pytest.mark.slow

CYCLES = 3
N = 3
# Not a sliding log: its sorted set would count as slots in `_held_in_redis`.
RATE = rl.Policy("1000/minute", algorithm="fixed-window")


def _stop_keeping_data(server: PrivateRedis) -> None:
    """SHUTDOWN SAVE: the slots held in Redis are there again when it starts."""
    assert server.proc is not None
    with contextlib.suppress(OSError), \
            socket.create_connection(("127.0.0.1", server.port), timeout=2) as sock:
        sock.sendall(b"SHUTDOWN SAVE\r\n")
        sock.recv(64)
    server.proc.wait(timeout=10)
    server.proc = None


def _held_in_redis(server: PrivateRedis, prefix: str) -> int:
    """Slots whose lease has not ended, in every in-flight key under `prefix`."""
    client = server.client()
    try:
        now_ms = int(client.time()[0] * 1000)
        return sum(int(client.zcount(key, now_ms + 1, "+inf"))
                   for key in client.scan_iter(f"{prefix}:*")
                   if client.type(key) == b"zset")
    finally:
        client.close()


def _server(private_redis: Callable[..., PrivateRedis], tmp_path: Path) -> PrivateRedis:
    return private_redis("--dir", str(tmp_path), "--dbfilename", "flap.rdb")


def _in_memory_free(guard: Any, client: str) -> int:
    """Free slots of the /hold rule, for this X-Client, in the guard's memory fallback."""
    policy = guard.rules[0].in_flight
    return int(guard.fallback.peek(policy, f"h:x-client:{client}").remaining)


async def test_asgi_slots_that_end_during_outages_go_back_to_redis_once_it_answers(
    private_redis: Callable[..., PrivateRedis], tmp_path: Path, prefix: str,
) -> None:
    server = _server(private_redis, tmp_path)
    backend = rl.AsyncRedisBackend.from_url(server.url)
    limiter = rl.AsyncLimiter(backend, prefix=prefix)
    gate = asyncio.Event()
    entered: list[int] = []

    async def hold(request: Request) -> Response:
        entered.append(1)
        await gate.wait()
        return PlainTextResponse("ok")

    async def ping(request: Request) -> Response:
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/hold", hold), Route("/ping", ping)])
    middleware = asgi.RateLimitMiddleware(
        app, limiter, key=keys.header("x-client"), default=RATE,
        rules=[asgi.Rule("/hold", concurrency=N)], on_backend_error="memory")
    clock = install_clock(middleware)
    guard = middleware.guard
    transport = httpx.ASGITransport(app=middleware)
    headers = {"x-client": "a"}
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        async def hold_n(n: int) -> list[asyncio.Task[httpx.Response]]:
            """Start n /hold requests; wait until every admitted one is inside the app."""
            del entered[:]
            tasks = [asyncio.create_task(client.get("/hold", headers=headers))
                     for _ in range(n)]
            for _ in range(5000):
                if (len(entered), sum(task.done() for task in tasks)) == (min(n, N),
                                                                         max(0, n - N)):
                    return tasks
                await asyncio.sleep(0.001)
            raise AssertionError(f"{len(entered)} of {n} entered")

        async def statuses(tasks: Iterable[asyncio.Task[httpx.Response]]) -> list[int]:
            gate.set()
            done = [(await task).status_code for task in tasks]
            gate.clear()
            return sorted(done)

        for cycle in range(CYCLES):
            # Redis decides: 3 held, a fourth refused.
            held = await hold_n(N)
            assert (await client.get("/hold", headers=headers)).status_code == 429, cycle
            assert _held_in_redis(server, prefix) == N
            _stop_keeping_data(server)
            # The three end while Redis is out: their give-backs fail, and are owed.
            assert await statuses(held) == [200] * N
            # Meanwhile requests are decided in memory.
            assert await statuses(await hold_n(N)) == [200] * N, cycle
            server.start()  # with the three slots it held (their 60 s leases run on)
            assert _held_in_redis(server, prefix) == N
            clock.advance(guard.breaker.cooldown)  # the next request is the breaker's probe
            assert (await client.get("/ping", headers=headers)).status_code == 200
            # The probe sent the owed give-backs first: 3 at once are admitted now.
            assert _held_in_redis(server, prefix) == 0, cycle
            again = await hold_n(N)
            assert await statuses(again) == [200] * N, cycle
        assert not guard.slots.owed and not guard.slots.local
        assert _held_in_redis(server, prefix) == 0
    await backend.aclose()


def test_wsgi_slots_that_end_during_outages_go_back_to_redis_once_it_answers(
    private_redis: Callable[..., PrivateRedis], tmp_path: Path, prefix: str,
) -> None:
    server = _server(private_redis, tmp_path)
    backend = rl.RedisBackend.from_url(server.url)

    def ok(environ: Any, start_response: Any) -> list[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    middleware = wsgi.RateLimitMiddleware(
        ok, rl.Limiter(backend, prefix=prefix), key=keys.header("x-client"),
        default=RATE, rules=[wsgi.Rule("/hold", concurrency=N)],
        on_backend_error="memory")
    clock = install_clock(middleware)
    guard = middleware.guard

    def call(path: str) -> tuple[int, Any]:
        """One request; its body not yet closed (a response still being sent)."""
        status: list[str] = []
        body = middleware(create_environ(path, headers={"X-Client": "w"}),
                          lambda line, headers, exc_info=None: status.append(line))
        return int(status[0].split()[0]), body

    def hold_n(n: int) -> list[tuple[int, Any]]:
        return [call("/hold") for _ in range(n)]

    def end(responses: list[tuple[int, Any]]) -> list[int]:
        for _, body in responses:
            getattr(body, "close", lambda: None)()
        return sorted(status for status, _ in responses)

    for cycle in range(CYCLES):
        held = hold_n(N)
        assert end([call("/hold")]) == [429], cycle
        assert _held_in_redis(server, prefix) == N
        _stop_keeping_data(server)
        # Closed by a server thread, as a WSGI server closes a body it has sent.
        closer = threading.Thread(target=end, args=(held,))
        closer.start()
        closer.join(timeout=10)
        assert [status for status, _ in held] == [200] * N
        assert end(hold_n(N)) == [200] * N, cycle
        server.start()
        assert _held_in_redis(server, prefix) == N
        clock.advance(guard.breaker.cooldown)
        assert end([call("/ping")]) == [200]
        assert _held_in_redis(server, prefix) == 0, cycle
        assert end(hold_n(N)) == [200] * N, cycle
    assert not guard.slots.owed and not guard.slots.local
    backend.close()


async def test_the_memory_fallback_holds_slots_per_process_and_gives_them_back_there(
    private_redis: Callable[..., PrivateRedis], tmp_path: Path, prefix: str,
) -> None:
    """Redis out: 3 slots held in memory, a fourth refused; Redis back while they run:
    they end, and go back to the memory that took them (free there again), not to Redis."""
    server = _server(private_redis, tmp_path)
    backend = rl.AsyncRedisBackend.from_url(server.url)
    limiter = rl.AsyncLimiter(backend, prefix=prefix)
    gate = asyncio.Event()

    async def hold(request: Request) -> Response:
        await gate.wait()
        return PlainTextResponse("ok")

    middleware = asgi.RateLimitMiddleware(
        Starlette(routes=[Route("/hold", hold)]), limiter, key=keys.header("x-client"),
        rules=[asgi.Rule("/hold", concurrency=N)], on_backend_error="memory")
    clock = install_clock(middleware)
    guard = middleware.guard
    transport = httpx.ASGITransport(app=middleware)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        gate.set()
        assert (await client.get("/hold", headers={"x-client": "m"})).status_code == 200
        gate.clear()
        server.stop()
        tasks = [asyncio.create_task(client.get("/hold", headers={"x-client": "m"}))
                 for _ in range(N + 1)]
        for _ in range(5000):
            if len(guard.slots.local) == N and sum(task.done() for task in tasks) == 1:
                break
            await asyncio.sleep(0.001)
        else:
            raise AssertionError("the memory fallback did not hold 3 and refuse 1")
        assert _in_memory_free(guard, "m") == 0
        server.start()
        clock.advance(guard.breaker.cooldown)
        gate.set()
        assert sorted([(await task).status_code for task in tasks]) == [200] * N + [429]
        assert _in_memory_free(guard, "m") == N  # given back in memory
        assert not guard.slots.local and not guard.slots.owed
        assert _held_in_redis(server, prefix) == 0
    await backend.aclose()
