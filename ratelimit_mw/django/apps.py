"""``"ratelimit_mw.django"`` in ``INSTALLED_APPS``: registers the system checks."""

from __future__ import annotations

from django.apps import AppConfig


class RateLimitConfig(AppConfig):
    name = "ratelimit_mw.django"
    label = "ratelimit_mw"
    verbose_name = "ratelimit_mw"

    def ready(self) -> None:
        from ratelimit_mw.django import checks  # noqa: F401 - registers them
