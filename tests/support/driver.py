"""The adapter driver of the conformance suite: one app, seven ways (ASGI, FastAPI, WSGI,
Flask, Django under WSGI and under ASGI, Litestar), on memory, on Redis over every
transport, and on Valkey (single node, Sentinel, cluster).

A test asks ``driver.build(config, ...)`` for the standard app (below) behind one adapter
and calls ``driver.request(method, path, headers)``; the answer is a `Reply` (status,
headers, body) whatever the adapter. The standard app:

- ``/``, ``/items`` (GET, POST), ``/login`` (POST): undecorated, answer 200;
- ``/status/<code>``: answers with that status;
- ``/limited``: ``@limiter.limit("2/minute")``; ``/exempt``: ``@limiter.exempt``;
- ``/keyed`` (GET, POST): ``@limiter.limit(route_rates, key=route_key, **route_options)``,
  ``"2/minute"`` by default.

Plain WSGI has no router: its decorated routes are plain routes (``driver.routes`` is
False), so tests of decorators skip it. Every app serves HEAD with the GET handler and
answers 405 to a method a route does not have, as the frameworks do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio

import ratelimit_mw as rl
from ratelimit_mw import keys
from ratelimit_mw.http.config import Config
from support import REDIS_URL, Recorder

ADAPTERS = ["asgi", "fastapi", "wsgi", "flask", "django", "django-asgi", "litestar"]
ROUTES = {"/": ["GET"], "/items": ["GET", "POST"], "/login": ["POST"], "/limited": ["GET"],
          "/exempt": ["GET"], "/keyed": ["GET", "POST"]}


@dataclass
class Reply:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes


def _reply(response: Any, body: bytes) -> Reply:
    """A framework's response (status_code, headers) as a Reply."""
    return Reply(response.status_code,
                 {k.lower(): v for k, v in response.headers.items()}, body)


def _methods_for(path: str) -> list[str] | None:
    if path.startswith("/status/"):
        return ["GET"]
    return ROUTES.get(path)


