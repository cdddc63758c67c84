"""Every HTTP behaviour of the middleware, stated once, for ASGI, FastAPI, WSGI, Flask,
Django (under WSGI and ASGI) and Litestar.

Each test runs fourteen times: seven adapters (the `driver` fixture) on the memory backend and on
the real Redis. See conftest.py for the standard app the driver builds.
"""

from __future__ import annotations

import json
import logging
import re

import pytest
from support import failing_backend
from support.driver import Driver

import ratelimit_mw as rl
from ratelimit_mw import keys
from ratelimit_mw.http.config import Config, Rule


def _item_names(header: str) -> list[str]:
    return re.findall(r'"([^"]*)"', header)


# -- refusal -------------------------------------------------------------------------------
def test_over_the_limit_answers_429_with_retry_after_and_the_rate_limit_headers(
        driver: Driver) -> None:
    driver.build(Config(default="3/minute"))
    admitted = [driver.request() for _ in range(3)]
    refused = driver.request()

    assert [r.status for r in admitted] == [200, 200, 200]
    assert admitted[0].headers["ratelimit-policy"] == '"minute";q=3;w=60'
    assert [r.headers["ratelimit"] for r in admitted][-1].startswith('"minute";r=0;t=')
    assert "retry-after" not in admitted[0].headers
    assert refused.status == 429
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert refused.headers["ratelimit"] == f'"minute";r=0;t={refused.headers["retry-after"]}'
    assert refused.headers["cache-control"] == "no-store"
    assert json.loads(refused.body)["retry_after"] == int(refused.headers["retry-after"])


def test_retry_after_comes_from_the_refusing_tier(driver: Driver) -> None:
    driver.build(Config(default="1/second;2/minute"))
    assert driver.request().status == 200
    driver.clock.advance(1.5)
    assert driver.request().status == 200
    driver.clock.advance(1.5)
    refused = driver.request()  # the second tier refuses, not the first
    assert refused.status == 429
    assert int(refused.headers["retry-after"]) >= 50
    assert refused.headers["ratelimit"].startswith('"minute";r=0')


def test_headers_false_keeps_admitted_responses_clean_but_not_refusals(driver: Driver) -> None:
    driver.build(Config(default="1/minute", headers=False))
    assert "ratelimit" not in driver.request().headers
    assert "ratelimit" in driver.request().headers


def test_legacy_headers(driver: Driver) -> None:
    driver.build(Config(default="2/minute", legacy_headers=True))
    headers = driver.request().headers
    assert (headers["x-ratelimit-limit"], headers["x-ratelimit-remaining"]) == ("2", "1")


# -- which limits apply --------------------------------------------------------------------
def test_a_decorated_route_has_its_own_limit_instead_of_the_default(routed: Driver) -> None:
    routed.build(Config(default="5/minute"))
    assert routed.statuses(3, path="/limited") == [200, 200, 429]
    assert routed.statuses(5) == [200] * 5  # the default quota is untouched


def test_an_exempt_route_is_not_limited_by_the_default(routed: Driver) -> None:
    routed.build(Config(default="1/minute"))
    assert routed.statuses(4, path="/exempt") == [200] * 4
    assert "ratelimit" not in routed.request(path="/exempt").headers


def test_rules_add_to_the_default_and_match_their_methods(driver: Driver) -> None:
    driver.build(Config(default="100/minute",
                        rules=[Rule("/login", "2/minute", methods=["POST"])]))
    assert driver.statuses(3, "POST", "/login") == [200, 200, 429]
    assert driver.statuses(3, "GET", "/") == [200] * 3


def test_rules_for_different_methods_never_share_a_counter(driver: Driver) -> None:
    driver.build(Config(rules=[Rule("/items", "100/minute", methods=["GET"]),
                               Rule("/items", "5/minute", methods=["POST"])]))
    assert driver.statuses(5, "GET", "/items") == [200] * 5
    assert driver.statuses(6, "POST", "/items") == [200] * 5 + [429]


