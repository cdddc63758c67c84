"""Hello-world Flask apps for the throughput benchmark, one per configuration.

gunicorn imports ``bench_wsgi_app:app``; the environment picks the configuration, as in
``bench_asgi_app`` (``BENCH_APP``, ``BENCH_REDIS_URL``, ``BENCH_PREFIX``, ``BENCH_LIMIT``).
Every configuration limits every request by client IP with the fixed-window algorithm.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from flask import Flask, request

REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("BENCH_PREFIX", "rlbench")
LIMIT = os.environ.get("BENCH_LIMIT", "1000000000/hour")
ALGORITHM = "fixed-window"

FLOOR_SCRIPT = """
local n = redis.call('INCR', KEYS[1])
if n == 1 then redis.call('EXPIRE', KEYS[1], ARGV[1]) end
return n
"""


def _flask() -> Flask:
    app = Flask(__name__)

    @app.route("/")
    def hello() -> str:
        return "Hello, world!"

    return app


def _limiter() -> Any:
    from ratelimit_mw import Limiter, Policy, RedisBackend

    return Limiter(RedisBackend.from_url(REDIS_URL), prefix=PREFIX), Policy(
        LIMIT, algorithm=ALGORITHM)


def _rl_extension() -> Flask:
    from ratelimit_mw.flask import RateLimit

    app = _flask()
    limiter, policy = _limiter()
    RateLimit(app, limiter=limiter, default=policy)
    return app


def _rl_wsgi() -> Flask:
    from ratelimit_mw.wsgi import RateLimitMiddleware

    app = _flask()
    limiter, policy = _limiter()
    app.wsgi_app = RateLimitMiddleware(app.wsgi_app, limiter, default=policy)  # type: ignore[method-assign]
    return app


def _floor() -> Flask:
    """What any Redis-backed limiter must at least do: one EVALSHA in before_request."""
    import redis

    from ratelimit_mw import Rate

    app = _flask()
    client = redis.Redis.from_url(REDIS_URL)
    rate = Rate.parse(LIMIT)
    limit, window = rate.limit, max(1, rate.period_ms // 1000)
    sha = client.script_load(FLOOR_SCRIPT)

    @app.before_request
    def floor() -> Any:
        count = client.evalsha(sha, 1, f"{PREFIX}:floor:{request.remote_addr}", window)
        if int(count) > limit:
            return "Too Many Requests", 429
        return None

    return app


def _flask_limiter() -> Flask:
    from flask_limiter import Limiter
    from flask_limiter.util import get_remote_address

    app = _flask()
    Limiter(get_remote_address, app=app, default_limits=[LIMIT], storage_uri=REDIS_URL,
            key_prefix=PREFIX, strategy=ALGORITHM)
    return app


BUILDERS: dict[str, Callable[[], Flask]] = {
    "flask-bare": _flask,
    "flask-floor": _floor,
    "flask-rl-ext": _rl_extension,
    "flask-rl-wsgi": _rl_wsgi,
    "flask-limiter": _flask_limiter,
}

app = BUILDERS[os.environ.get("BENCH_APP", "flask-bare")]()
