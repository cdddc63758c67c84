"""docs/django.md's table "Coming from django-ratelimit", row by row: what the ratelimit_mw
column does, including where it differs from django-ratelimit."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis
from support import REDIS_URL, MonotonicClock
from support.django_site import Site, configure

import ratelimit_mw as rl
from ratelimit_mw import ConfigurationError, Policy, keys
from ratelimit_mw.django import form_field, is_ratelimited, limit, query_param, user_or_ip

configure()

from django.core.management import call_command  # noqa: E402
from django.http import HttpResponse, HttpResponseForbidden  # noqa: E402
from django.test.utils import override_settings  # noqa: E402
from django.urls import path  # noqa: E402
from django.utils.decorators import method_decorator  # noqa: E402
from django.views import View  # noqa: E402
from support.django_site import fresh_view as fresh  # noqa: E402


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
        limited = is_ratelimited(request, "1/minute", name=name, increment=True)
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


def test_is_ratelimited_asks_by_default_and_says_limited_when_a_hit_would_be_refused(
        site: Any) -> None:
    name = uuid.uuid4().hex[:8]

    def view(request: Any) -> HttpResponse:
        counted = "count" in request.GET
        limited = (is_ratelimited(request, "2/minute", name=name, increment=True) if counted
                   else is_ratelimited(request, "2/minute", name=name))
        return HttpResponse(str(limited))

    made = site([path("v", view)])
    # django-ratelimit's default: increment=False, a migrated call never counts.
    assert [made.request("GET", "/v").content for _ in range(3)] == [b"False"] * 3
    assert [made.request("GET", "/v?count=1").content for _ in range(2)] == [b"False"] * 2
    # Two of two counted: asking says limited now (django-ratelimit: only once a third
    # was counted).
    assert made.request("GET", "/v").content == b"True"


def test_key_post_is_form_field(site: Any) -> None:
    made = site([path("v", limit("2/minute", key=form_field("username"))(fresh()))])

    def post(**form: str) -> int:
        return int(made.client.post("/v", form).status_code)

    assert [post(username="ann") for _ in range(3)] == [200, 200, 429]
    assert [post(username="bob"), post(username="ann", other="x")] == [200, 429]


def test_key_get_is_query_param(site: Any) -> None:
    made = site([path("v", limit("1/minute", key=query_param("q"))(fresh()))])
    assert statuses(made, 2, "/v?q=a") == [200, 429]
    assert statuses(made, 1, "/v?q=b") == [200]


def test_an_empty_post_value_gives_way_to_the_default_or_shares_one_bucket(
        site: Any) -> None:
    made = site([path("v", limit("1/minute", key=form_field("username"))(fresh())),
                 path("r", limit("1/minute", key=form_field("username",
                                                          required=True))(fresh()))],
                default="3/minute")

    def post(where: str, **form: str) -> int:
        return int(made.client.post(where, form).status_code)

    # django-ratelimit counts every empty or missing value in one bucket (""): here such a
    # request has no identity under the view's limit, and the default applies.
    assert [post("/v", username=""), post("/v"), post("/v"), post("/v")] == [200] * 3 + [429]
    # required=True: one bucket for all of them, as django-ratelimit.
    assert [post("/r", username=""), post("/r")] == [200, 429]


def login_key(group: str, request: Any) -> str:  # django-ratelimit's (group, request) shape
    return f"{group}:{request.headers.get('X-Account', '')}"


def login_rate(group: str, request: Any) -> str | None:
    return "2/m" if request.headers.get("X-Account") else None  # None: no limit


def test_group_request_callables_are_wrapped_in_a_lambda(site: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"\(group, request\)"):
        limit("1/minute", key=login_key)
    with pytest.raises(ConfigurationError, match=r"\(group, request\)"):
        limit(login_rate)
    made = site([path("v", limit(lambda request: login_rate("login", request),
                                 key=lambda request: login_key("login", request))(fresh()))])
    assert statuses(made, 3, **{"X-Account": "a"}) == [200, 200, 429]
    assert statuses(made, 1, **{"X-Account": "b"}) == [200]
    assert statuses(made, 3) == [200] * 3  # the rate said None: no limit
    # A (count, seconds) tuple is not a rate here: logged, and that limit skipped.
    tupled = site([path("v", limit(lambda request: (1, 60))(fresh()))])  # type: ignore[arg-type,return-value]
    assert statuses(tupled, 3) == [200] * 3


def test_string_keys_and_dotted_path_rates_are_refused_with_what_to_write() -> None:
    with pytest.raises(ConfigurationError, match=r"from tests\.keys import login"):
        limit("1/minute", key="tests.keys.login")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"from tests\.rates import login"):
        limit("tests.rates.login")
    with pytest.raises(ConfigurationError, match=r"keys\.client_ip\(\)"):
        limit("1/minute", key="ip")  # type: ignore[arg-type]


def test_django_ratelimit_settings_are_named_by_the_checks(capsys: Any) -> None:
    with override_settings(RATELIMIT_ENABLE=False):
        call_command("check")
    assert '(ratelimit_mw.W002) RATELIMIT_ENABLE' in (err := capsys.readouterr().err)
    assert 'RATELIMIT = {..., "enabled": False}' in err


class Page(View):
    def get(self, request: Any) -> HttpResponse:
        return HttpResponse(b"ok")


def test_method_decorator_on_dispatch(site: Any) -> None:
    one = method_decorator(limit("2/m"), name="dispatch")(type("One", (Page,), {}))
    two = method_decorator(limit("2/m"), name="dispatch")(type("Two", (Page,), {}))
    made = site([path("one", one.as_view()), path("two", two.as_view())], default="9/minute")
    assert statuses(made, 3, "/one") == [200, 200, 429]
    assert statuses(made, 3, "/two") == [200, 200, 429]    # one counter per class
    # DELETE has no handler: a 405 under the default, not the class's limit.
    assert statuses(made, 1, "/one", "DELETE") == [405]


WINDOW = 1_700_000_040.0  # a minute's start since the epoch


def test_a_burst_at_a_windows_edge_is_not_the_same_count(site: Any) -> None:
    clock = MonotonicClock(WINDOW + 59)
    made = site([path("sliding", limit("5/m")(fresh())),
                 path("fixed", limit(Policy("5/m", algorithm="fixed-window",
                                            name=uuid.uuid4().hex))(fresh()))],
                limiter=rl.Limiter(clock=clock))
    assert statuses(made, 6, "/sliding") == [200] * 5 + [429]
    assert statuses(made, 6, "/fixed") == [200] * 5 + [429]
    clock.advance(1.5)  # the next fixed window: django-ratelimit's count starts again
    assert statuses(made, 6, "/fixed") == [200] * 5 + [429]   # 10 in 1.5 seconds
    assert statuses(made, 1, "/sliding") == [429]              # 5 in any minute
    clock.advance(58.5)  # a minute after the first five
    assert statuses(made, 6, "/sliding") == [200] * 5 + [429]
