"""docs/django.md's table "Coming from django-ratelimit", row by row: what the ratelimit_mw
column does, including where it differs from django-ratelimit."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from support import REDIS_URL
from support.django_site import Site, configure

from ratelimit_mw import keys
from ratelimit_mw.django import is_ratelimited, limit, user_or_ip

configure()

from django.http import HttpResponse, HttpResponseForbidden  # noqa: E402
from django.urls import path  # noqa: E402

_views = itertools.count()


def fresh() -> Any:
    def ok(request: Any) -> HttpResponse:
        return HttpResponse(b"ok")

    ok.__qualname__ = f"migrated{next(_views)}"
    return ok


@pytest.fixture
def site() -> Iterator[Any]:
    opened: list[Site] = []

    def make(patterns: list[Any], **ratelimit: Any) -> Site:
        made = Site(patterns, ratelimit)
        opened.append(made)
        return made

    yield make
    for made in opened:
        made.close()


def statuses(made: Site, count: int, where: str = "/v", method: str = "GET",
             **headers: str) -> list[int]:
    return [made.request(method, where, headers).status_code for _ in range(count)]


def test_key_ip_rate_5_per_m(site: Any) -> None:
    made = site([path("v", limit("5/m")(fresh()))])
    assert statuses(made, 6) == [200] * 5 + [429]
    assert statuses(made, 1, REMOTE_ADDR="203.0.113.7") == [429]  # header, not the peer
    other = made.request("GET", "/v", REMOTE_ADDR="203.0.113.7")
    assert other.status_code == 200


def test_key_user_or_ip(site: Any) -> None:
    made = site([path("v", limit("1/minute", key=user_or_ip())(fresh()))])
    assert statuses(made, 2) == [200, 429]                     # anonymous: by address
    assert statuses(made, 2, **{"X-Test-User": "5"}) == [200, 429]  # signed in: by user


def test_key_user_gives_way_to_the_default_for_anonymous_users(site: Any) -> None:
    made = site([path("v", limit("1/minute", key=keys.user())(fresh()))],
                default="3/minute")
    assert statuses(made, 4) == [200, 200, 200, 429]
    assert statuses(made, 2, **{"X-Test-User": "5"}) == [200, 429]


def test_key_header_without_the_header(site: Any) -> None:
    made = site([path("v", limit("1/minute", key=keys.header("X-Api-Key"))(fresh())),
                 path("r", limit("1/minute", key=keys.header("X-Api-Key",
                                                           required=True))(fresh()))],
                default="100/minute")
    assert statuses(made, 3) == [200] * 3          # no header: the default applies
    assert statuses(made, 2, "/r") == [200, 429]   # required=True: one shared bucket
    assert statuses(made, 2, **{"X-Api-Key": "k1"}) == [200, 429]


def test_group_is_name_one_counter_for_every_view_that_names_it(site: Any) -> None:
    made = site([path("a", limit("2/minute", name="login")(fresh())),
                 path("b", limit("2/minute", name="login")(fresh()))])
    assert [statuses(made, 1, p)[0] for p in ("/a", "/b", "/a", "/b")] == [200, 200, 429, 429]


def test_method_is_methods(site: Any) -> None:
    unsafe = ["POST", "PUT", "PATCH", "DELETE"]
    made = site([path("v", limit("1/minute", methods=["POST"])(fresh())),
                 path("u", limit("1/minute", methods=unsafe)(fresh()))])
    assert statuses(made, 3) == [200] * 3
    assert statuses(made, 2, "/v", "POST") == [200, 429]
    assert statuses(made, 1, "/u", "PUT") + statuses(made, 1, "/u", "DELETE") == [200, 429]


def test_block_answers_429_and_on_blocked_keeps_a_403(site: Any) -> None:
    made = site([path("v", limit("1/minute")(fresh()))])
    assert statuses(made, 2) == [200, 429]
    kept = site([path("v", limit("1/minute")(fresh()))],
                on_blocked=lambda request, decision: HttpResponseForbidden())
    kept.request("GET", "/v")
    refused = kept.request("GET", "/v")
    assert refused.status_code == 403
    assert refused.headers["Retry-After"] == "60"


def test_block_false_and_request_limited_is_is_ratelimited_in_the_view(site: Any) -> None:
    name = uuid.uuid4().hex[:8]

    def view(request: Any) -> HttpResponse:
        limited = is_ratelimited(request, "1/minute", name=name)
        return HttpResponse(f"{limited} {request.ratelimit.remaining}")

    made = site([path("v", view)])
    assert [made.request("GET", "/v").content for _ in range(2)] == [b"False 0", b"True 0"]


def test_is_ratelimited_with_increment_false_only_asks(site: Any) -> None:
    name = uuid.uuid4().hex[:8]

    def view(request: Any) -> HttpResponse:
        limited = is_ratelimited(request, "1/minute", name=name, key=lambda r: "k",
                                 increment=False)
        return HttpResponse(str(limited))

    made = site([path("v", view)])
    assert [made.request("GET", "/v").content for _ in range(3)] == [b"False"] * 3


def test_ratelimit_view_is_on_blocked_with_the_decision(site: Any) -> None:
    def ratelimited(request: Any, decision: Any) -> HttpResponse:
        return HttpResponse(f"wait {decision.retry_after:.0f}s", status=429)

    made = site([path("v", limit("1/minute")(fresh()))], on_blocked=ratelimited)
    made.request("GET", "/v")
    assert made.request("GET", "/v").content == b"wait 60s"


def test_use_cache_is_a_backend_url_counting_in_redis(site: Any) -> None:
    prefix = "djm" + uuid.uuid4().hex[:8]
    made = site([path("v", limit("1/minute")(fresh()))], backend=REDIS_URL, prefix=prefix)
    assert statuses(made, 2) == [200, 429]
    client = redis.Redis.from_url(REDIS_URL)
    stored = list(client.scan_iter(f"{prefix}:*"))
    assert stored
    client.delete(*stored)
    client.close()


def test_ip_meta_key_is_named_proxies_walked_from_the_right(site: Any) -> None:
    key = keys.client_ip(trusted_proxies=["127.0.0.1/32"])
    made = site([path("v", limit("1/minute", key=key)(fresh()))])
    spoofed = {"X-Forwarded-For": "198.51.100.1, 203.0.113.9"}
    assert statuses(made, 2, **spoofed) == [200, 429]
    # Another left-most address the client wrote: still 203.0.113.9, still refused.
    assert statuses(made, 1, **{"X-Forwarded-For": "198.51.100.2, 203.0.113.9"}) == [429]
