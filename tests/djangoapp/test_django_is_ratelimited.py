"""`is_ratelimited` / `ais_ratelimited` take the middleware's way: the settings' guard, shared
with the middleware (its breaker, the deadline under ASGI, on_backend_error with "memory"
and callables, shadow mode, metrics), and only ask unless told to count, as
django-ratelimit's do."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest
from support import Recorder, failing_backend
from support.django_site import Site, configure

import ratelimit_mw as rl
from ratelimit_mw import keys
from ratelimit_mw.django import ais_ratelimited, exempt, is_ratelimited
from ratelimit_mw.http.breaker import TIMEOUTS
from ratelimit_mw.metrics import BACKEND_ERROR, BREAKER_OPEN

configure()

from django.http import HttpResponse  # noqa: E402
from django.test import RequestFactory  # noqa: E402
from django.urls import path  # noqa: E402


def asking(mode: str, rates: str = "2/minute", **options: Any) -> Any:
    """An exempt view (the middleware counts nothing) answering what (a)is_ratelimited said;
    ``?count=1`` counts (increment=True), else ``increment`` is left to its default."""
    name = uuid.uuid4().hex[:8]

    def counting(request: Any) -> dict[str, bool]:
        return {"increment": True} if "count" in request.GET else {}

    @exempt
    def view(request: Any) -> HttpResponse:
        limited = is_ratelimited(request, rates, name=name, **counting(request), **options)
        return HttpResponse(b"limited" if limited else b"ok")

    @exempt
    async def aview(request: Any) -> HttpResponse:
        limited = await ais_ratelimited(request, rates, name=name, **counting(request),
                                        **options)
        return HttpResponse(b"limited" if limited else b"ok")

    return aview if mode == "asgi" else view


def bodies(site: Site, count: int, where: str = "/v") -> list[bytes]:
    return [site.request("GET", where).content for _ in range(count)]


def test_by_default_it_only_asks_as_django_ratelimit_does(open_site: Any, mode: str) -> None:
    site = open_site([path("v", asking(mode))])
    assert bodies(site, 3) == [b"ok"] * 3           # a migrated peek: nothing counted
    assert bodies(site, 3, "/v?count=1") == [b"ok", b"ok", b"limited"]
    assert bodies(site, 1) == [b"limited"]           # a hit now would be refused


def test_a_hung_store_costs_the_deadline_then_the_breaker_skips_it() -> None:
    hung = failing_backend("hang")
    recorder = Recorder()
    site = Site([path("v", asking("asgi")), path("c", asking("asgi"))], {
        "async_limiter": rl.AsyncLimiter(hung, metrics=recorder),  # type: ignore[arg-type]
        "backend_timeout": 0.2}, asynchronous=True)
    try:
        started = time.perf_counter()
        # The bound only keeps a regression from hanging the suite: the store never answers.
        first = site.run(asyncio.wait_for(site.client.get("/v"), 10))
        took = time.perf_counter() - started
        assert first.content == b"ok"                 # on_backend_error="allow"
        assert hung.calls == 1
        assert took < 0.2 + 1.0                       # the deadline, not the store's hang
        # Each later timeout comes a deadline after the last: TIMEOUTS in a row open it.
        for _ in range(TIMEOUTS - 1):
            assert site.run(asyncio.wait_for(site.client.get("/v"), 10)).content == b"ok"
        assert hung.calls == TIMEOUTS
        # Counting or asking: the breaker is open, the store is not called again.
        assert site.run(asyncio.wait_for(site.client.get("/c?count=1"), 10)).content == b"ok"
        assert hung.calls == TIMEOUTS
    finally:
        site.close()
    assert [event for event, _, _ in recorder.events] == [BACKEND_ERROR] * TIMEOUTS + [
        BREAKER_OPEN]


@pytest.mark.parametrize(("policy", "answers"), [
    ("deny", [b"limited"] * 3),
    ("memory", [b"ok", b"ok", b"limited"]),            # counted in this process's memory
    (lambda request, error: request.GET.get("count") != "1", [b"limited"] * 3),
])
def test_a_down_store_applies_on_backend_error(open_site: Any, mode: str, policy: Any,
                                               answers: list[bytes]) -> None:
    down = failing_backend("down")
    limiter = (rl.AsyncLimiter(down) if mode == "asgi"  # type: ignore[arg-type]
               else rl.Limiter(down))  # type: ignore[arg-type]
    site = open_site([path("v", asking(mode))], on_backend_error=policy,
                     **{"async_limiter" if mode == "asgi" else "limiter": limiter})
    assert bodies(site, 3, "/v?count=1") == answers
    assert down.calls == 1  # then the breaker skipped the store


def test_asking_a_memory_stand_in_counts_nothing(open_site: Any, mode: str) -> None:
    down = failing_backend("down")
    limiter = (rl.AsyncLimiter(down) if mode == "asgi"  # type: ignore[arg-type]
               else rl.Limiter(down))  # type: ignore[arg-type]
    site = open_site([path("v", asking(mode))], on_backend_error="memory",
                     **{"async_limiter" if mode == "asgi" else "limiter": limiter})
    assert bodies(site, 4) == [b"ok"] * 4            # asked, in memory: nothing counted
    assert bodies(site, 3, "/v?count=1") == [b"ok", b"ok", b"limited"]
    assert bodies(site, 1) == [b"limited"]


def test_the_middleware_and_is_ratelimited_share_one_breaker(open_site: Any,
                                                             mode: str) -> None:
    down = failing_backend("down")
    limiter = (rl.AsyncLimiter(down) if mode == "asgi"  # type: ignore[arg-type]
               else rl.Limiter(down))  # type: ignore[arg-type]

    def plain(request: Any) -> HttpResponse:
        return HttpResponse(b"ok")

    site = open_site([path("plain", plain), path("v", asking(mode))], default="100/minute",
                     **{"async_limiter" if mode == "asgi" else "limiter": limiter})
    assert site.request("GET", "/plain").status_code == 200  # the middleware meets the outage
    assert down.calls == 1
    assert bodies(site, 1, "/v?count=1") == [b"ok"]
    assert down.calls == 1  # is_ratelimited knew: the breaker the middleware opened


def test_shadow_mode_never_says_limited_and_leaves_the_refusal_on_the_request(
        open_site: Any, mode: str) -> None:
    name = uuid.uuid4().hex[:8]

    @exempt
    def view(request: Any) -> HttpResponse:
        limited = is_ratelimited(request, "1/minute", name=name, increment=True)
        return HttpResponse(f"{limited} {request.ratelimit.allowed}".encode())

    @exempt
    async def aview(request: Any) -> HttpResponse:
        limited = await ais_ratelimited(request, "1/minute", name=name, increment=True)
        return HttpResponse(f"{limited} {request.ratelimit.allowed}".encode())

    site = open_site([path("v", aview if mode == "asgi" else view)], mode="shadow")
    assert bodies(site, 2) == [b"False True", b"False False"]


def test_with_enabled_off_nothing_is_limited_or_counted(open_site: Any, mode: str) -> None:
    site = open_site([path("v", asking(mode, "1/minute"))], enabled=False)
    assert bodies(site, 3, "/v?count=1") == [b"ok"] * 3


def test_the_default_key_is_the_settings_key_as_for_a_decorator(open_site: Any,
                                                                mode: str) -> None:
    site = open_site([path("v", asking(mode, "1/minute"))], key=keys.header("X-Client"))
    counted = [site.request("GET", "/v?count=1", {"X-Client": client}).content
               for client in ("a", "a", "b")]
    assert counted == [b"ok", b"limited", b"ok"]  # per header, not per (shared) address


def test_sync_is_ratelimited_refuses_an_async_key_and_a_dotted_rate() -> None:
    async def key(request: Any) -> str:
        return "k"

    request = RequestFactory().get("/")
    with pytest.raises(rl.ConfigurationError, match="is_ratelimited cannot await"):
        is_ratelimited(request, "1/minute", key=key)
    with pytest.raises(rl.ConfigurationError, match="dotted path"):
        is_ratelimited(request, "myapp.rates.login")