def test_head_is_charged_as_get(driver: Driver) -> None:
    driver.build(Config(rules=[Rule("/items", "3/minute", methods=["GET"])]))
    statuses = driver.statuses(20, "HEAD", "/items")
    if not driver.serves_head:  # 405s, given back: HEAD never runs the endpoint
        assert statuses == [405] * 20
        return
    assert statuses == [200] * 3 + [429] * 17
    assert driver.request("GET", "/items").status == 429


def test_head_is_charged_as_get_on_a_decorated_route(routed: Driver) -> None:
    routed.build(Config())
    if not routed.serves_head:
        assert routed.statuses(3, "HEAD", "/limited") == [405] * 3
        return
    assert routed.statuses(3, "HEAD", "/limited") == [200, 200, 429]
    assert routed.request("GET", "/limited").status == 429


def test_cors_preflights_are_not_charged_by_default(driver: Driver) -> None:
    driver.build(Config(default="2/minute"))
    preflight = {"Origin": "https://example.org", "Access-Control-Request-Method": "POST"}
    for _ in range(5):
        assert driver.request("OPTIONS", "/items", preflight).status != 429
    assert driver.statuses(3) == [200, 200, 429]


def test_cors_preflights_are_charged_when_configured(driver: Driver) -> None:
    # The standard app answers preflights 405 (no CORS middleware): charge those too
    # (Litestar answers them itself, 204, and its middleware never sees a 405).
    driver.build(Config(default="2/minute", charge_preflight=True,
                        charge_method_not_allowed=driver.sees_405))
    preflight = {"Origin": "https://example.org", "Access-Control-Request-Method": "POST"}
    driver.request("OPTIONS", "/items", preflight)
    driver.request("OPTIONS", "/items", preflight)
    assert driver.request().status == 429


def test_405_answers_give_their_hit_back(driver: Driver) -> None:
    driver.build(Config(default="2/minute"))
    assert driver.statuses(4, "DELETE", "/") == [405] * 2 + [405] * 2
    assert driver.statuses(3) == [200, 200, 429]


def test_405_answers_are_charged_when_configured(driver: Driver) -> None:
    if not driver.sees_405:
        pytest.skip("Litestar's router answers 405 before any middleware runs")
    driver.build(Config(default="2/minute", charge_method_not_allowed=True))
    assert driver.statuses(3, "DELETE", "/") == [405, 405, 429]


def test_a_405_on_a_decorated_route_counts_under_the_default(routed: Driver) -> None:
    if not routed.sees_405:
        pytest.skip("Litestar's router answers 405 before any middleware runs")
    # The method is not the route's: the endpoint never runs, so its limit does not apply.
    routed.build(Config(default="2/minute", charge_method_not_allowed=True))
    assert routed.statuses(3, "POST", "/limited") == [405, 405, 429]
    assert routed.statuses(3, "GET", "/limited") == [200, 200, 429]  # its own quota, whole


def test_a_405_on_an_exempt_route_counts_under_the_default(routed: Driver) -> None:
    if not routed.sees_405:
        pytest.skip("Litestar's router answers 405 before any middleware runs")
    routed.build(Config(default="2/minute", charge_method_not_allowed=True))
    assert routed.statuses(3, "DELETE", "/exempt") == [405, 405, 429]
    assert routed.statuses(3, "GET", "/exempt") == [200] * 3


def test_a_decorated_route_whose_key_says_none_falls_back_to_the_default(
        routed: Driver) -> None:
    routed.build(Config(default="3/minute"), route_key=keys.header("X-User-Id"))
    # No header: the route's own limit does not apply, the default does (never unlimited).
    assert routed.statuses(4, path="/keyed") == [200, 200, 200, 429]
    # With the header, the route's limit applies, per user.
    assert routed.statuses(3, path="/keyed", headers={"X-User-Id": "ann"}) == [200, 200, 429]


def test_keys_first_falls_back_to_the_client_address(routed: Driver) -> None:
    routed.build(Config(), route_key=keys.first(keys.header("X-User-Id"), keys.client_ip()))
    assert routed.statuses(3, path="/keyed") == [200, 200, 429]
    assert routed.statuses(2, path="/keyed", headers={"X-User-Id": "bob"}) == [200, 200]


