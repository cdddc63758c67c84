"""The app test_gunicorn.py serves with gunicorn (2 sync workers) on the real Redis.

Configured by the environment: RATELIMIT_REDIS_URL, RATELIMIT_PREFIX (one per test run) and
RATELIMIT_TEST_LIMIT. The Flask extension guards "/", the plain WSGI middleware "/plain";
every response names the worker that produced it (X-Worker), the 429s included.
"""

from __future__ import annotations

import os
import time
from typing import Any

from flask import Flask, Response
from werkzeug.middleware.dispatcher import DispatcherMiddleware

import ratelimit_mw as rl
from ratelimit_mw.flask import RateLimit
from ratelimit_mw.wsgi import RateLimitMiddleware

LIMIT = os.environ.get("RATELIMIT_TEST_LIMIT", "10/minute")
# Admitted requests hold their worker briefly, so that concurrent requests reach the other.
HOLD = 0.05

limiter = rl.Limiter(
    rl.RedisBackend.from_url(os.environ.get("RATELIMIT_REDIS_URL", "redis://127.0.0.1:6379/0")),
    prefix=os.environ.get("RATELIMIT_PREFIX", "gunicorn-test"),
)

flask_app = Flask(__name__)


@flask_app.route("/")
def index() -> dict[str, Any]:
    time.sleep(HOLD)
    return {"pid": os.getpid()}


@flask_app.route("/health")
@limiter.exempt
def health() -> str:
    return "ok"


@flask_app.after_request
def name_the_worker(response: Response) -> Response:
    response.headers["X-Worker"] = str(os.getpid())
    return response


RateLimit(flask_app, limiter=limiter, default=rl.Policy(LIMIT, name="flask"))


def plain(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    time.sleep(HOLD)
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"plain"]


def named(app: Any) -> Any:
    def wrapper(environ: dict[str, Any], start_response: Any) -> Any:
        def start(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            return start_response(status, [*headers, ("X-Worker", str(os.getpid()))], exc_info)

        return app(environ, start)

    return wrapper


app = DispatcherMiddleware(flask_app, {
    "/plain": named(RateLimitMiddleware(plain, limiter, default=rl.Policy(LIMIT, name="plain"))),
})
