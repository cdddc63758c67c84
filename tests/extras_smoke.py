"""One extra, alone: import the adapter its docs name and serve one request through it.

    python tests/extras_smoke.py django            # in a venv with only ratelimit_mw[django]
    python tests/extras_smoke.py django --hide     # in the test venv, the other frameworks hidden

Run by `scripts/extras_alone.py` in a fresh virtual environment per extra (CI), and by
`tests/test_extras_alone.py` with every framework the extra does not bring hidden. Each case
also checks that the frameworks its extra does not bring are absent: a case that passes only
because something else happened to be installed proves nothing. Exits non-zero on failure.
"""

from __future__ import annotations

import asyncio
import importlib.abc
import importlib.util
import os
import sys
import uuid
from collections.abc import Callable, Sequence
from typing import Any

#: The packages whose presence would let an adapter lean on another extra.
FRAMEWORKS = frozenset({"werkzeug", "flask", "starlette", "fastapi", "litestar", "django",
                        "httpx", "httpx2", "redis", "prometheus_client", "opentelemetry"})

#: What each extra brings of FRAMEWORKS (its own and its dependencies').
BRINGS: dict[str, frozenset[str]] = {
    "none": frozenset(),
    "redis": frozenset({"redis"}),
    "starlette": frozenset({"starlette"}),
    "fastapi": frozenset({"fastapi", "starlette", "opentelemetry"}),
    "flask": frozenset({"flask", "werkzeug"}),
    "django": frozenset({"django"}),
    "litestar": frozenset({"litestar", "httpx"}),
    "httpx": frozenset({"httpx"}),
    "httpx2": frozenset({"httpx2"}),
    "prometheus": frozenset({"prometheus_client"}),
    "otel": frozenset({"opentelemetry"}),
}

REDIS_URL = os.environ.get("RATELIMIT_REDIS_URL", "redis://127.0.0.1:6379/0")


class _Hidden(importlib.abc.MetaPathFinder):
    """Makes the named top-level packages unimportable, as if not installed."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names

    def find_spec(self, name: str, path: Sequence[str] | None = None,
                  target: object = None) -> None:
        if name.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden)", name=name)
        return None


def _absent(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except ImportError:
        return True


def _asgi_get(app: Any, path: str, headers: Sequence[tuple[bytes, bytes]] = ()) -> tuple[
        int, dict[str, str]]:
    """One GET through an ASGI app, with no HTTP client installed: status and headers."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "GET", "scheme": "http", "path": path, "raw_path": path.encode(),
             "root_path": "", "query_string": b"", "headers": list(headers),
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000), "state": {}}

    async def run() -> None:
        await app(scope, receive, send)

    asyncio.run(run())
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], {k.decode().lower(): v.decode() for k, v in start["headers"]}


def _expect(status: int, headers: dict[str, str], want: int, remaining: str | None) -> None:
    if status != want:
        raise SystemExit(f"expected {want}, got {status} {headers}")
    if remaining is not None and f"r={remaining}" not in headers.get("ratelimit", ""):
        raise SystemExit(f"expected r={remaining} in RateLimit, got {headers}")


def none() -> None:
    """No extra: the memory backend and the plain WSGI middleware, standard library only."""
    from wsgiref.util import setup_testing_defaults

    import ratelimit_mw as rl
    from ratelimit_mw.wsgi import RateLimitMiddleware

    seen: list[str | None] = []

    def key(request: Any) -> str:
        seen.append(request.headers.get("x-api-key"))
        return "k:" + str(request.headers.get("X-Api-Key"))

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    wrapped = RateLimitMiddleware(app, rl.Limiter(rl.MemoryBackend()), default="2/minute",
                                  key=key)
    answers = []
    for _ in range(3):
        environ: dict[str, Any] = {"HTTP_X_API_KEY": "abc"}
        setup_testing_defaults(environ)
        got: dict[str, Any] = {}

        def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None,
                           got: dict[str, Any] = got) -> Callable[[bytes], None]:
            got["status"], got["headers"] = status, dict(headers)
            return lambda data: None

        b"".join(wrapped(environ, start_response))
        answers.append(got["status"][:3])
    if answers != ["200", "200", "429"] or seen != ["abc"] * 3:
        raise SystemExit(f"plain WSGI: {answers}, key saw {seen}")