def test_exempt_when_skips_every_limit(driver: Driver) -> None:
    driver.build(Config(default="1/minute",
                        exempt_when=lambda request: request.headers.get("X-Admin") == "yes"))
    assert driver.statuses(3, headers={"X-Admin": "yes"}) == [200] * 3
    assert driver.statuses(2) == [200, 429]


def test_per_method_default_counts_each_method_apart(driver: Driver) -> None:
    driver.build(Config(default="1/minute", per_method=True))
    assert driver.request("GET", "/items").status == 200
    assert driver.request("POST", "/items").status == 200
    assert driver.request("GET", "/items").status == 429


# -- names in headers ----------------------------------------------------------------------
def test_policy_names_in_headers_are_short_and_readable(driver: Driver) -> None:
    driver.build(Config(default="60/minute",
                        rules=[Rule("/login", "5/minute", methods=["POST"])]))
    header = driver.request("POST", "/login").headers["ratelimit-policy"]
    assert _item_names(header) == ["default minute", "POST /login minute"]


# -- modes and hooks -----------------------------------------------------------------------
def test_shadow_mode_counts_and_reports_but_never_refuses(driver: Driver) -> None:
    refusals: list[rl.Decision] = []
    driver.build(Config(default="1/minute", mode="shadow",
                        on_refusal=lambda request, decision: refusals.append(decision)))
    replies = [driver.request() for _ in range(3)]
    assert [r.status for r in replies] == [200] * 3
    assert replies[2].headers["ratelimit"].startswith('"minute";r=0')
    assert "retry-after" not in replies[2].headers
    assert len(refusals) == 2
    assert [event for event, _, _ in driver.recorder.events
            if event == "shadow_refused"] == ["shadow_refused"] * 2


def test_on_blocked_renders_the_refusal_with_the_rate_limit_headers(driver: Driver) -> None:
    def blocked(request: object, decision: rl.Decision) -> object:
        if driver.adapter in ("asgi", "fastapi"):
            from starlette.responses import PlainTextResponse
            return PlainTextResponse("slow down", status_code=429)
        if driver.adapter == "wsgi":
            from werkzeug.wrappers import Response
            return Response("slow down", status=429)
        if driver.adapter.startswith("django"):
            from django.http import HttpResponse
            return HttpResponse("slow down", status=429)
        return "slow down", 429

    if driver.adapter == "litestar":  # a refusal is an exception there: a handler shapes it
        with pytest.raises(rl.ConfigurationError, match="exception_handlers="):
            driver.build(Config(default="1/minute", on_blocked=blocked))
        return
    driver.build(Config(default="1/minute", on_blocked=blocked))
    driver.request()
    refused = driver.request()
    assert (refused.status, refused.body) == (429, b"slow down")
    assert "retry-after" in refused.headers and "ratelimit" in refused.headers


def test_count_when_gives_back_the_hits_that_should_not_count(driver: Driver) -> None:
    driver.build(Config(default="2/minute", count_when=lambda status: status >= 400))
    assert driver.statuses(4, path="/status/200") == [200] * 4
    assert driver.statuses(3, path="/status/401") == [401, 401, 429]


def test_count_when_on_a_rule_gives_back_only_that_rules_hits(driver: Driver) -> None:
    # Flask-Limiter's deduct_when on one limit: the failures count against the rule, every
    # request against the default.
    failures = Rule("/status/*", "2/minute", count_when=lambda status: status >= 400)
    driver.build(Config(default="10/minute", rules=[failures]))
    assert driver.statuses(4, path="/status/200") == [200] * 4
    assert driver.statuses(3, path="/status/404") == [404, 404, 429]
    assert driver.statuses(5) == [200] * 4 + [429]  # 6 counted by the default, 4 left


def test_count_when_on_a_decorator_gives_back_only_that_routes_hits(routed: Driver) -> None:
    routed.build(Config(default="3/minute", count_when=lambda status: True),
                 route_options={"count_when": lambda status: status >= 400})
    assert routed.statuses(5, path="/keyed") == [200] * 5  # its 200s are given back
    assert routed.statuses(4) == [200, 200, 200, 429]      # the middleware's counts all


