"""What django-ratelimit users bring along is never ignored without a word: its settings are a
system check warning (W002) naming what to write instead, and its string keys, its
``(group, request)`` keys and rates and its dotted-path rates are refused where they are
written, with the ratelimit_mw spelling; ``post:`` / ``get:`` keys are `form_field` /
`query_param`."""

from __future__ import annotations

from typing import Any

import pytest
from support.django_site import configure

import ratelimit_mw as rl
from ratelimit_mw.django import form_field, is_ratelimited, limit, query_param

configure()

from django.core.management import call_command  # noqa: E402
from django.core.management.base import SystemCheckError  # noqa: E402
from django.test import RequestFactory  # noqa: E402
from django.test.utils import override_settings  # noqa: E402
from django.urls import path  # noqa: E402
from support.django_site import fresh_view as fresh  # noqa: E402


# -- settings ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "value", "instead"), [
    ("RATELIMIT_ENABLE", False, '"enabled": False'),
    ("RATELIMIT_USE_CACHE", "ratelimit", '"backend": "redis://'),
    ("RATELIMIT_CACHE_PREFIX", "rl:", '"prefix"'),
    ("RATELIMIT_VIEW", "app.views.ratelimited", '"on_blocked": ratelimited'),
    ("RATELIMIT_FAIL_OPEN", False, '"on_backend_error": "deny"'),
    ("RATELIMIT_FAIL_OPEN", True, '"on_backend_error": "allow"'),
    ("RATELIMIT_IP_META_KEY", "HTTP_X_REAL_IP", "keys.client_ip(trusted_proxies=[...])"),
    ("RATELIMIT_IPV4_MASK", 24, "/32"),
    ("RATELIMIT_IPV6_MASK", 48, "keys.client_ip(ipv6_prefix=48)"),
    ("RATELIMIT_HASH_ALGORITHM", "hashlib.sha512", "nothing to write"),
    ("RATELIMIT_EXCEPTION_CLASS", "app.errors.Slow", '"on_blocked"'),
])
def test_each_django_ratelimit_setting_is_named_with_what_to_write(
        capsys: Any, name: str, value: Any, instead: str) -> None:
    with override_settings(**{name: value}):
        call_command("check")
    err = capsys.readouterr().err
    assert f"settings.{name}: (ratelimit_mw.W002) {name} is django-ratelimit's setting" in err
    assert instead in err


def test_without_django_ratelimit_settings_there_is_no_warning(capsys: Any) -> None:
    call_command("check")
    assert "W002" not in capsys.readouterr().err


# -- keys and rates ---------------------------------------------------------------------------
@pytest.mark.parametrize(("key", "instead"), [
    ("ip", "key=keys.client_ip()"),
    ("user", "key=keys.user()"),
    ("user_or_ip", "key=ratelimit_mw.django.user_or_ip()"),
    ("header:x-api-key", 'key=keys.header("x-api-key")'),
    ("post:username", 'key=ratelimit_mw.django.form_field("username")'),
    ("get:q", 'key=ratelimit_mw.django.query_param("q")'),
    ("myapp.keys.client", "from myapp.keys import client"),
])
def test_a_string_key_is_refused_with_its_spelling_here(key: str, instead: str) -> None:
    with pytest.raises(rl.ConfigurationError, match="django-ratelimit") as raised:
        limit("5/minute", key=key)  # type: ignore[arg-type]
    assert instead in str(raised.value)
    with pytest.raises(rl.ConfigurationError, match="django-ratelimit"):
        is_ratelimited(RequestFactory().get("/"), "5/minute", key=key)  # type: ignore[arg-type]


def test_a_string_key_in_the_settings_is_a_check_error() -> None:
    with (override_settings(RATELIMIT={"default": "5/minute", "key": "user_or_ip"}),
          pytest.raises(SystemCheckError, match=r"ratelimit_mw\.E001") as raised):
        call_command("check")
    assert "ratelimit_mw.django.user_or_ip()" in str(raised.value)


def my_key(group: str, request: Any) -> str:  # django-ratelimit's shape
    return f"{group}:{request.META['REMOTE_ADDR']}"


def my_rate(group: str, request: Any) -> str:
    return "5/m"


def test_group_request_callables_are_refused_where_they_are_written() -> None:
    # Accepted, they would fail on every request (logged; the key falls back to the client
    # IP, the rate is skipped).
    with pytest.raises(rl.ConfigurationError, match=r"\(group, request\)") as raised:
        limit("5/minute", key=my_key)
    assert "key=lambda request: my_key(GROUP, request)" in str(raised.value)
    with pytest.raises(rl.ConfigurationError, match=r"\(group, request\)"):
        limit(my_rate)
    with pytest.raises(rl.ConfigurationError, match=r"\(group, request\)"):
        is_ratelimited(RequestFactory().get("/"), "5/minute", key=my_key)
    # One argument, or a second with a default: a key function.
    limit("5/minute", key=lambda request, group="g": group)(fresh())


def test_a_dotted_path_rate_is_refused_with_the_import_to_write() -> None:
    with pytest.raises(rl.ConfigurationError, match="dotted path") as raised:
        limit("myapp.rates.get_rate")
    assert "from myapp.rates import get_rate; limit(get_rate)" in str(raised.value)


# -- post: and get: ---------------------------------------------------------------------------
def test_form_field_counts_per_value_and_an_empty_one_gives_way_to_the_default(
        site: Any) -> None:
    made = site([path("v", limit("1/minute", key=form_field("username"))(fresh())),
                 path("r", limit("1/minute", key=form_field("username", required=True))(
                     fresh()))], default="3/minute")

    def post(where: str, **form: str) -> int:
        return int(made.client.post(where, form).status_code)

    assert [post("/v", username="ann"), post("/v", username="ann"),
            post("/v", username="bob")] == [200, 429, 200]
    # Missing or empty: no identity, the default (3 a minute per client IP) applies.
    assert [post("/v"), post("/v", username=""), post("/v"), post("/v")] == [200] * 3 + [429]
    # required=True: every request without it in one bucket, as django-ratelimit counts.
    assert [post("/r"), post("/r", username="")] == [200, 429]


def test_query_param_counts_per_value(site: Any) -> None:
    made = site([path("v", limit("1/minute", key=query_param("q"))(fresh()))])
    codes = [made.request("GET", f"/v?q={q}").status_code for q in ("a", "a", "b")]
    assert codes == [200, 429, 200]


def test_a_malformed_form_is_no_value_never_an_error() -> None:
    # No boundary: reading request.POST raises MultiPartParserError.
    request = RequestFactory().post("/", data=b"x", content_type="multipart/form-data")
    assert form_field("username")(request) is None
    assert form_field("username", required=True)(request) == "post:username"
    with pytest.raises(rl.ConfigurationError, match='form_field\\("username"\\)'):
        form_field("")