def redis() -> None:
    import ratelimit_mw as rl

    prefix = "extras" + uuid.uuid4().hex[:10]
    limiter = rl.Limiter(rl.RedisBackend.from_url(REDIS_URL), prefix=prefix)
    policy = rl.Policy("2/minute", name="smoke")
    try:
        answers = [limiter.hit(policy, "who").allowed for _ in range(3)]
    finally:
        limiter.reset(policy, "who")
    if answers != [True, True, False]:
        raise SystemExit(f"RedisBackend: {answers}")

    async def async_hits() -> list[bool]:
        alimiter = rl.AsyncLimiter(rl.AsyncRedisBackend.from_url(REDIS_URL), prefix=prefix)
        try:
            return [(await alimiter.hit(policy, "who")).allowed for _ in range(3)]
        finally:
            await alimiter.reset(policy, "who")

    answers = asyncio.run(async_hits())
    if answers != [True, True, False]:
        raise SystemExit(f"AsyncRedisBackend: {answers}")


def starlette() -> None:
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    import ratelimit_mw as rl
    from ratelimit_mw.asgi import RateLimitMiddleware

    limiter = rl.AsyncLimiter(rl.MemoryBackend())

    @limiter.limit("1/minute")
    async def search(request: Any) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/search", search)])
    app.add_middleware(RateLimitMiddleware, limiter=limiter, default="5/minute")
    _expect(*_asgi_get(app, "/search"), 200, "0")
    _expect(*_asgi_get(app, "/search"), 429, "0")


def fastapi() -> None:
    from fastapi import Depends, FastAPI

    import ratelimit_mw as rl
    from ratelimit_mw.asgi import RateLimitMiddleware
    from ratelimit_mw.fastapi import RateLimitDependency

    limiter = rl.AsyncLimiter(rl.MemoryBackend())
    app = FastAPI()

    @app.get("/search")
    @limiter.limit("1/minute")
    async def search() -> dict[str, str]:
        return {"ok": "yes"}

    @app.get("/items", dependencies=[Depends(RateLimitDependency(limiter, "1/minute"))])
    async def items() -> dict[str, str]:
        return {"ok": "yes"}

    app.add_middleware(RateLimitMiddleware, limiter=limiter, default="5/minute")
    _expect(*_asgi_get(app, "/search"), 200, "0")
    _expect(*_asgi_get(app, "/search"), 429, "0")
    _expect(*_asgi_get(app, "/items"), 200, None)
    _expect(*_asgi_get(app, "/items"), 429, None)


def flask() -> None:
    from flask import Flask

    import ratelimit_mw as rl
    from ratelimit_mw.flask import RateLimit

    limiter = rl.Limiter(rl.MemoryBackend())
    app = Flask("smoke")

    @app.get("/search")
    @limiter.limit("1/minute")
    def search() -> str:
        return "ok"

    RateLimit(app, limiter=limiter, default="5/minute")
    client = app.test_client()
    answers = [client.get("/search").status_code for _ in range(2)]
    if answers != [200, 429]:
        raise SystemExit(f"Flask: {answers}")


def django() -> None:
    import django as django_module
    from django.conf import settings

    settings.configure(
        DEBUG=False,
        SECRET_KEY="smoke",
        ALLOWED_HOSTS=["testserver"],
        ROOT_URLCONF=__name__,
        INSTALLED_APPS=["ratelimit_mw.django"],
        MIDDLEWARE=["ratelimit_mw.django.RateLimitMiddleware"],
        RATELIMIT={"default": "5/minute"},
    )
    django_module.setup()
    from django.core.management import call_command
    from django.http import HttpResponse
    from django.test import Client
    from django.urls import path

    from ratelimit_mw.django import limit

    @limit("1/minute")
    def search(request: Any) -> HttpResponse:
        return HttpResponse("ok")

    globals()["urlpatterns"] = [path("search", search)]
    call_command("check")  # a Django user's first command
    client = Client()
    answers = [client.get("/search").status_code for _ in range(2)]
    if answers != [200, 429]:
        raise SystemExit(f"Django: {answers}")


