"""``--profile asgi|wsgi|core``: where the per-request time of the admitted path goes.

No server and no load generator: the app is called directly, in this process, with a
minimal request (ASGI: a scope and no-op receive/send; WSGI: a plain environ), so the
profile holds only the framework, the middleware, the limiter and the Redis client.

It prints, first, the in-process cost per request with and without the middleware (memory
and Redis backends, and a PING on the same Redis for scale), then the profile of N admitted
requests through the middleware on the chosen backend: pyinstrument's call tree and its
flat list of the frames with the most self time (cProfile's list when pyinstrument is not
installed).
"""

from __future__ import annotations

import asyncio
import cProfile
import gc
import io
import pstats
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

from _util import REPO, importable

LIMIT = "1000000000/hour"
ALGORITHM = "fixed-window"

_SCOPE: dict[str, Any] = {
    "type": "http",
    "asgi": {"version": "3.0", "spec_version": "2.3"},
    "http_version": "1.1",
    "method": "GET",
    "scheme": "http",
    "path": "/",
    "raw_path": b"/",
    "root_path": "",
    "query_string": b"",
    "headers": [(b"host", b"127.0.0.1:8000"), (b"user-agent", b"bench")],
    "client": ("127.0.0.1", 50000),
    "server": ("127.0.0.1", 8000),
}


async def _receive() -> dict[str, Any]:
    return {"type": "http.request", "body": b"", "more_body": False}


async def _send(message: dict[str, Any]) -> None:
    return None


def _asgi_apps(redis_url: str) -> dict[str, Any]:
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse, Response
    from starlette.routing import Route

    from ratelimit_mw import AsyncLimiter, AsyncRedisBackend, MemoryBackend, Policy
    from ratelimit_mw.asgi import RateLimitMiddleware

    async def hello(request: Request) -> Response:
        return PlainTextResponse("Hello, world!")

    def app(backend: Any = None, concurrency: int | None = None) -> Starlette:
        middleware = None
        if backend is not None:
            limiter = AsyncLimiter(backend, prefix="rlprofile", deny_cache=0)
            middleware = [Middleware(RateLimitMiddleware, limiter=limiter,
                                     default=Policy(LIMIT, algorithm=ALGORITHM),
                                     concurrency=concurrency)]
        return Starlette(routes=[Route("/", hello)], middleware=middleware)

    # "inflight": the rate and an in-flight limit (a slot held while each response runs), on
    # memory; "redis-inflight", the same on Redis (its give-back a second call; its own
    # client, and the "redis" app's rate key: at LIMIT neither refuses the other's requests).
    # "floor": the least any limiter does, for scale (see `_floor_middleware`).
    floor = Starlette(routes=[Route("/", hello)])
    floor.add_middleware(_floor_middleware(1_000_000_000, 3600))
    return {"bare": app(), "floor": floor, "memory": app(MemoryBackend()),
            "inflight": app(MemoryBackend(), concurrency=1_000_000),
            "redis": app(AsyncRedisBackend.from_url(redis_url)),
            "redis-inflight": app(AsyncRedisBackend.from_url(redis_url),
                                  concurrency=1_000_000)}


def _floor_middleware(limit: int, period: int) -> Any:
    """The least a rate limiter in front of an ASGI app does, written as tightly as it can
    be, for scale: the client's address as the key, a fixed-window count in a dict, a 429
    past the limit, and the IETF RateLimit fields added to the response by wrapping `send`.
    No rules, routes, hooks, failure policy, deny cache, test switch or store: what
    ratelimit_mw costs above this is what its features and its one path cost."""
    import time

    policy = f'"default";q={limit};w={period}'.encode()

    class Floor:
        def __init__(self, app: Any) -> None:
            self.app = app
            self.counts: dict[tuple[str, int], int] = {}

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                await self.app(scope, receive, send)
                return
            now = int(time.time())
            window = now - now % period
            key = (scope["client"][0], window)
            count = self.counts.get(key, 0) + 1
            self.counts[key] = count
            reset = window + period - now
            fields = [(b"ratelimit-policy", policy),
                      (b"ratelimit", f'"default";r={max(limit - count, 0)};t={reset}'.encode())]
            if count > limit:
                await send({"type": "http.response.start", "status": 429,
                            "headers": [*fields, (b"retry-after", str(reset).encode())]})
                await send({"type": "http.response.body", "body": b""})
                return

            async def send_with_fields(message: Any) -> None:
                if message["type"] == "http.response.start":
                    message["headers"] = [*message.get("headers", ()), *fields]
                await send(message)

            await self.app(scope, receive, send_with_fields)

    return Floor


