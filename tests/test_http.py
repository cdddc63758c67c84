"""MiddlewareCore: the request-independent half shared by the ASGI and WSGI middleware."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

import ratelimit_mw as rl
from ratelimit_mw._http import MiddlewareCore, Rule
from ratelimit_mw.routing import EXEMPT


def make_core(**options: Any) -> MiddlewareCore:
    settings: dict[str, Any] = {
        "default": "10/minute",
        "rules": None,
        "key": lambda request: "ip:1",
        "on_backend_error": "allow",
        "headers": True,
        "legacy_headers": False,
        "mode": "enforce",
        "on_refusal": None,
        "count_when": None,
        "backend_cooldown": 1.0,
    }
    settings.update(options)
    return MiddlewareCore(**settings)


def request_from(peer: str = "203.0.113.9") -> Any:
    """A minimal WSGI-shaped request for the fallback client_ip key."""
    return SimpleNamespace(environ={"REMOTE_ADDR": peer}, remote_addr=peer, headers={})


@pytest.mark.parametrize(
    ("returned", "expected"),
    [
        (42, "ip:203.0.113.9"),
        (b"bytes", "ip:203.0.113.9"),
        ("user:7", "user:7"),
    ],
)
def test_a_key_function_returning_a_non_string_falls_back_to_the_client_ip(
    returned: object, expected: str
) -> None:
    core = make_core(key=lambda request: returned)
    selection = core.select("GET", "/", None)
    assert selection is not None
    [check] = core.checks(selection, request_from())
    assert check.identity == expected
    assert not core.breaker.is_open()


def test_a_raising_key_function_falls_back_to_the_client_ip() -> None:
    core = make_core(key=lambda request: 1 / 0)
    selection = core.select("GET", "/", None)
    assert selection is not None
    [check] = core.checks(selection, request_from())
    assert check.identity == "ip:203.0.113.9"


def test_a_key_returning_none_means_the_policy_does_not_apply() -> None:
    core = make_core(key=lambda request: None)
    selection = core.select("GET", "/", None)
    assert selection is not None
    assert core.checks(selection, request_from()) == []


def test_rules_add_to_the_default_and_exempt_drops_only_the_default() -> None:
    core = make_core(rules=[Rule("/login", "5/minute", methods=["POST"])])
    both = core.select("POST", "/login", None)
    only_rule = core.select("POST", "/login", EXEMPT)
    only_default = core.select("GET", "/login", None)
    assert both is not None and only_rule is not None and only_default is not None
    assert [a.policy.rates[0].limit for a in both.applied] == [10, 5]
    assert [a.policy.rates[0].limit for a in only_rule.applied] == [5]
    assert [a.policy.rates[0].limit for a in only_default.applied] == [10]


@pytest.mark.parametrize(
    ("pattern", "path", "matches"),
    [
        ("/login", "/login", True),
        ("/login", "/login/", False),
        ("/api/*", "/api/v1/users", True),
        ("/api/*", "/apix", False),
        ("/users/{id}", "/users/42", True),
        ("/users/{id}", "/users/42/posts", False),
    ],
)
def test_rule_patterns(pattern: str, path: str, matches: bool) -> None:
    assert Rule(pattern, "1/minute").matches("GET", path) is matches


@pytest.mark.parametrize(
    ("options", "mentions"),
    [
        ({"mode": "audit"}, "mode"),
        ({"on_backend_error": "retry"}, "on_backend_error"),
        ({"backend_cooldown": -1}, "backend_cooldown"),
        ({"count_when": 400}, "count_when"),
        ({"key": "ip"}, "key"),
        ({"rules": [("login", "5/minute")]}, "start with '/'"),
        ({"default": "10/fortnight"}, "fortnight"),
    ],
)
def test_configuration_mistakes_are_reported_at_start_up(
    options: dict[str, Any], mentions: str
) -> None:
    with pytest.raises(rl.ConfigurationError, match=mentions):
        make_core(**options)