class Driver:
    """Builds the standard app behind one adapter and sends it requests."""

    def __init__(self, adapter: str, store: str, prefix: str, clock: Any,
                 url: str | None = None) -> None:
        self.adapter = adapter
        self.store = store
        self.url = url or REDIS_URL
        self.prefix = prefix
        self.clock = clock
        self.routes = adapter != "wsgi"
        # FastAPI and Litestar answer HEAD on a GET route 405 (Starlette, Flask and the WSGI
        # app serve it with the GET handler).
        self.serves_head = adapter not in ("fastapi", "litestar")
        # Litestar's router answers 404 and 405 before any route's middleware runs.
        self.sees_405 = adapter != "litestar"
        self.recorder = Recorder()
        self.backend: Any = None
        self._send: Callable[..., Reply] | None = None
        self._close: list[Callable[[], None]] = []

    # -- building --------------------------------------------------------------------------
    def build(self, config: Config, *, backend: Any = None,
              route_key: keys.KeyFunc | None = None, route_rates: Any = "2/minute",
              route_options: dict[str, Any] | None = None) -> Driver:
        asynchronous = self.adapter in ("asgi", "fastapi", "django-asgi", "litestar")
        if backend is None:
            if self.store == "memory":
                backend = rl.MemoryBackend()
            elif self.store == "valkey":  # a Valkey node: the app's own valkey-py client
                import valkey

                backend = (rl.AsyncRedisBackend(valkey.asyncio.Valkey.from_url(self.url))
                           if asynchronous else rl.RedisBackend(valkey.Valkey.from_url(self.url)))
            elif self.store != "redis":  # TLS, unix, Sentinel, cluster: a URL, as configured
                backend = (rl.AsyncRedisBackend if asynchronous else rl.RedisBackend).from_url(
                    self.url)
            elif asynchronous:  # the shared server over TCP: the app's own client
                backend = rl.AsyncRedisBackend(redis.asyncio.Redis.from_url(self.url))
            else:
                backend = rl.RedisBackend(redis.Redis.from_url(self.url))
        self.backend = backend
        limiter_type = rl.AsyncLimiter if asynchronous else rl.Limiter
        limiter = limiter_type(backend, prefix=self.prefix, clock=self.clock)
        limiter.metrics = self.recorder  # type: ignore[attr-defined]
        limit = limiter.limit
        if self.adapter.startswith("django"):
            from ratelimit_mw.django import limit
        self._keyed = limit(route_rates, key=route_key, **(route_options or {}))
        getattr(self, "_build_" + self.adapter.replace("-", "_"))(config, limiter, route_key)
        return self

    def _decorate(self, limiter: Any, route_key: keys.KeyFunc | None) -> dict[str, Any]:
        """The decorators of the standard app's routes."""
        return {
            "/limited": limiter.limit("2/minute"),
            "/exempt": limiter.exempt,
            "/keyed": self._keyed,
        }

    def _build_asgi(self, config: Config, limiter: Any, route_key: Any,
                    fastapi: bool = False) -> None:
        from starlette.requests import Request
        from starlette.responses import Response
        from starlette.routing import Route
        from starlette.testclient import TestClient

        from ratelimit_mw.asgi import RateLimitMiddleware

        decorators = self._decorate(limiter, route_key)

        def endpoint_for(path: str) -> Any:
            if fastapi:
                async def endpoint(code: int = 200) -> Response:
                    return Response(b"ok", status_code=code)
            else:
                async def endpoint(request: Request) -> Response:  # type: ignore[misc]
                    code = int(request.path_params.get("code", 200))
                    return Response(b"ok", status_code=code)

            endpoint.__name__ = endpoint.__qualname__ = "view" + path.replace("/", "_")
            decorate = decorators.get(path)
            return decorate(endpoint) if decorate else endpoint

        if fastapi:
            from fastapi import FastAPI

            app: Any = FastAPI()
            for path, methods in ROUTES.items():
                app.add_api_route(path, endpoint_for(path), methods=methods)
            app.add_api_route("/status/{code}", endpoint_for("/status"), methods=["GET"])
            app.add_middleware(RateLimitMiddleware, limiter=limiter, config=config)
        else:
            from starlette.applications import Starlette

            routes = [Route(path, endpoint_for(path), methods=methods)
                      for path, methods in ROUTES.items()]
            routes.append(Route("/status/{code}", endpoint_for("/status")))
            app = RateLimitMiddleware(Starlette(routes=routes), limiter, config=config)
        client = TestClient(app, raise_server_exceptions=True)
        client.__enter__()
        self._close.append(lambda: client.__exit__(None, None, None))
        backend = self.backend
        if isinstance(backend, rl.AsyncRedisBackend):
            # Connected as an app starts (`aping`), so that a slow connect (a busy machine,
            # the sentinels asked) is not a first request's failure policy.
            client.portal.call(backend.aping)
            # On the client's loop, before it ends: the redis.asyncio client is bound to it.
            self._close.append(lambda: client.portal.call(backend.aclose))

        def send(method: str, path: str, headers: dict[str, str]) -> Reply:
            response = client.request(method, path, headers=headers)
            return _reply(response, response.content)

        self._send = send

    def _build_fastapi(self, config: Config, limiter: Any, route_key: Any) -> None:
        self._build_asgi(config, limiter, route_key, fastapi=True)

    def _wsgi_send(self, app: Any) -> None:
        from werkzeug.test import Client

        client = Client(app)

        def send(method: str, path: str, headers: dict[str, str]) -> Reply:
            response = client.open(path, method=method, headers=headers)
            body = response.get_data()
            response.close()  # runs the refunds a WSGI server runs on close()
            return _reply(response, body)

        self._send = send

    def _build_wsgi(self, config: Config, limiter: Any, route_key: Any) -> None:
        from ratelimit_mw.wsgi import RateLimitMiddleware

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
            path = environ.get("PATH_INFO") or "/"
            methods = _methods_for(path)
            method = environ["REQUEST_METHOD"]
            if methods is None:
                status = "404 Not Found"
            elif method not in methods and not (method == "HEAD" and "GET" in methods):
                status = "405 Method Not Allowed"
            elif path.startswith("/status/"):
                status = path.rsplit("/", 1)[1] + " X"
            else:
                status = "200 OK"
            start_response(status, [("Content-Type", "text/plain")])
            return [b"ok"]

        self._wsgi_send(RateLimitMiddleware(app, limiter, config=config))

    def _build_flask(self, config: Config, limiter: Any, route_key: Any) -> None:
        from flask import Flask

        from ratelimit_mw.flask import RateLimit

        app = Flask("conformance")
        decorators = self._decorate(limiter, route_key)

        def view_for(path: str) -> Any:
            def view(code: int = 200) -> Any:
                return "ok", code

            view.__name__ = view.__qualname__ = "view" + path.replace("/", "_")
            decorate = decorators.get(path)
            return decorate(view) if decorate else view

        for path, methods in ROUTES.items():
            app.add_url_rule(path, view_func=view_for(path), methods=methods)
        app.add_url_rule("/status/<int:code>", view_func=view_for("/status"))
        RateLimit(app, limiter=limiter, config=config)
        self._wsgi_send(app)

    def _build_django(self, config: Config, limiter: Any, route_key: Any,
                      asynchronous: bool = False) -> None:
        from django.http import HttpResponse
        from django.urls import path
        from django.views import View

        from ratelimit_mw.django import exempt, limit
        from support.django_site import Site

        decorators = {"/limited": limit("2/minute"), "/exempt": exempt, "/keyed": self._keyed}

        def view_for(route: str, methods: list[str]) -> Any:
            def answer(self: Any, request: Any, code: int = 200) -> HttpResponse:
                return HttpResponse(b"ok", status=code)

            # A class-based view: Django answers 405 to a method it has no handler for.
            handlers = {method.lower(): answer for method in methods}
            view_class = type("View" + route.replace("/", "_"), (View,), handlers)
            decorate = decorators.get(route)
            return (decorate(view_class) if decorate else view_class).as_view()

        patterns = [path(route.lstrip("/"), view_for(route, methods))
                    for route, methods in ROUTES.items()]
        patterns.append(path("status/<int:code>", view_for("/status", ["GET"])))
        key = "async_limiter" if asynchronous else "limiter"
        site = Site(patterns, {**config.options(), key: limiter}, asynchronous=asynchronous)
        self._close.append(site.close)
        backend = self.backend
        if isinstance(backend, rl.AsyncRedisBackend):
            site.run(backend.aping())  # connected as an app starts (see `_build_asgi`)
            self._close.append(lambda: site.run(backend.aclose()))

        def send(method: str, path: str, headers: dict[str, str]) -> Reply:
            response = site.request(method, path, headers)
            return _reply(response, response.content)

        self._send = send

    def _build_django_asgi(self, config: Config, limiter: Any, route_key: Any) -> None:
        self._build_django(config, limiter, route_key, asynchronous=True)

    def _build_litestar(self, config: Config, limiter: Any, route_key: Any) -> None:
        from litestar import Litestar, Request, Response, route
        from litestar.testing import TestClient

        from ratelimit_mw.litestar import RateLimitPlugin

        decorators = self._decorate(limiter, route_key)

        def handler_for(path: str, methods: list[str]) -> Any:
            async def view(request: Request[Any, Any, Any]) -> Response[bytes]:
                code = int(request.path_params.get("code", 200))
                return Response(b"ok", status_code=code, media_type="text/plain")

            view.__name__ = view.__qualname__ = "view" + path.replace("/", "_")
            decorate = decorators.get(path)
            template = "/status/{code:int}" if path == "/status" else path
            # The annotations are strings (this module's __future__ import), resolved here.
            return route(template, http_method=methods, signature_namespace={
                "Request": Request, "Response": Response, "Any": Any})(
                decorate(view) if decorate else view)

        handlers = [handler_for(path, methods) for path, methods in ROUTES.items()]
        handlers.append(handler_for("/status", ["GET"]))
        # No logging_config: Litestar's would replace the root logger's handlers (caplog's).
        app = Litestar(handlers, plugins=[RateLimitPlugin(limiter, config=config)],
                       openapi_config=None, logging_config=None)
        client = TestClient(app, raise_server_exceptions=True)
        client.__enter__()
        self._close.append(lambda: client.__exit__(None, None, None))
        backend = self.backend
        if isinstance(backend, rl.AsyncRedisBackend):
            client.blocking_portal.call(backend.aping)  # connected as an app starts
            # On the client's loop, before it ends: the redis.asyncio client is bound to it.
            self._close.append(lambda: client.blocking_portal.call(backend.aclose))

        def send(method: str, path: str, headers: dict[str, str]) -> Reply:
            response = client.request(method, path, headers=headers)
            return _reply(response, response.content)

        self._send = send

    # -- using -----------------------------------------------------------------------------
    def request(self, method: str = "GET", path: str = "/",
                headers: dict[str, str] | None = None) -> Reply:
        assert self._send is not None, "call driver.build(config) first"
        return self._send(method, path, headers or {})

    def statuses(self, count: int, method: str = "GET", path: str = "/",
                 headers: dict[str, str] | None = None) -> list[int]:
        return [self.request(method, path, headers).status for _ in range(count)]

    def close(self) -> None:
        for close in reversed(self._close):
            close()
        if isinstance(self.backend, rl.RedisBackend):
            self.backend.close()