def _wsgi_apps(redis_url: str) -> dict[str, Any]:
    from flask import Flask

    from ratelimit_mw import Limiter, MemoryBackend, Policy, RedisBackend
    from ratelimit_mw.flask import RateLimit

    def app(backend: Any = None) -> Flask:
        flask_app = Flask(__name__)

        @flask_app.route("/")
        def hello() -> str:
            return "Hello, world!"

        if backend is not None:
            RateLimit(flask_app, limiter=Limiter(backend, prefix="rlprofile", deny_cache=0),
                      default=Policy(LIMIT, algorithm=ALGORITHM))
        return flask_app

    floor = app()
    _floor_extension(floor, 1_000_000_000, 3600)
    return {"bare": app(), "floor": floor, "memory": app(MemoryBackend()),
            "redis": app(RedisBackend.from_url(redis_url))}


def _floor_extension(app: Any, limit: int, period: int) -> None:
    """`_floor_middleware` as a Flask extension: a before_request hook that counts and
    refuses, an after_request hook that adds the RateLimit fields; for scale, as that one."""
    import time

    from flask import request

    policy = f'"default";q={limit};w={period}'
    counts: dict[tuple[str | None, int], int] = {}

    @app.before_request
    def count() -> Any:
        environ = request.environ
        now = int(time.time())
        window = now - now % period
        key = (environ.get("REMOTE_ADDR"), window)
        used = counts[key] = counts.get(key, 0) + 1
        environ["floor.ratelimit"] = (used, window + period - now)
        if used > limit:
            return "", 429, {"Retry-After": str(window + period - now)}
        return None

    @app.after_request
    def fields(response: Any) -> Any:
        used, reset = request.environ["floor.ratelimit"]
        add = response.headers.add
        add("RateLimit-Policy", policy)
        add("RateLimit", f'"default";r={max(limit - used, 0)};t={reset}')
        return response


def _environ() -> dict[str, Any]:
    from werkzeug.test import EnvironBuilder

    env = EnvironBuilder(path="/", base_url="http://127.0.0.1:8000/").get_environ()
    env["REMOTE_ADDR"] = "127.0.0.1"
    return env


def _asgi_runner(app: Any) -> Callable[[int], Awaitable[None]]:
    async def run(n: int) -> None:
        for _ in range(n):
            await app(dict(_SCOPE), _receive, _send)

    return run


def _wsgi_runner(app: Any) -> Callable[[int], None]:
    template = _environ()

    def start_response(status: str, headers: list[tuple[str, str]], exc: Any = None) -> Any:
        return None

    def run(n: int) -> None:
        for _ in range(n):
            environ = dict(template)
            for _chunk in app(environ, start_response):
                pass

    return run


def _per_request_us(run: Callable[[int], Any], n: int, is_async: bool,
                    loop: asyncio.AbstractEventLoop | None) -> float:
    gc.collect()
    started = time.perf_counter()
    if is_async and loop is not None:
        loop.run_until_complete(run(n))
    else:
        run(n)
    return (time.perf_counter() - started) / n * 1e6


def _ping_runner(redis_url: str, is_async: bool) -> tuple[Callable[[int], Any], Any]:
    if is_async:
        import redis.asyncio

        aclient = redis.asyncio.Redis.from_url(redis_url)

        async def aping(n: int) -> None:
            for _ in range(n):
                await aclient.ping()

        return aping, aclient
    import redis

    client = redis.Redis.from_url(redis_url)

    def ping(n: int) -> None:
        for _ in range(n):
            client.ping()

    return ping, client


