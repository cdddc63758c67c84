"""What only Django has: settings and system checks, function and class-based views, its
request in key functions, `is_ratelimited`, and ASGI Django staying async end to end.

Every behaviour the adapters share is in tests/conformance (Django under WSGI and ASGI is two
of its adapters); the real servers are in tests/reliability/test_django_servers.py.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import uuid
from typing import Any

import pytest
from support.django_site import MIDDLEWARE, Site, configure

import ratelimit_mw as rl
from ratelimit_mw import keys
from ratelimit_mw.django import ais_ratelimited, exempt, is_ratelimited, limit, user_or_ip

configure()

from django.core.exceptions import ImproperlyConfigured  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.core.management.base import SystemCheckError  # noqa: E402
from django.http import HttpResponse  # noqa: E402
from django.test.utils import override_settings  # noqa: E402
from django.urls import path  # noqa: E402
from django.utils.decorators import method_decorator  # noqa: E402
from django.views import View  # noqa: E402

_views = itertools.count()


def fresh() -> Any:
    """A view of its own: decorators mark the function they decorate, and a decorator's
    counter is named after the function's qualified name."""
    def ok(request: Any, **kwargs: Any) -> HttpResponse:
        return HttpResponse(b"ok")

    ok.__qualname__ = f"view{next(_views)}"
    return ok


def statuses(site: Site, count: int, path: str, method: str = "GET", **headers: str) -> list[int]:
    return [site.request(method, path, headers).status_code for _ in range(count)]


# -- settings and system checks ---------------------------------------------------------------
def test_a_misspelt_option_fails_manage_py_check_with_what_to_write() -> None:
    with (override_settings(RATELIMIT={"defualt": "5/minute"}),
          pytest.raises(SystemCheckError, match=r"ratelimit_mw\.E001") as raised):
        call_command("check")
    assert "did you mean 'default'?" in str(raised.value)


@pytest.mark.parametrize(("ratelimit", "says"), [
    ({"backend": "redis://127.0.0.1:notaport/0"}, "port"),
    ({"default": "5 per fortnight"}, "fortnight"),
    ({"prefix": "has space"}, "prefix"),
    ({"limiter": rl.AsyncLimiter()}, "async_limiter"),
    ([("default", "5/minute")], "must be a dict"),
])
def test_every_mistake_is_a_check_error_and_stops_the_middleware(ratelimit: Any,
                                                                 says: str) -> None:
    with override_settings(RATELIMIT=ratelimit):
        with pytest.raises(SystemCheckError, match=says):
            call_command("check")
        site = Site([path("", fresh())], ratelimit)  # type: ignore[arg-type]
        try:
            with pytest.raises(ImproperlyConfigured, match=says):
                site.request("GET", "/")
        finally:
            site.close()


def test_an_installed_app_without_its_middleware_is_a_check_warning(capsys: Any) -> None:
    with override_settings(MIDDLEWARE=[], RATELIMIT={"default": "5/minute"}):
        call_command("check")
    assert "ratelimit_mw.W001" in capsys.readouterr().err


def test_a_correct_configuration_passes_the_checks(capsys: Any) -> None:
    with override_settings(RATELIMIT={"default": "5/minute", "backend": "redis://127.0.0.1"},
                           MIDDLEWARE=MIDDLEWARE):
        call_command("check")
    assert "ratelimit_mw" not in capsys.readouterr().err


def test_wsgi_django_refuses_an_async_key_at_start_up() -> None:
    async def key(request: Any) -> str:
        return "k"

    site = Site([path("", fresh())], {"default": "5/minute", "key": key})
    try:
        with pytest.raises(ImproperlyConfigured, match="Django under WSGI"):
            site.request("GET", "/")
    finally:
        site.close()


# -- ASGI Django stays async ------------------------------------------------------------------
def test_asgi_django_decides_on_the_event_loop_and_awaits_async_hooks() -> None:
    seen: list[tuple[int, bool]] = []

    def on_loop() -> bool:
        try:
            asyncio.get_running_loop()
            return True
        except RuntimeError:  # a worker thread (sync_to_async) has no running loop
            return False

    def sync_key(request: Any) -> str:
        seen.append((threading.get_ident(), on_loop()))
        return "sync"

    async def async_cost(request: Any) -> int:
        await asyncio.sleep(0)
        return 2

    async def view(request: Any) -> HttpResponse:
        return HttpResponse(b"ok")

    site = Site([path("a", limit("4/minute", key=sync_key, cost=async_cost)(view))],
                {}, asynchronous=True)
    try:
        assert [site.request("GET", "/a").status_code for _ in range(3)] == [200, 200, 429]
    finally:
        site.close()
    assert seen == [(threading.get_ident(), True)] * 3


# -- views ------------------------------------------------------------------------------------
def test_function_views_limit_exempt_and_fall_under_the_default(open_site: Any) -> None:
    site = open_site([path("limited", limit("2/minute")(fresh())), path("exempt", exempt(fresh())),
                      path("plain", fresh())], default="1/minute")
    assert statuses(site, 3, "/limited") == [200, 200, 429]
    assert statuses(site, 3, "/exempt") == [200, 200, 200]
    assert statuses(site, 2, "/plain") == [200, 429]
    refused = site.request("GET", "/limited")
    assert refused.headers["Retry-After"] == "60"
    assert refused.headers["Content-Type"] == "application/json"
    assert refused.json() == {"detail": "Too Many Requests", "retry_after": 60}


