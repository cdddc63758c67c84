"""The apps the in-flight proof serves with several workers (uvicorn: ``--factory
make_asgi_app``; gunicorn: ``make_wsgi_app()``), configured by the environment: RL_REDIS_URL,
RL_PREFIX, RL_SLOTS (N) and RL_LEASE (seconds); RL_ON_LEASE_LOST, when set, is the ASGI
app's ``on_lease_lost``.

Every request with an ``X-Client`` header holds one of that client's N slots (the default
in-flight limit, beside a rate far from binding); ``/healthz`` (no header) holds none. Each
endpoint records in Redis how many of its own calls run at once (``<prefix>:probe:running``,
and the most ever seen, ``<prefix>:probe:max``), counting up when it starts and down when it
ends, so the count never includes a call that does not hold a slot:

- ``/work?ms=``: works for ms milliseconds;
- ``/stream?chunks=&ms=``: streams `chunks` chunks, ms apart (a client may leave half way);
- ``/boom``: raises (a 500);
- ``/hang``: records its worker's pid under ``<prefix>:probe:pids`` and works for a minute
  (its worker is killed while it holds its slot).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ratelimit_mw import Policy, keys

# Counts a call in, and keeps the most ever counted.
ENTER = """
local running = redis.call('INCR', KEYS[1])
if running > tonumber(redis.call('GET', KEYS[2]) or '0') then
  redis.call('SET', KEYS[2], running)
end
return running
"""


def _settings() -> tuple[str, str, Policy]:
    slots = int(os.environ["RL_SLOTS"])
    lease = float(os.environ["RL_LEASE"])
    return (os.environ["RL_REDIS_URL"], os.environ["RL_PREFIX"],
            Policy.in_flight(slots, lease=lease))


def probe_keys(prefix: str) -> tuple[str, str, str]:
    return f"{prefix}:probe:running", f"{prefix}:probe:max", f"{prefix}:probe:pids"


def _number(query: dict[str, str], name: str, default: int) -> int:
    try:
        return int(query.get(name, default))
    except ValueError:
        return default


def make_asgi_app() -> Any:
    import asyncio

    import redis.asyncio
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse, Response
    from starlette.routing import Route

    from ratelimit_mw import AsyncLimiter, AsyncRedisBackend
    from ratelimit_mw.asgi import RateLimitMiddleware

    url, prefix, slots = _settings()
    probe = redis.asyncio.Redis.from_url(url)
    running, _, pids = probe_keys(prefix)
    enter = probe.register_script(ENTER)

    async def counted(body: Callable[[], Any]) -> Any:
        await enter(keys=probe_keys(prefix)[:2])
        try:
            return await body()
        finally:
            await probe.decr(running)

    async def work(request: Request) -> Response:
        ms = _number(dict(request.query_params), "ms", 100)
        await counted(lambda: asyncio.sleep(ms / 1000))
        return PlainTextResponse("done")

    class Stream:
        """Sent by hand, not from a generator: a generator left by a client that went away
        is closed whenever asyncio finalizes it, and its count would go down late. The count
        goes down before the last chunk, which is when the slot is given back."""

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            query = dict(Request(scope).query_params)
            chunks, ms = _number(query, "chunks", 10), _number(query, "ms", 10)
            gone = asyncio.Event()

            async def listen() -> None:  # as Starlette's StreamingResponse does
                while (await receive())["type"] != "http.disconnect":
                    pass
                gone.set()

            await enter(keys=probe_keys(prefix)[:2])
            listener = asyncio.get_running_loop().create_task(listen())
            counted = True
            try:
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"text/plain")]})
                for _ in range(chunks):
                    if gone.is_set():
                        return  # the client went away
                    await send({"type": "http.response.body", "body": b"x" * 1024,
                                "more_body": True})
                    await asyncio.sleep(ms / 1000)
                counted = False
                await probe.decr(running)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                listener.cancel()
                if counted:  # the client went away, or the send failed
                    await probe.decr(running)

    async def boom(request: Request) -> Response:
        async def fail() -> None:
            raise RuntimeError("boom")

        return await counted(fail)  # type: ignore[no-any-return]

    async def hang(request: Request) -> Response:
        await probe.rpush(pids, os.getpid())
        await counted(lambda: asyncio.sleep(60))
        return PlainTextResponse("done")

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/work", work), Route("/stream", Stream()),
                            Route("/boom", boom), Route("/hang", hang),
                            Route("/healthz", healthz)])
    limiter = AsyncLimiter(AsyncRedisBackend.from_url(url, socket_timeout=5,
                                                      socket_connect_timeout=5), prefix=prefix)
    lost = os.environ.get("RL_ON_LEASE_LOST")
    return RateLimitMiddleware(app, limiter, default="100000/hour", concurrency=slots,
                               key=keys.header("x-client"), on_backend_error="deny",
                               backend_timeout=5.0,
                               **({"on_lease_lost": lost} if lost else {}))


def make_wsgi_app() -> Any:
    from urllib.parse import parse_qsl

    import redis

    from ratelimit_mw import Limiter, RedisBackend
    from ratelimit_mw.wsgi import RateLimitMiddleware

    url, prefix, slots = _settings()
    probe = redis.Redis.from_url(url)
    running, _, pids = probe_keys(prefix)
    enter = probe.register_script(ENTER)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ["PATH_INFO"]
        query = dict(parse_qsl(environ.get("QUERY_STRING", "")))
        if path == "/stream":
            return streamed(query, start_response)
        if path == "/hang":
            probe.rpush(pids, os.getpid())
        if path != "/healthz":
            enter(keys=probe_keys(prefix)[:2])
            try:
                if path == "/boom":
                    raise RuntimeError("boom")
                time.sleep(60 if path == "/hang" else _number(query, "ms", 100) / 1000)
            finally:
                probe.decr(running)
        start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "2")])
        return [b"ok"]

    def streamed(query: dict[str, str], start_response: Callable[..., Any]) -> Iterator[bytes]:
        chunks, ms = _number(query, "chunks", 10), _number(query, "ms", 10)
        start_response("200 OK", [("Content-Type", "text/plain")])
        enter(keys=probe_keys(prefix)[:2])
        try:
            for _ in range(chunks):
                yield b"x" * 1024
                time.sleep(ms / 1000)
        finally:
            probe.decr(running)

    limiter = Limiter(RedisBackend.from_url(url, socket_timeout=5, socket_connect_timeout=5),
                      prefix=prefix)
    return RateLimitMiddleware(app, limiter, default="100000/hour", concurrency=slots,
                               key=keys.header("x-client"), on_backend_error="deny")
