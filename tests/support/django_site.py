"""A Django site for the tests: settings configured once per test process, URLconfs built
per test, and a client for WSGI and ASGI Django alike.

``Site(urlpatterns, ratelimit=..., asynchronous=...)`` overrides ``ROOT_URLCONF`` and
``RATELIMIT`` while it is open and sends requests through Django's full handler (its
middleware chain as settings.MIDDLEWARE says, sync or async), with the header
``X-Test-User: <pk>`` standing for an authenticated user (`HeaderUser`: no database).
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest

MIDDLEWARE = ["support.django_site.HeaderUser", "ratelimit_mw.django.RateLimitMiddleware"]
_names = itertools.count()


def configure() -> None:
    """Django's settings for the test process (once)."""
    import django
    from django.conf import settings

    if settings.configured:
        return
    settings.configure(
        DEBUG=False,
        SECRET_KEY="ratelimit_mw tests",
        ALLOWED_HOSTS=["*"],
        ROOT_URLCONF="support.django_site",
        INSTALLED_APPS=["ratelimit_mw.django"],
        MIDDLEWARE=MIDDLEWARE,
        DATABASES={},
        USE_TZ=True,
    )
    django.setup()


urlpatterns: list[Any] = []  # ROOT_URLCONF when no Site is open


class _User:
    is_authenticated = True

    def __init__(self, pk: str) -> None:
        self.pk = pk


class _Anonymous:
    is_authenticated = False
    pk = None


class HeaderUser:
    """``request.user`` from ``X-Test-User`` (what django.contrib.auth would set)."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Any) -> None:
        from asgiref.sync import iscoroutinefunction, markcoroutinefunction

        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request: Any) -> Any:
        pk = request.headers.get("X-Test-User")
        user = _User(pk) if pk else _Anonymous()
        if request.headers.get("X-Test-Lazy"):
            # As django.contrib.auth sets it: loaded on first use, from the database, which
            # refuses to run on the event loop; request.auser() loads it there.
            from django.utils.asyncio import async_unsafe
            from django.utils.functional import SimpleLazyObject

            request.user = SimpleLazyObject(async_unsafe(lambda: user))

            async def auser() -> Any:
                return user

            request.auser = auser
        else:
            request.user = user
        return self.get_response(request)


class Site:
    """A URLconf and RATELIMIT in force, and a client sending requests through them."""

    def __init__(self, patterns: list[Any], ratelimit: dict[str, Any], *,
                 asynchronous: bool = False, middleware: list[str] | None = None) -> None:
        configure()
        from django.test import AsyncClient, Client
        from django.test.utils import override_settings

        self.module = types.ModuleType(f"ratelimit_mw_test_urls_{next(_names)}")
        self.module.urlpatterns = patterns  # type: ignore[attr-defined]
        sys.modules[self.module.__name__] = self.module
        self._override = override_settings(ROOT_URLCONF=self.module.__name__,
                                           RATELIMIT=ratelimit,
                                           MIDDLEWARE=middleware or MIDDLEWARE)
        self._override.enable()
        self.asynchronous = asynchronous
        self.loop = asyncio.new_event_loop() if asynchronous else None
        self.client: Any = AsyncClient() if asynchronous else Client()

    def request(self, method: str, path: str, headers: dict[str, str] | None = None,
                **extra: Any) -> Any:
        """The response (Django's test response: status_code, headers, content)."""
        call = self.client.generic(method, path, headers=headers or {}, **extra)
        if self.loop is not None:
            return self.loop.run_until_complete(call)
        return call

    def run(self, coroutine: Any) -> Any:
        """Run `coroutine` on the site's loop (an async limiter's calls belong to it)."""
        assert self.loop is not None
        return self.loop.run_until_complete(coroutine)

    def close(self) -> None:
        from django.urls import clear_url_caches

        self._override.disable()
        clear_url_caches()
        sys.modules.pop(self.module.__name__, None)
        if self.loop is not None:
            self.loop.close()


_views = itertools.count()


def fresh_view() -> Callable[[Any], Any]:
    """A view answering "ok", named apart from every other (its own counter)."""
    from django.http import HttpResponse

    def ok(request: Any) -> HttpResponse:
        return HttpResponse(b"ok")

    ok.__qualname__ = f"fresh{next(_views)}"
    return ok


# -- fixtures (imported by the Django test modules) ------------------------------------------
def _sites(asynchronous: bool) -> Iterator[Callable[..., Site]]:
    opened: list[Site] = []

    def make(patterns: list[Any], **ratelimit: Any) -> Site:
        made = Site(patterns, ratelimit, asynchronous=asynchronous)
        opened.append(made)
        return made

    yield make
    for made in reversed(opened):  # overrides nest: the last opened closes first
        made.close()


@pytest.fixture(params=["wsgi", "asgi"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def open_site(mode: str) -> Iterator[Callable[..., Site]]:
    """`open_site(patterns, **ratelimit)`: a Site under the test's mode, closed after it."""
    yield from _sites(mode == "asgi")


@pytest.fixture
def site() -> Iterator[Callable[..., Site]]:
    """`site(patterns, **ratelimit)`: a WSGI Site, closed after the test."""
    yield from _sites(False)