def test_count_when_must_be_a_callable() -> None:
    with pytest.raises(rl.ConfigurationError, match="count_when must be a callable"):
        Rule("/x", "1/minute", count_when=400)  # type: ignore[arg-type]
    with pytest.raises(rl.ConfigurationError, match="count_when must be a callable"):
        rl.Limiter().limit("1/minute", count_when="4xx")  # type: ignore[arg-type]


def test_enabled_false_lets_every_request_through_untouched(driver: Driver) -> None:
    driver.build(Config(default="1/minute", rules=[Rule("/items", "1/minute")],
                        enabled=False))
    replies = [driver.request("GET", path) for path in ("/", "/", "/items", "/items")]
    assert [reply.status for reply in replies] == [200] * 4
    assert not any("ratelimit" in reply.headers for reply in replies)
    if driver.routes:
        assert driver.statuses(3, path="/limited") == [200] * 3


@pytest.mark.parametrize(("value", "enabled"), [
    ("0", False), ("false", False), ("Off", False), ("no", False),
    ("1", True), ("true", True), ("", True), (None, True),
])
def test_ratelimit_enabled_is_read_when_the_configuration_is_made(
        monkeypatch: pytest.MonkeyPatch, value: str | None, enabled: bool) -> None:
    if value is None:
        monkeypatch.delenv("RATELIMIT_ENABLED", raising=False)
    else:
        monkeypatch.setenv("RATELIMIT_ENABLED", value)
    config = Config(default="1/minute")
    assert config.enabled is enabled
    monkeypatch.setenv("RATELIMIT_ENABLED", "1" if not enabled else "0")
    assert config.enabled is enabled  # read once: the configuration keeps what it read
    assert Config(default="1/minute", enabled=True).enabled is True  # given: not read


def test_a_ratelimit_enabled_that_is_neither_on_nor_off_stops_start_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RATELIMIT_ENABLED", "maybe")
    with pytest.raises(rl.ConfigurationError, match="RATELIMIT_ENABLED=0"):
        Config(default="1/minute")


# -- backend down --------------------------------------------------------------------------
def test_backend_down_allow_admits_without_headers(driver: Driver) -> None:
    # A cool-down no loaded machine outlasts between three requests (the breaker's clock is
    # the real one; seen: the default 1 s ran out and a second probe went out).
    driver.build(Config(default="1/minute", backend_cooldown=60),
                 backend=failing_backend("down"))
    replies = [driver.request() for _ in range(3)]
    assert [r.status for r in replies] == [200] * 3
    assert "ratelimit" not in replies[0].headers
    assert driver.backend.calls == 1  # the breaker skips it during the cool-down


def test_backend_down_deny_answers_503_with_retry_after(driver: Driver) -> None:
    driver.build(Config(default="1/minute", on_backend_error="deny", backend_cooldown=5),
                 backend=failing_backend("down"))
    reply = driver.request()
    assert reply.status == 503
    assert reply.headers["retry-after"] == "5"
    assert json.loads(reply.body)["detail"] == "Rate limiter unavailable"
    assert driver.recorder.names("breaker_open") == []
    assert driver.request().status == 503
    assert driver.recorder.names("breaker_open") != []


def test_backend_down_memory_limits_in_process_with_headers_and_429s(driver: Driver) -> None:
    """Every adapter (ASGI, FastAPI, WSGI, Flask): the same limit, decided in memory while
    the store is down; the 429 carries Retry-After and the RateLimit headers; metrics say
    backend_error for the call that failed, then fallback."""
    driver.build(Config(default="2/minute", on_backend_error="memory", backend_cooldown=60),
                 backend=failing_backend("down"))
    replies = [driver.request() for _ in range(3)]
    assert [r.status for r in replies] == [200, 200, 429]
    assert "ratelimit" in replies[0].headers and replies[2].headers["retry-after"]
    assert driver.backend.calls == 1
    assert driver.recorder.names("fallback") != []
    assert driver.recorder.names("breaker_open") == []