def profile(target: str, *, redis_url: str, requests: int, backend: str,
            rounds: int = 3) -> str:
    """Run the profile and return the report text."""
    is_async = target == "asgi"
    out = io.StringIO()
    loop = asyncio.new_event_loop() if is_async else None
    runners: dict[str, Callable[[int], Any]]
    if target == "core":
        runners, label = _core_runners(redis_url), "Limiter.hit (sync), no HTTP"
    elif is_async:
        runners = {name: _asgi_runner(app) for name, app in _asgi_apps(redis_url).items()}
        label = "Starlette app called directly (ASGI scope, no server)"
    else:
        runners = {name: _wsgi_runner(app) for name, app in _wsgi_apps(redis_url).items()}
        label = "Flask app called directly (WSGI environ, no server)"
    ping, ping_client = _ping_runner(redis_url, is_async)
    runners["PING"] = ping
    try:
        for run in runners.values():  # warm-up: connections, scripts, caches
            _per_request_us(run, 200, is_async, loop)
        figures: dict[str, list[float]] = {name: [] for name in runners}
        names = list(runners)
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                figures[name].append(_per_request_us(runners[name], requests // rounds or 1,
                                                     is_async, loop))
        print(f"# {target} profile: {label}, {requests} requests, limit {LIMIT} "
              f"({ALGORITHM}), deny_cache=0\n", file=out)
        print("| configuration | µs per request (best of rounds) |", file=out)
        print("|---|---:|", file=out)
        for name in names:
            print(f"| {name} | {min(figures[name]):.1f} |", file=out)
        if "bare" in figures:
            bare = min(figures["bare"])
            for name in ("memory", "redis"):
                if name in figures:
                    print(f"\nmiddleware + limiter on {name}: "
                          f"{min(figures[name]) - bare:.1f} µs per request over bare", file=out)
        run = runners[backend]
        print(f"\n## profile of {requests} admitted requests on the {backend} backend\n",
              file=out)
        print(_profiled(run, requests, is_async, loop), file=out)
    finally:
        if loop is not None:
            if hasattr(ping_client, "aclose"):
                loop.run_until_complete(ping_client.aclose())
            loop.close()
        else:
            ping_client.close()
    return out.getvalue()


def _core_runners(redis_url: str) -> dict[str, Callable[[int], None]]:
    from ratelimit_mw import Limiter, MemoryBackend, Policy, RedisBackend

    policy = Policy(LIMIT, algorithm=ALGORITHM)

    def runner(limiter: Any) -> Callable[[int], None]:
        def run(n: int) -> None:
            for _ in range(n):
                limiter.hit(policy, "ip:127.0.0.1")

        return run

    return {
        "memory": runner(Limiter(MemoryBackend(), prefix="rlprofile", deny_cache=0)),
        "redis": runner(Limiter(RedisBackend.from_url(redis_url), prefix="rlprofile",
                                deny_cache=0)),
    }


def _profiled(run: Callable[[int], Any], n: int, is_async: bool,
              loop: asyncio.AbstractEventLoop | None) -> str:
    def go() -> None:
        if is_async and loop is not None:
            loop.run_until_complete(run(n))
        else:
            run(n)

    parts = []
    if importable("pyinstrument") is None:
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.0001, async_mode="enabled")
        profiler.start()
        go()
        profiler.stop()
        tree = profiler.output_text(unicode=True, color=False, short_mode=False)
        flat = profiler.output_text(unicode=True, color=False, flat=True)
        # The harness's own loop (and the profiler's overhead, which lands on it) is noise.
        top = [line for line in flat.splitlines() if line.strip() and "profiling.py" not in line]
        parts += [
            "### call tree (pyinstrument, sampled)", "", "```", tree.strip("\n"), "```", "",
            "### top frames by self time (pyinstrument --flat; harness frames left out)", "",
            "```", *top[:40], "```", "",
        ]
    else:
        parts += ["pyinstrument is not installed (pip install pyinstrument): no call tree.", ""]
    parts += ["### calls per request and self time (cProfile, deterministic; its overhead "
              "inflates the times of small functions)", "", _cprofile_table(go, n)]
    return "\n".join(parts)


def _cprofile_table(go: Callable[[], None], n: int, top: int = 30) -> str:
    profile = cProfile.Profile()
    profile.enable()
    go()
    profile.disable()
    stats = pstats.Stats(profile)
    entries = []
    for (filename, line, function), value in stats.stats.items():  # type: ignore[attr-defined]
        _primitive, calls, self_time, cumulative, _callers = value
        if filename.endswith("profiling.py"):
            continue
        # Shortest readable location: the package path, or the stdlib module.
        where = re.sub(r"^.*/(site-packages|lib/python3\.\d+)/", "", filename)
        where = where.replace(str(REPO) + "/", "")
        entries.append((self_time, calls, cumulative, f"{function}  {where}:{line}"))
    entries.sort(reverse=True)
    lines = ["| function | calls / request | self µs / request | cumulative µs / request |",
             "|---|---:|---:|---:|"]
    lines += [f"| `{name}` | {calls / n:.2f} | {self_time / n * 1e6:.2f} | "
              f"{cumulative / n * 1e6:.2f} |"
              for self_time, calls, cumulative, name in entries[:top]]
    return "\n".join(lines)