def litestar() -> None:
    from litestar import Litestar, get
    from litestar.testing import TestClient

    import ratelimit_mw as rl
    from ratelimit_mw.litestar import RateLimitPlugin

    limiter = rl.AsyncLimiter(rl.MemoryBackend())

    @get("/search")
    @limiter.limit("1/minute")
    async def search() -> str:
        return "ok"

    app = Litestar([search], plugins=[RateLimitPlugin(limiter, default="5/minute")])
    with TestClient(app) as client:
        answers = [client.get("/search").status_code for _ in range(2)]
    if answers != [200, 429]:
        raise SystemExit(f"Litestar: {answers}")


def httpx() -> None:
    import httpx as httpx_module

    import ratelimit_mw as rl
    from ratelimit_mw.httpx import RateLimitTransport

    calls: list[str] = []

    def provider(request: httpx_module.Request) -> httpx_module.Response:
        calls.append(str(request.url))
        return httpx_module.Response(200, json={"ok": True})

    transport = RateLimitTransport(rl.Limiter(rl.MemoryBackend()), "5/minute",
                                   wrapped=httpx_module.MockTransport(provider))
    with httpx_module.Client(transport=transport) as client:
        status = client.get("https://api.example.test/v1").status_code
    if status != 200 or len(calls) != 1:
        raise SystemExit(f"httpx transport: {status}, {calls}")


def httpx2() -> None:
    import httpx2 as httpx2_module

    import ratelimit_mw as rl
    from ratelimit_mw.httpx2 import RateLimitTransport

    calls: list[str] = []

    def provider(request: httpx2_module.Request) -> httpx2_module.Response:
        calls.append(str(request.url))
        return httpx2_module.Response(200, json={"usage": {"total_tokens": 7}})

    transport = RateLimitTransport(rl.Limiter(rl.MemoryBackend()), "100/minute",
                                   key="llm", settle="usage",
                                   wrapped=httpx2_module.MockTransport(provider))
    with httpx2_module.Client(transport=transport) as client:
        status = client.post("https://api.example.test/v1/chat", json={}).status_code
    if status != 200 or len(calls) != 1:
        raise SystemExit(f"httpx2 transport: {status}, {calls}")


def prometheus() -> None:
    from prometheus_client import CollectorRegistry

    import ratelimit_mw as rl
    from ratelimit_mw.metrics import PrometheusMetrics

    registry = CollectorRegistry()
    limiter = rl.Limiter(rl.MemoryBackend(), metrics=PrometheusMetrics(registry))
    limiter.hit(rl.Policy("1/minute", name="smoke"), "who")
    limiter.hit(rl.Policy("1/minute", name="smoke"), "who")
    samples = {(s.name, s.labels.get("outcome")): s.value
               for metric in registry.collect() for s in metric.samples}
    if not any(value >= 1 and name.endswith("_total") for (name, _), value in samples.items()):
        raise SystemExit(f"Prometheus: no decision counted in {samples}")


def otel() -> None:
    import ratelimit_mw as rl
    from ratelimit_mw.metrics import OpenTelemetryMetrics

    # The API alone (no SDK): its no-op meter; a hit must work and count nothing anywhere.
    limiter = rl.Limiter(rl.MemoryBackend(), metrics=OpenTelemetryMetrics())
    if not limiter.hit(rl.Policy("1/minute", name="smoke"), "who").allowed:
        raise SystemExit("OpenTelemetry: the first hit was refused")


CASES: dict[str, Callable[[], None]] = {
    "none": none, "redis": redis, "starlette": starlette, "fastapi": fastapi, "flask": flask,
    "django": django, "litestar": litestar, "httpx": httpx, "httpx2": httpx2,
    "prometheus": prometheus,
    "otel": otel,
}


def main(argv: Sequence[str]) -> None:
    extra, *flags = argv
    # This file's folder (tests/) holds folders named after frameworks (tests/litestar).
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != here]
    others = FRAMEWORKS - BRINGS[extra]
    if "--hide" in flags:
        sys.meta_path.insert(0, _Hidden(others))
    present = sorted(name for name in others if not _absent(name))
    if present:
        raise SystemExit(f"[{extra}] is not alone: {', '.join(present)} importable")
    CASES[extra]()
    print(f"[{extra}] alone: served")


if __name__ == "__main__":
    main(sys.argv[1:])
