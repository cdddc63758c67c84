"""The apps the multi-worker servers run (uvicorn: ``--factory make_asgi_app``; gunicorn:
``make_wsgi_app()``), configured by the environment: RL_REDIS_URL (``redis://`` or
``redis+cluster://``) and RL_PREFIX.

Every algorithm gets three routes, each limited by a path rule:

- ``/single/<code>``: one tier, 7 a day, per ``X-Client``;
- ``/tiers/<code>``: two tiers, 9 a day and 6 a week (the second one binds), per ``X-Client``;
- ``/both/<code>``: two policies at once, 10 a day per ``X-Team`` and 6 a day per
  ``X-Client``; on a cluster the two identities live in different slots.

Periods are days and weeks so that no window turns over during a burst of a second.
Timeouts are generous and a backend failure answers 503 (``on_backend_error="deny"``): these
servers prove counting under contention, so a slow call must show up as a failure, never
as an admission. The outage tests prove the default timeouts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from typing import Any

from ratelimit_mw import Policy, keys
from ratelimit_mw.asgi import Rule

ALGORITHMS = {"fw": "fixed-window", "sl": "sliding-log", "sw": "sliding-window", "gc": "gcra"}

SINGLE_LIMIT = 7
TIERS_LIMIT = 6
BOTH_LIMIT = 6
WIDE_LIMIT = 10


def single(code: str) -> Policy:
    return Policy(f"{SINGLE_LIMIT}/day", algorithm=ALGORITHMS[code], name="single")


def tiers(code: str) -> Policy:
    return Policy(f"9/day;{TIERS_LIMIT}/week", algorithm=ALGORITHMS[code], name="tiers")


def wide(code: str) -> Policy:
    return Policy(f"{WIDE_LIMIT}/day", algorithm=ALGORITHMS[code], name="wide")


def narrow(code: str) -> Policy:
    return Policy(f"{BOTH_LIMIT}/day", algorithm=ALGORITHMS[code], name="narrow")


def rules() -> list[Rule]:
    out: list[Rule] = []
    for code in ALGORITHMS:
        out.append(Rule(f"/single/{code}", single(code)))
        out.append(Rule(f"/tiers/{code}", tiers(code)))
        out.append(Rule(f"/both/{code}", wide(code), key=keys.header("x-team")))
        out.append(Rule(f"/both/{code}", narrow(code)))
    return out


def _settings() -> tuple[str, str]:
    return os.environ["RL_REDIS_URL"], os.environ["RL_PREFIX"]


def _body() -> bytes:
    return json.dumps({"pid": os.getpid()}).encode()


def make_asgi_app() -> Any:
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    from ratelimit_mw import AsyncLimiter, AsyncRedisBackend
    from ratelimit_mw.asgi import RateLimitMiddleware

    async def endpoint(request: Any) -> Response:
        return Response(_body(), media_type="application/json")

    url, prefix = _settings()
    app = Starlette(routes=[Route("/{path:path}", endpoint)])
    limiter = AsyncLimiter(AsyncRedisBackend.from_url(url, socket_timeout=5,
                                                      socket_connect_timeout=5), prefix=prefix)
    return RateLimitMiddleware(app, limiter, rules=rules(), key=keys.header("x-client"),
                               on_backend_error="deny", backend_timeout=5.0)


def make_wsgi_app() -> Any:
    from ratelimit_mw import Limiter, RedisBackend
    from ratelimit_mw.wsgi import RateLimitMiddleware

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        body = _body()
        start_response("200 OK", [("Content-Type", "application/json"),
                                  ("Content-Length", str(len(body)))])
        return [body]

    url, prefix = _settings()
    limiter = Limiter(RedisBackend.from_url(url, socket_timeout=5, socket_connect_timeout=5),
                      prefix=prefix)
    return RateLimitMiddleware(app, limiter, rules=rules(), key=keys.header("x-client"),
                               on_backend_error="deny")
