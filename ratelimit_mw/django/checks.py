"""Django system checks: ``manage.py check`` reports a mistake in ``settings.RATELIMIT``
(E001, with the same "did you mean" as everywhere), an app installed without its
middleware (W001) and django-ratelimit's settings, which ratelimit_mw does not read (W002,
one per setting, with what to write instead), before any request."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning, register

from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.django import conf
from ratelimit_mw.django.legacy import legacy_settings

MIDDLEWARE = "ratelimit_mw.django.RateLimitMiddleware"


@register()
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    found: list[CheckMessage] = []
    try:
        conf.read(getattr(settings, "RATELIMIT", None))
    except ConfigurationError as exc:
        found.append(Error(str(exc), hint="see the Django page of ratelimit_mw's docs",
                           obj="settings.RATELIMIT", id="ratelimit_mw.E001"))
    if MIDDLEWARE not in getattr(settings, "MIDDLEWARE", ()):
        found.append(Warning(
            f"ratelimit_mw.django is installed but {MIDDLEWARE!r} is not in MIDDLEWARE: "
            "nothing is limited",
            hint=f"add {MIDDLEWARE!r} to MIDDLEWARE (after AuthenticationMiddleware when a "
                 "key reads request.user)",
            obj="settings.MIDDLEWARE", id="ratelimit_mw.W001"))
    # A warning, not an error: django-ratelimit may still serve other views meanwhile.
    found.extend(Warning(
        f"{name} is django-ratelimit's setting; ratelimit_mw does not read it",
        hint=f"in ratelimit_mw: {instead}; remove {name} once django-ratelimit is gone",
        obj=f"settings.{name}", id="ratelimit_mw.W002")
        for name, instead in legacy_settings(settings))
    return found