def test_a_request_that_reaches_no_view_is_limited_by_the_default(open_site: Any) -> None:
    site = open_site([path("here", fresh())], default="2/minute")
    assert statuses(site, 3, "/nowhere") == [404, 404, 429]


class Limited(View):
    def get(self, request: Any) -> HttpResponse:
        return HttpResponse(b"ok")

    def post(self, request: Any) -> HttpResponse:
        return HttpResponse(b"ok")


def test_class_based_views_on_the_class_and_through_method_decorator(open_site: Any) -> None:
    on_class = limit("2/minute")(type("OnClass", (Limited,), {}))
    first = method_decorator(limit("2/minute"), name="dispatch")(type("First", (Limited,), {}))
    second = method_decorator(limit("2/minute"), name="dispatch")(type("Second", (Limited,), {}))
    posts = method_decorator(limit("1/minute"), name="post")(type("Posts", (Limited,), {}))
    in_urls = limit("1/minute")(type("InUrls", (Limited,), {}).as_view())
    site = open_site([path("class", on_class.as_view()), path("first", first.as_view()),
                      path("second", second.as_view()), path("posts", posts.as_view()),
                      path("in-urls", in_urls)], default="5/minute")
    assert statuses(site, 3, "/class") == [200, 200, 429]
    assert statuses(site, 3, "/first") == [200, 200, 429]
    # method_decorator's throw-away function is shared by every use: each view still counts
    # apart, named after its class and method.
    assert statuses(site, 3, "/second") == [200, 200, 429]
    assert statuses(site, 2, "/posts", "POST") == [200, 429]
    # GET has no decorator on Posts: the default applies to it.
    assert statuses(site, 6, "/posts") == [200] * 5 + [429]
    assert statuses(site, 2, "/in-urls") == [200, 429]


def test_a_method_the_view_has_no_handler_for_counts_under_the_default(open_site: Any) -> None:
    get_only = limit("1/minute")(type("GetOnly", (View,), {"get": Limited.get}))
    site = open_site([path("get-only", get_only.as_view())], default="2/minute",
                     charge_method_not_allowed=True)
    assert statuses(site, 3, "/get-only", "DELETE") == [405, 405, 429]


class Purge(View):
    """An extension method with a handler: PURGE; PROPFIND has none (Django answers 405)."""

    http_method_names = (*View.http_method_names, "purge")

    def purge(self, request: Any) -> HttpResponse:
        return HttpResponse(b"purged")


@pytest.mark.parametrize("first", ["PROPFIND", "PURGE"])
def test_an_invented_method_never_changes_the_limits_of_the_views_own_methods(
        open_site: Any, first: str) -> None:
    # Whichever method comes first, PURGE gets the class's limit and PROPFIND the default.
    purge = limit("5/minute")(type("PurgeFirst" + first, (Purge,), {}))
    site = open_site([path("purge", purge.as_view())], default="100/minute")
    if first == "PURGE":
        assert statuses(site, 1, "/purge", "PURGE") == [200]
    assert statuses(site, 1, "/purge", "PROPFIND") == [405]
    done = 1 if first == "PURGE" else 0
    assert statuses(site, 20 - done, "/purge", "PURGE") == [200] * (5 - done) + [429] * 15
    propfind = site.request("PROPFIND", "/purge")
    assert propfind.status_code == 405
    assert propfind.headers["RateLimit-Policy"].endswith(";q=100;w=60")  # the default


def test_the_view_cache_stays_bounded_whatever_methods_clients_invent() -> None:
    from django.test import RequestFactory

    from ratelimit_mw.django.middleware import RateLimitMiddleware

    purge = limit("5/minute")(type("PurgeBounded", (Purge,), {})).as_view()
    with override_settings(RATELIMIT={"default": "100/minute"}):
        middleware = RateLimitMiddleware(lambda request: HttpResponse())
        factory = RequestFactory()
        for n in range(2000):
            middleware._selection(factory.generic(f"INVENTED{n}", "/purge"), purge)
        found = middleware._selection(factory.generic("PURGE", "/purge"), purge)
    # The invented methods share one entry; PURGE, which the class handles, has its own.
    assert len(middleware._views) == 2
    assert found is not None and found.applied[0].policy.rates[0].limit == 5


# -- keys -------------------------------------------------------------------------------------
def test_the_route_key_is_the_url_pattern_not_the_path(open_site: Any) -> None:
    site = open_site([path("items/<int:pk>", limit("2/minute", key=keys.route())(fresh()))])
    assert [site.request("GET", f"/items/{n}").status_code for n in (1, 2, 3)] == [200, 200,
                                                                                  429]


