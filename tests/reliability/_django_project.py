"""A Django project as deployed, for the multi-worker servers (gunicorn: ``make_wsgi()``;
uvicorn: ``--factory make_asgi``), configured by the environment: RL_REDIS_URL, RL_PREFIX.

``/burst`` is limited by the settings' default, ``100/minute`` per ``X-Client``, at the
library's defaults otherwise; it answers whether a Decision was made
(``{"decided": true}``), so that a request the failure policy let through unchecked shows.
``/view`` has a per-view limit (3 a minute, an async view); ``/purge`` is a class-based
view limited on the class (`PURGE_LIMIT` a minute) with a handler for the extension method
PURGE only; ``/healthz`` is exempt.
"""

from __future__ import annotations

import os
from typing import Any

from ratelimit_mw import keys

LIMIT = 100
PURGE_LIMIT = 5

SECRET_KEY = "ratelimit_mw served tests"
DEBUG = False
ALLOWED_HOSTS = ["*"]
ROOT_URLCONF = "reliability._django_project"
INSTALLED_APPS = ["ratelimit_mw.django"]
MIDDLEWARE = ["ratelimit_mw.django.RateLimitMiddleware"]
DATABASES: dict[str, Any] = {}
USE_TZ = True
RATELIMIT: dict[str, Any] = {
    "default": f"{LIMIT}/minute",
    "key": keys.header("x-client"),
    "backend": os.environ.get("RL_REDIS_URL", "memory://"),
    "prefix": os.environ.get("RL_PREFIX", "rl"),
}


def _urls() -> list[Any]:
    from django.http import JsonResponse
    from django.urls import path
    from django.views import View

    from ratelimit_mw.django import exempt, limit

    def burst(request: Any) -> JsonResponse:
        return JsonResponse({"decided": request.ratelimit is not None})

    @limit("3/minute")
    async def view(request: Any) -> JsonResponse:  # a per-view limit, on an async view
        return JsonResponse({"decided": request.ratelimit is not None})

    @exempt
    def healthz(request: Any) -> JsonResponse:
        return JsonResponse({"ok": True})

    @limit(f"{PURGE_LIMIT}/minute")
    class Purge(View):  # an extension method with a handler; PROPFIND has none (405)
        http_method_names = (*View.http_method_names, "purge")

        def purge(self, request: Any) -> JsonResponse:
            return JsonResponse({"decided": request.ratelimit is not None})

    return [path("burst", burst), path("view", view), path("purge", Purge.as_view()),
            path("healthz", healthz)]


urlpatterns: list[Any] = []


def _setup() -> None:
    os.environ["DJANGO_SETTINGS_MODULE"] = __name__
    import django

    django.setup()
    urlpatterns[:] = _urls()


def make_wsgi() -> Any:
    _setup()
    from django.core.wsgi import get_wsgi_application

    return get_wsgi_application()


def make_asgi() -> Any:
    _setup()
    from django.core.asgi import get_asgi_application

    return get_asgi_application()
