"""Rate limiting for Django, WSGI and ASGI alike.

    # settings.py
    INSTALLED_APPS = [..., "ratelimit_mw.django"]          # system checks
    MIDDLEWARE = [..., "django.contrib.auth.middleware.AuthenticationMiddleware",
                  "ratelimit_mw.django.RateLimitMiddleware"]
    RATELIMIT = {"default": "100/minute", "backend": "redis://127.0.0.1:6379/0"}

    # views.py
    from ratelimit_mw.django import exempt, limit

    @limit("5/minute", methods=["POST"])
    def login(request): ...

``settings.RATELIMIT`` takes every keyword of ``Config`` plus ``backend`` (a URL;
``memory://`` when absent) and ``prefix`` (`ratelimit_mw.django.conf`). Keys read Django's
request: ``keys.client_ip()`` (the same trusted-proxy model), ``keys.user()``
(``request.user.pk``), `user_or_ip`, `form_field` / `query_param` (django-ratelimit's
``post:`` / ``get:`` keys) and ``keys.route()`` (the URL pattern, not the path).
"""

from __future__ import annotations

from ratelimit_mw.http.extras import require

require("django", "django", "ratelimit_mw.django")

from ratelimit_mw import keys as _keys  # noqa: E402
from ratelimit_mw.django.decorators import exempt, limit  # noqa: E402
from ratelimit_mw.django.fields import form_field, query_param  # noqa: E402
from ratelimit_mw.django.middleware import RateLimitMiddleware  # noqa: E402
from ratelimit_mw.django.views import ais_ratelimited, is_ratelimited  # noqa: E402
from ratelimit_mw.http.rules import Rule  # noqa: E402
from ratelimit_mw.keys import KeyFunc  # noqa: E402

__all__ = ["RateLimitMiddleware", "Rule", "ais_ratelimited", "exempt", "form_field",
           "is_ratelimited", "limit", "query_param", "user_or_ip"]


def user_or_ip(trusted_proxies: list[str] | int | None = None) -> KeyFunc:
    """The authenticated user's primary key, else the client IP (anonymous users):
    django-ratelimit's ``key="user_or_ip"``."""
    return _keys.first(_keys.user(), _keys.client_ip(trusted_proxies))