def test_the_user_key_reads_request_user_and_user_or_ip_falls_back(open_site: Any) -> None:
    site = open_site([path("u", limit("1/minute", key=keys.user())(fresh())),
                      path("either", limit("1/minute", key=user_or_ip())(fresh()))],
                     default="100/minute")
    assert statuses(site, 2, "/u", **{"X-Test-User": "7"}) == [200, 429]
    assert statuses(site, 1, "/u", **{"X-Test-User": "8"}) == [200]
    # Anonymous: keys.user() says None, so the route falls back to the default...
    assert statuses(site, 3, "/u") == [200, 200, 200]
    # ...while user_or_ip counts the anonymous client by its address.
    assert statuses(site, 2, "/either") == [200, 429]
    assert statuses(site, 1, "/either", **{"X-Test-User": "7"}) == [200]


def test_a_lazily_loaded_user_is_read_under_asgi_too(open_site: Any, mode: str) -> None:
    # django.contrib.auth's request.user cannot load on the event loop: the middleware loads
    # it with request.auser() first, and ais_ratelimited too.
    lazy = {"X-Test-Lazy": "1", "X-Test-User": "7"}
    name = uuid.uuid4().hex[:8]

    async def aview(request: Any) -> HttpResponse:
        limited = await ais_ratelimited(request, "1/minute", key=keys.user(), name=name,
                                        increment=True)
        return HttpResponse(b"limited" if limited else b"ok")

    def view(request: Any) -> HttpResponse:
        limited = is_ratelimited(request, "1/minute", key=keys.user(), name=name,
                                 increment=True)
        return HttpResponse(b"limited" if limited else b"ok")

    site = open_site([path("u", limit("1/minute", key=keys.user())(fresh())),
                      path("v", aview if mode == "asgi" else view)], default="100/minute")
    assert statuses(site, 2, "/u", **lazy) == [200, 429]
    assert statuses(site, 1, "/u", **{**lazy, "X-Test-User": "8"}) == [200]
    assert [site.request("GET", "/v", lazy).content for _ in range(2)] == [b"ok", b"limited"]


def test_class_based_views_add_up_the_limits_of_the_class_dispatch_and_handler(
        open_site: Any) -> None:
    both = method_decorator(limit("100/hour"), name="dispatch")(
        method_decorator(limit("2/minute"), name="post")(type("Both", (Limited,), {})))
    on_class = limit("100/hour")(
        method_decorator(limit("1/minute"), name="post")(type("OnClass2", (Limited,), {})))
    site = open_site([path("both", both.as_view()), path("class", on_class.as_view())])
    assert statuses(site, 3, "/both", "POST") == [200, 200, 429]
    assert statuses(site, 2, "/class", "POST") == [200, 429]
    assert statuses(site, 3, "/class") == [200, 200, 200]  # GET: the class's 100/hour


def test_client_ip_walks_forwarded_headers_from_trusted_proxies_only(open_site: Any) -> None:
    trusted = keys.client_ip(trusted_proxies=["127.0.0.1/32"])
    site = open_site([path("t", limit("1/minute", key=trusted)(fresh())),
                      path("u", limit("1/minute")(fresh()))])
    forwarded = {"X-Forwarded-For": "203.0.113.9"}
    assert statuses(site, 2, "/t", **forwarded) == [200, 429]
    assert statuses(site, 1, "/t", **{"X-Forwarded-For": "203.0.113.10"}) == [200]
    # Without trusted proxies the header is the client's to write: ignored.
    assert statuses(site, 2, "/u", **forwarded) == [200, 429]
    assert statuses(site, 1, "/u", **{"X-Forwarded-For": "203.0.113.10"}) == [429]


# -- is_ratelimited ---------------------------------------------------------------------------
def test_is_ratelimited_counts_peeks_and_names_its_counter(open_site: Any, mode: str) -> None:
    name = uuid.uuid4().hex[:8]

    def view(request: Any) -> HttpResponse:
        limited = is_ratelimited(request, "2/minute", name=name,
                                 increment=request.GET.get("peek") is None)
        return HttpResponse(b"limited" if limited else b"ok")

    async def aview(request: Any) -> HttpResponse:
        limited = await ais_ratelimited(request, "2/minute", name=name,
                                        increment=request.GET.get("peek") is None)
        return HttpResponse(b"limited" if limited else b"ok")

    site = open_site([path("v", aview if mode == "asgi" else view)])
    bodies = [site.request("GET", "/v").content for _ in range(3)]
    assert bodies == [b"ok", b"ok", b"limited"]
    assert site.request("GET", "/v?peek=1").content == b"limited"


def test_is_ratelimited_applies_the_failure_policy_when_the_store_fails() -> None:
    from support import failing_backend

    def view(request: Any) -> HttpResponse:
        return HttpResponse(b"limited" if is_ratelimited(request, "2/minute") else b"ok")

    for policy, answer in (("allow", b"ok"), ("deny", b"limited")):
        site = Site([path("v", view)], {
            "on_backend_error": policy,
            "limiter": rl.Limiter(failing_backend(rl.BackendError("down")))})  # type: ignore[arg-type]
        try:
            assert site.request("GET", "/v").content == answer
        finally:
            site.close()
