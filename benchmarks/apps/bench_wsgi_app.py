"""Hello-world Flask and Django apps for the throughput benchmark, one per configuration.

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


def _django(kind: str) -> Any:
    """Django's hello world under WSGI: bare, with the floor (one EVALSHA in a middleware),
    with ratelimit_mw's middleware (the settings' default), or with django-ratelimit's
    decorator on the view (its cache on Redis through django-redis), each limiting every
    request by client IP with a fixed window."""
    import django
    from django.conf import settings

    from ratelimit_mw import Policy

    rate = LIMIT
    settings.configure(
        DEBUG=False, SECRET_KEY="bench", ALLOWED_HOSTS=["*"], ROOT_URLCONF=__name__,
        DATABASES={}, USE_TZ=True,
        INSTALLED_APPS=["ratelimit_mw.django"] if kind == "rl" else [],
        MIDDLEWARE=(["ratelimit_mw.django.RateLimitMiddleware"] if kind == "rl"
                    else [f"{__name__}.DjangoFloor"] if kind == "floor" else []),
        RATELIMIT={"default": Policy(LIMIT, algorithm=ALGORITHM), "backend": REDIS_URL,
                   "prefix": PREFIX},
        CACHES={"default": {"BACKEND": "django_redis.cache.RedisCache",
                            "LOCATION": REDIS_URL, "KEY_PREFIX": PREFIX}}
        if kind == "django-ratelimit" else {},
        RATELIMIT_USE_CACHE="default",
    )
    django.setup()
    from django.core.wsgi import get_wsgi_application
    from django.http import HttpResponse
    from django.urls import path

    def hello(request: Any) -> HttpResponse:
        return HttpResponse("Hello, world!")

    if kind == "django-ratelimit":
        from django_ratelimit.decorators import ratelimit

        count, _, period = rate.partition("/")
        hello = ratelimit(key="ip", rate=f"{count}/{period[0]}", block=True)(hello)
    globals()["urlpatterns"] = [path("", hello)]
    return get_wsgi_application()


class DjangoFloor:
    """What any Redis-backed limiter must at least do, as a Django middleware: one EVALSHA."""

    def __init__(self, get_response: Any) -> None:
        import redis

        from ratelimit_mw import Rate

        self.get_response = get_response
        self.client = redis.Redis.from_url(REDIS_URL)
        rate = Rate.parse(LIMIT)
        self.limit, self.window = rate.limit, max(1, rate.period_ms // 1000)
        self.sha = self.client.script_load(FLOOR_SCRIPT)

    def __call__(self, request: Any) -> Any:
        from django.http import HttpResponse

        key = f"{PREFIX}:floor:{request.META.get('REMOTE_ADDR')}"
        if int(self.client.evalsha(self.sha, 1, key, self.window)) > self.limit:
            return HttpResponse("Too Many Requests", status=429)
        return self.get_response(request)


BUILDERS: dict[str, Callable[[], Any]] = {
    "flask-bare": _flask,
    "flask-floor": _floor,
    "flask-rl-ext": _rl_extension,
    "flask-rl-wsgi": _rl_wsgi,
    "flask-limiter": _flask_limiter,
    "django-bare": lambda: _django("bare"),
    "django-floor": lambda: _django("floor"),
    "django-rl": lambda: _django("rl"),
    "django-ratelimit": lambda: _django("django-ratelimit"),
}

app = BUILDERS[os.environ.get("BENCH_APP", "flask-bare")]()