# -- hostile requests ----------------------------------------------------------------------
@pytest.mark.parametrize("headers", [
    {"X-Forwarded-For": "garbage, ::ffff:1.2.3.4, [::1]:99, " + "9" * 5000},
    {"Forwarded": 'for="[bad', "X-User-Id": "\x7f" * 8000},
    {"X-User-Id": "{slot}" * 1000, "Access-Control-Request-Method": "GET, \x7f"},
])
def test_hostile_headers_never_fail_the_request(driver: Driver, headers: dict[str, str]) -> None:
    driver.build(Config(default="2/minute",
                        key=keys.first(keys.header("X-User-Id"),
                                       keys.client_ip(trusted_proxies=1))))
    assert driver.statuses(3, headers=headers) == [200, 200, 429]


def test_a_float_cost_is_a_configuration_error_not_a_truncation() -> None:
    limiter = rl.Limiter()
    from ratelimit_mw.wsgi import RateLimitMiddleware

    app = RateLimitMiddleware(lambda environ, start: [b""], limiter,
                              config=Config(rules=[Rule("/", "10/minute",
                                                        cost=lambda request: 7.5)]))
    from werkzeug.test import Client

    with pytest.raises(rl.ConfigurationError, match=r"returned 7\.5"):
        Client(app).get("/")


# -- the vocabulary of slowapi and Flask-Limiter -------------------------------------------
def _plan_rate(request: object) -> str:
    return "3/minute" if request.headers.get("X-Plan") == "pro" else "1/minute"  # type: ignore[attr-defined]


def test_a_dynamic_rule_picks_its_rate_per_request(driver: Driver) -> None:
    driver.build(Config(rules=[Rule("/items", _plan_rate)]))
    pro = {"X-Plan": "pro"}
    assert driver.statuses(4, path="/items", headers=pro) == [200, 200, 200, 429]
    free = driver.request(path="/items")
    assert free.status == 200  # another rate: its own counter
    assert free.headers["ratelimit-policy"] == '"minute";q=1;w=60'
    assert driver.request(path="/items").status == 429


def test_a_dynamic_decorator_picks_its_rate_per_request(routed: Driver) -> None:
    routed.build(Config(default="100/minute"), route_rates=_plan_rate)
    assert routed.statuses(2, path="/keyed") == [200, 429]
    assert routed.statuses(4, path="/keyed", headers={"X-Plan": "pro"}) == [200] * 3 + [429]


def test_a_dynamic_limit_returning_no_rate_is_logged_and_skipped_never_a_500(
    driver: Driver, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(request: object) -> str:
        return "lots per minute"  # not rate text: the app's bug must not answer 500

    driver.build(Config(default="2/minute", rules=[Rule("/items", broken)]))
    with caplog.at_level(logging.WARNING, logger="ratelimit_mw"):
        assert driver.statuses(3, path="/items") == [200, 200, 429]  # the default still holds
    messages = [r.getMessage() for r in caplog.records if r.name == "ratelimit_mw"]
    assert len(messages) == 1, messages  # throttled: once, not per request
    assert "dynamic limit failed" in messages[0] and "lots per minute" in messages[0]


def test_a_decorator_with_methods_limits_only_those_methods(routed: Driver) -> None:
    routed.build(Config(default="3/minute"), route_rates="1/minute",
                 route_options={"methods": ["POST"]})
    assert routed.statuses(2, "POST", "/keyed") == [200, 429]
    assert routed.statuses(4, "GET", "/keyed") == [200, 200, 200, 429]  # the default


def test_exempt_when_on_a_rule_and_on_a_decorator(routed: Driver) -> None:
    def admin(request: object) -> bool:
        return request.headers.get("X-Admin") == "yes"  # type: ignore[attr-defined]

    routed.build(Config(rules=[Rule("/items", "1/minute", exempt_when=admin)]),
                 route_rates="1/minute", route_options={"exempt_when": admin})
    for path in ("/items", "/keyed"):
        assert routed.statuses(3, path=path, headers={"X-Admin": "yes"}) == [200] * 3
        assert routed.statuses(2, path=path) == [200, 429]
