"""The guard and its Config: the request-independent half shared by every adapter."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

import ratelimit_mw as rl
from ratelimit_mw.http.config import Config, Rule, build_config
from ratelimit_mw.http.guard import Guard
from ratelimit_mw.routing import EXEMPT


def make_core(**options: Any) -> Guard:
    settings: dict[str, Any] = {"default": "10/minute", "key": lambda request: "ip:1"}
    settings.update(options)
    return Guard(Config(**settings), rl.Limiter(), timeout=None)


def checks_of(core: Guard, request: Any) -> list[Any]:
    selection = core.select("GET", "/", None)
    assert selection is not None
    plan = core.plan(selection, request, "GET")
    return [] if plan is None else plan.checks


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
    [check] = checks_of(core, request_from())
    assert check.identity == expected
    assert not core.breaker.is_open


def test_a_raising_key_function_falls_back_to_the_client_ip() -> None:
    core = make_core(key=lambda request: 1 / 0)
    [check] = checks_of(core, request_from())
    assert check.identity == "ip:203.0.113.9"


def test_a_key_returning_none_means_the_policy_does_not_apply() -> None:
    core = make_core(key=lambda request: None)
    assert checks_of(core, request_from()) == []


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
        # Sliding-log namesakes keep one log: one longest window (core.policy).
        ({"default": rl.Policy("5/minute", name="api"),
          "rules": [Rule("/search", "50/hour", name="api")]}, "share the name 'api'"),
        ({"rules": {"/a": rl.Policy("5/minute", name="api"),
                    "/b": rl.Policy("50/hour", name="api")}}, "different windows"),
    ],
)
def test_configuration_mistakes_are_reported_at_start_up(
    options: dict[str, Any], mentions: str
) -> None:
    with pytest.raises(rl.ConfigurationError, match=mentions):
        make_core(**options)


def test_unknown_options_name_the_closest_one() -> None:
    with pytest.raises(rl.ConfigurationError, match="did you mean 'default'"):
        build_config(None, {"defualt": "5/minute"})
    with pytest.raises(rl.ConfigurationError, match="either config= or options"):
        build_config(Config(), {"default": "5/minute"})


def test_a_config_is_frozen_and_replace_validates_again() -> None:
    config = Config(default="5/minute")
    with pytest.raises(AttributeError):
        config.default = "6/minute"  # type: ignore[misc]
    assert config.replace(mode="shadow").shadow
    with pytest.raises(rl.ConfigurationError, match="mode"):
        config.replace(mode="audit")


def test_rules_are_named_after_path_methods_and_rates() -> None:
    get = Rule("/items", "100/minute", methods=["GET"])
    post = Rule("/items", "5/minute", methods=["POST"])
    assert get.policy.name != post.policy.name
    assert (get.label, post.label) == ("GET,HEAD /items", "POST /items")
    assert Rule("/a", "5/minute", name="shared").policy.name == "shared"
    # Rules sharing a name share one log: fine with one longest window.
    Config(rules=[Rule("/a", "5/minute", name="shared"), Rule("/b", "9/minute", name="shared")])


def test_decorated_route_names_are_stable_however_the_app_is_started() -> None:
    import sys
    import types

    from ratelimit_mw.routing import stable_module

    def view() -> None: ...

    view.__module__ = "examples.app"
    assert stable_module(view) == "examples.app"  # the full name: two app.py count apart
    main = types.ModuleType("__main__")
    main.__file__ = "/srv/examples/app.py"
    saved = sys.modules["__main__"]
    sys.modules["__main__"] = main
    try:
        view.__module__ = "__main__"
        assert stable_module(view) == "app"
    finally:
        sys.modules["__main__"] = saved


@pytest.mark.parametrize(("module", "package", "extra"), [
    ("ratelimit_mw.asgi", "starlette", "starlette"),
    ("ratelimit_mw.fastapi", "fastapi", "fastapi"),
    ("ratelimit_mw.flask", "flask", "flask"),
    ("ratelimit_mw.httpx", "httpx", "httpx"),
    ("ratelimit_mw.django", "django", "django"),
    ("ratelimit_mw.litestar", "litestar", "litestar"),
])
def test_an_adapter_without_its_framework_names_the_extra_to_install(
        module: str, package: str, extra: str) -> None:
    import subprocess
    import sys

    script = (f"import sys; sys.modules[{package!r}] = None\n"
              f"try:\n    import {module}\nexcept ImportError as exc:\n    print(exc)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout
    assert f"pip install 'ratelimit_mw[{extra}]'" in out


def test_the_plain_wsgi_middleware_needs_no_werkzeug() -> None:
    import subprocess
    import sys

    script = ("import sys; sys.modules['werkzeug'] = None\n"
              "import ratelimit_mw.wsgi as w\n"
              "print(w._Request.__module__)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "ratelimit_mw.http.environ_request"


def test_config_built_directly_names_a_misspelt_option_like_the_adapters_do() -> None:
    from ratelimit_mw.http.config import Config

    with pytest.raises(rl.ConfigurationError, match="did you mean 'default'"):
        Config(defualt="60/minute")  # type: ignore[call-arg]
    with pytest.raises(rl.ConfigurationError, match="keyword options only"):
        Config("60/minute")  # type: ignore[misc]


def test_the_typed_keyword_options_are_configs_options() -> None:
    from ratelimit_mw.fastapi import DependencyOptions
    from ratelimit_mw.http.config import OPTION_NAMES, ConfigOptions

    assert set(ConfigOptions.__annotations__) == set(OPTION_NAMES)
    assert set(DependencyOptions.__annotations__) <= set(OPTION_NAMES)


@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("concurrency", [None, 10])
def test_an_admitted_verdict_and_its_plan_have_every_field_set(
        raw: bool, concurrency: int | None) -> None:
    """The handler builds an admission field by field rather than through an
    ``__init__``: none is left unset, in either form of the headers. Its plan is kept per
    identity for a rate alone, and is one per request, by its token, with in-flight slots."""
    from ratelimit_mw._sync.handler import handler_sync
    from ratelimit_mw.http.verdict import Admit, Plan

    limiter = rl.Limiter(rl.MemoryBackend())
    guard = Guard(Config(default="10/minute", key=lambda request: "ip:1",
                         concurrency=concurrency), limiter, timeout=None, raw=raw)
    selection = guard.select("GET", "/", None)
    assert selection is not None
    handle = handler_sync(guard, limiter, selection)
    verdict, again = (handle(request_from(), "GET", False) for _ in range(2))
    assert type(verdict) is Admit and type(again) is Admit
    assert [name for name in Admit.__slots__ if not hasattr(verdict, name)] == []
    assert (verdict.raw is not None) is raw and (verdict.headers is not None) is not raw
    plan = verdict.plan
    assert type(plan) is Plan  # the default watches a 405's status
    assert (plan.token is not None) is (concurrency is not None)
    assert plan.identities == ("ip:1",) * len(plan.compiled.policies)
    assert (again.plan is plan) is (concurrency is None)
