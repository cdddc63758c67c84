"""A Flask app limited by ratelimit_mw.

    flask --app examples.flask_app run
    gunicorn --workers 4 examples.flask_app:app      # needs RATELIMIT_REDIS_URL, see below

Counts in memory unless RATELIMIT_REDIS_URL is set (e.g. redis://localhost:6379/0). The
memory backend counts per process: under gunicorn with several workers each worker would
grant the full quota, so set RATELIMIT_REDIS_URL there.

    curl -i localhost:5000/                  # RateLimit / RateLimit-Policy headers
    curl -i localhost:5000/users/7           # keyed by client and route template
    curl -i -X POST localhost:5000/login     # 5/minute, then 429 with Retry-After
    curl -i localhost:5000/api/status        # the blueprint's shared 30/minute
"""

from __future__ import annotations

import os
from typing import Any

from flask import Blueprint, Flask, g, request

import ratelimit_mw as rl
from ratelimit_mw import keys
from ratelimit_mw.flask import RateLimit, RateLimited


def make_limiter() -> rl.Limiter:
    url = os.environ.get("RATELIMIT_REDIS_URL")
    # from_url: ~100 ms timeouts, so a Redis outage costs milliseconds, not a hung worker.
    backend = rl.RedisBackend.from_url(url) if url else rl.MemoryBackend()
    return rl.Limiter(backend, prefix="example")


limiter = make_limiter()

# Configured once at import; init_app installs it on each app the factory builds.
ratelimit = RateLimit(
    limiter=limiter,
    default="60/minute",                      # every route without a decorator
    key=keys.client_ip(),                     # behind a proxy: trusted_proxies=[...]
    on_backend_error="allow",                 # Redis down: serve, log once in a while
)

api = Blueprint("api", __name__, url_prefix="/api")
ratelimit.limit_blueprint(api, "30/minute")  # one quota for the whole blueprint


@api.route("/status")
def status() -> dict[str, Any]:
    return {"ok": True}


@api.route("/search")
@limiter.limit("10/minute")                   # a view's own limit replaces the blueprint's
def search() -> dict[str, Any]:
    return {"results": [], "q": request.args.get("q", "")}


def create_app() -> Flask:
    app = Flask(__name__)

    @app.route("/")
    def index() -> dict[str, Any]:
        decision = g.get("ratelimit")
        return {"hello": "world",
                "remaining": decision.remaining if decision is not None else None}

    @app.route("/users/<int:user_id>")
    @limiter.limit("20/minute", key=keys.compose(keys.client_ip(), keys.route()))
    def user(user_id: int) -> dict[str, Any]:
        # Keyed by "/users/<int:user_id>": /users/1 and /users/2 spend one quota.
        return {"id": user_id}

    @app.route("/login", methods=["POST"])
    @limiter.limit("5/minute")
    def login() -> tuple[dict[str, Any], int]:
        return {"detail": "wrong password"}, 401

    @app.route("/health")
    @limiter.exempt
    def health() -> str:
        return "ok"

    @app.errorhandler(429)
    def too_many_requests(error: RateLimited) -> tuple[dict[str, Any], int]:
        # The rate-limit headers (Retry-After, RateLimit, ...) are added to this response.
        return {"error": "slow down", "retry_after": error.retry_after}, 429

    app.register_blueprint(api)
    ratelimit.init_app(app)
    return app


app = create_app()
