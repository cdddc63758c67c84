"""The walk of one decision: calls, hops between modules and returns, counted.

    python benchmarks/hops.py                      # this checkout
    python benchmarks/hops.py --tree /path/old     # another checkout's ratelimit_mw
    python benchmarks/hops.py --trace              # and the walk itself, call by call

One warm admitted request (the 51st) through each case, in process, no server. Counted as the
issue that set the targets counts them: ``sys.setprofile`` "call" events of frames whose
module is in ratelimit_mw (a coroutine resumed after the reply is one), in order; a hop is two
consecutive events in different modules, a return a hop into a module already entered during
that request. A short walk is one a maintainer can follow; the count is deterministic.

Cases: Starlette + the ASGI middleware on Redis and on memory, one default policy
(fixed-window), and the plain WSGI middleware and the Flask extension on Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REDIS_URL = os.environ.get("RATELIMIT_REDIS_URL", "redis://127.0.0.1:6379/0")
CASES = ["asgi-redis", "asgi-memory", "wsgi-redis", "flask-redis"]


def _walk(run_one: Callable[[], None]) -> list[tuple[str, str]]:
    """(module, function) of every ratelimit_mw call event during `run_one()`."""
    events: list[tuple[str, str]] = []

    def profiler(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if module == "ratelimit_mw" or module.startswith("ratelimit_mw."):
            events.append((module, frame.f_code.co_qualname))

    sys.setprofile(profiler)
    try:
        run_one()
    finally:
        sys.setprofile(None)
    return events


def count(events: list[tuple[str, str]]) -> tuple[int, int, int, int]:
    """(calls, modules, hops, returns) of one walk."""
    hops = returns = 0
    entered: set[str] = set()
    previous = None
    for module, _ in events:
        if previous is not None and module != previous:
            hops += 1
            if module in entered:
                returns += 1
        entered.add(module)
        previous = module
    return len(events), len(entered), hops, returns


def _asgi_case(backend_kind: str) -> Callable[[], None]:
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse, Response
    from starlette.routing import Route

    from ratelimit_mw import AsyncLimiter, AsyncRedisBackend, MemoryBackend, Policy
    from ratelimit_mw.asgi import RateLimitMiddleware

    async def hello(request: Request) -> Response:
        return PlainTextResponse("Hello, world!")

    backend = (MemoryBackend() if backend_kind == "memory"
               else AsyncRedisBackend.from_url(REDIS_URL))
    limiter = AsyncLimiter(backend, prefix="rlhops")
    app = Starlette(routes=[Route("/", hello)], middleware=[Middleware(
        RateLimitMiddleware, limiter=limiter,
        default=Policy("1000000000/hour", algorithm="fixed-window"))])
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "GET", "scheme": "http", "path": "/", "raw_path": b"/",
             "root_path": "", "query_string": b"", "headers": [(b"host", b"x")],
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        return None

    loop = asyncio.new_event_loop()

    def one() -> None:
        loop.run_until_complete(app(dict(scope), receive, send))

    for _ in range(50):
        one()
    return one


def _wsgi_case(kind: str) -> Callable[[], None]:
    from werkzeug.test import EnvironBuilder

    from ratelimit_mw import Limiter, Policy, RedisBackend

    limiter = Limiter(RedisBackend.from_url(REDIS_URL), prefix="rlhops")
    policy = Policy("1000000000/hour", algorithm="fixed-window")
    app: Any
    if kind == "flask":
        from flask import Flask

        from ratelimit_mw.flask import RateLimit

        app = Flask(__name__)
        app.add_url_rule("/", "hello", lambda: "Hello, world!")
        RateLimit(app, limiter=limiter, default=policy)
    else:
        from ratelimit_mw.wsgi import RateLimitMiddleware

        def hello(environ: dict[str, Any], start_response: Any) -> list[bytes]:
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"Hello, world!"]

        app = RateLimitMiddleware(hello, limiter, default=policy)
    template = EnvironBuilder(path="/", base_url="http://127.0.0.1:8000/").get_environ()
    template["REMOTE_ADDR"] = "127.0.0.1"

    def start_response(status: str, headers: Any, exc: Any = None) -> None:
        return None

    def one() -> None:
        for _chunk in app(dict(template), start_response):
            pass

    for _ in range(50):
        one()
    return one


def measure(case: str, trace: bool = False) -> tuple[int, int, int, int]:
    stack, backend = case.split("-")
    one = _asgi_case(backend) if stack == "asgi" else _wsgi_case(stack)
    events = _walk(one)
    if trace:
        for module, function in events:
            print(f"    {module.removeprefix('ratelimit_mw.')}: {function}")
    return count(events)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", help="a checkout whose ratelimit_mw to measure")
    parser.add_argument("--trace", action="store_true", help="print each walk")
    parser.add_argument("cases", nargs="*", help=f"some of {CASES} (default: all)")
    args = parser.parse_args()
    if args.tree:
        sys.path.insert(0, str(Path(args.tree).resolve()))
    import ratelimit_mw

    print(f"# one warm admitted request; ratelimit_mw from {Path(ratelimit_mw.__file__).parent}")
    print("| case | calls | modules | hops | returns |")
    print("|---|---:|---:|---:|---:|")
    for case in args.cases or CASES:
        calls, modules, hops, returns = measure(case, args.trace)
        print(f"| {case} | {calls} | {modules} | {hops} | {returns} |", flush=True)
    _forget()


def _forget() -> None:
    """Delete what the cases counted in Redis."""
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match="rlhops:*"))
    if keys:
        client.delete(*keys)
    client.close()


if __name__ == "__main__":
    main()
