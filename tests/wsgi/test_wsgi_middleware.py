"""RateLimitMiddleware on a plain WSGI app, driven by werkzeug's test Client.

Tests taking the `limiter` fixture run twice: on the memory backend and on the real Redis
(per-test prefix), with the fake clock as the scripts' time.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import pytest
from support import CountingBackend
from support import failing_backend as FailingBackend
from werkzeug.test import EnvironBuilder
from werkzeug.wrappers import Request
from wsgi_support import (
    Environ,
    ServerClient,
    echo_app,
    retry_after_of,
)

import ratelimit_mw as rl
from ratelimit_mw import keys
from ratelimit_mw.core.errors import BackendError, ConfigurationError
from ratelimit_mw.wsgi import DECISION_KEY, RateLimitMiddleware, Rule

PEER = "ip:127.0.0.1"


def client(app: Any, limiter: rl.Limiter, **options: Any) -> ServerClient:
    return ServerClient(RateLimitMiddleware(app, limiter, **options))


def environ(path: str = "/", **kwargs: Any) -> Environ:
    return EnvironBuilder(path, environ_base={"REMOTE_ADDR": "127.0.0.1"},
                          **kwargs).get_environ()


def memory_limiter(clock: Any = None) -> rl.Limiter:
    return rl.Limiter(rl.MemoryBackend(), clock=clock)


# -- the limit itself ----------------------------------------------------------------------
def test_retry_after_counts_down_with_the_clock_and_the_window_reopens(
    limiter: rl.Limiter, clock: Any
) -> None:
    c = client(echo_app, limiter, default="2/minute")
    c.get("/")
    clock.advance(20)
    c.get("/")
    clock.advance(15)
    refused = c.get("/")
    assert refused.headers["Retry-After"] == "25"
    assert retry_after_of(refused.data) == 25
    clock.advance(25)
    assert c.get("/").status_code == 200


def test_admitted_responses_carry_the_headers_and_the_app_sees_the_decision(
    limiter: rl.Limiter,
) -> None:
    c = client(echo_app, limiter, default="5/minute")
    first, second = c.get("/a"), c.get("/b")
    assert first.headers["RateLimit-Policy"] == '"minute";q=5;w=60'
    assert first.headers["RateLimit"] == '"minute";r=4;t=60'
    assert second.headers["RateLimit"] == '"minute";r=3;t=60'
    assert second.headers["X-App"] == "echo"  # the app's own headers stay
    assert json.loads(second.data)["remaining"] == 3
    assert "Retry-After" not in first.headers


def test_an_app_that_reuses_one_header_list_does_not_accumulate_headers() -> None:
    shared = [("Content-Type", "text/plain")]

    def app(environ: Environ, start_response: Any) -> list[bytes]:
        start_response("200 OK", shared)
        return [b"ok"]

    c = client(app, memory_limiter(), default="10/minute")
    counts = [len(c.get("/").headers.getlist("RateLimit")) for _ in range(3)]
    assert counts == [1, 1, 1]
    assert shared == [("Content-Type", "text/plain")]


def test_requests_no_policy_applies_to_pass_through_untouched(limiter: rl.Limiter) -> None:
    c = client(echo_app, limiter, rules=[Rule("/login", "1/minute", methods=["POST"])])
    for _ in range(3):
        response = c.get("/login")
        assert response.status_code == 200
        assert "RateLimit" not in response.headers
        assert json.loads(response.data)["remaining"] is None
    assert c.post("/login").status_code == 200
    assert c.post("/login").status_code == 429


def test_a_key_function_returning_none_exempts_the_request(limiter: rl.Limiter) -> None:
    c = client(echo_app, limiter, default="1/minute", key=keys.header("X-Api-Key"))
    assert [c.get("/").status_code for _ in range(3)] == [200, 200, 200]
    assert c.get("/", headers={"X-Api-Key": "k"}).status_code == 200
    assert c.get("/", headers={"X-Api-Key": "k"}).status_code == 429
    assert c.get("/", headers={"X-Api-Key": "other"}).status_code == 200


def test_key_functions_receive_one_werkzeug_request_per_request() -> None:
    seen: list[Any] = []

    def key(request: Any) -> str:
        seen.append(request)
        return "k"

    def key_too(request: Any) -> str:
        return key(request)

    c = client(echo_app, memory_limiter(), default="5/minute",
               rules=[Rule("/*", "5/minute", key=key_too)], key=key)
    c.get("/x")
    assert len(seen) == 2
    assert isinstance(seen[0], Request)
    assert seen[0] is seen[1]
    assert seen[0].path == "/x"


def test_a_key_shared_by_several_limits_is_asked_once_per_request() -> None:
    asked: list[str] = []

    def key(request: Any) -> str:
        asked.append(request.path)
        return "k"

    c = client(echo_app, memory_limiter(), default="5/minute",
               rules=[Rule("/*", "7/minute", key=key)], key=key)
    response = c.get("/x")
    assert asked == ["/x"]
    assert ";r=4;" in response.headers["RateLimit"]


# -- hostile input -------------------------------------------------------------------------
@pytest.mark.parametrize("spoofed", [
    ["203.0.113.1", "203.0.113.2", "203.0.113.3"],
    ["for=198.51.100.1", "for=198.51.100.2", "for=198.51.100.3"],
])
def test_spoofed_forwarding_headers_without_trusted_proxies_do_not_change_the_key(
    limiter: rl.Limiter, spoofed: list[str]
) -> None:
    c = client(echo_app, limiter, default="2/minute")
    header = "Forwarded" if spoofed[0].startswith("for=") else "X-Forwarded-For"
    statuses = [c.get("/", headers={header: value}).status_code for value in spoofed]
    assert statuses == [200, 200, 429]
    assert limiter.peek(rl.Policy("2/minute"), PEER).remaining == 0


GARBAGE = [
    "",
    ",,,,",
    "unknown",
    "999.999.999.999",
    "for=\"[::1",
    "\x00\x01\x7f",
    "é, ü, ø",  # non-ASCII: latin-1 text in the environ
    "1.2.3.4," * 20_000,  # 160 KB
    "for=" + "a" * 100_000,
    "::ffff:1.2.3.4:80, [2001:db8::1]:443",
]


@pytest.mark.parametrize("garbage", GARBAGE, ids=range(len(GARBAGE)))
@pytest.mark.parametrize("trusted", [None, ["127.0.0.0/8"], 1])
def test_garbage_forwarding_headers_never_raise_and_are_still_limited(
    garbage: str, trusted: Any
) -> None:
    c = client(echo_app, memory_limiter(), default="1/minute",
               key=keys.client_ip(trusted_proxies=trusted))
    hostile = {"HTTP_X_FORWARDED_FOR": garbage, "HTTP_FORWARDED": garbage}
    first = c.get("/", environ_overrides=hostile)
    second = c.get("/", environ_overrides=hostile)
    assert (first.status_code, second.status_code) == (200, 429)


def test_huge_and_non_ascii_header_values_reach_key_functions_without_error() -> None:
    c = client(echo_app, memory_limiter(), default="1/minute",
               key=keys.compose(keys.header("X-Api-Key"), keys.client_ip()))
    huge = {"HTTP_X_API_KEY": "k" * 1_000_000}
    latin = {"HTTP_X_API_KEY": "clé-ü"}
    assert [c.get("/", environ_overrides=huge).status_code for _ in range(2)] == [200, 429]
    assert [c.get("/", environ_overrides=latin).status_code for _ in range(2)] == [200, 429]


def test_rules_match_the_decoded_unicode_path_and_bad_utf8_never_raises() -> None:
    c = client(echo_app, memory_limiter(), rules={"/café/*": "1/minute"})
    assert c.get("/café/x").status_code == 200
    assert c.get("/caf%C3%A9/y").status_code == 429
    bad = {"PATH_INFO": "/caf\xff\xfe/x"}  # not UTF-8 once re-encoded as latin-1
    assert c.get("/", environ_overrides=bad).status_code == 200


# -- failure policy ------------------------------------------------------------------------
def test_backend_down_with_a_callable_lets_it_decide_per_request(
    down_backend: rl.RedisBackend,
) -> None:
    calls: list[tuple[Any, BaseException]] = []

    def on_error(request: Any, error: BaseException) -> bool:
        calls.append((request, error))
        return request.method == "GET"

    c = client(echo_app, rl.Limiter(down_backend), default="1/minute",
               on_backend_error=on_error, backend_cooldown=0)
    assert c.get("/").status_code == 200
    assert c.post("/").status_code == 503
    assert isinstance(calls[0][0], Request)
    assert isinstance(calls[0][1], BackendError)


def test_a_callable_sees_a_backend_error_for_requests_skipped_in_the_cool_down(
    down_backend: rl.RedisBackend,
) -> None:
    errors: list[BaseException] = []
    c = client(echo_app, rl.Limiter(down_backend), default="1/minute",
               on_backend_error=lambda request, error: errors.append(error) is None)
    c.get("/")
    c.get("/")
    assert len(errors) == 2
    assert all(isinstance(e, BackendError) for e in errors)
    assert "cool-down" in str(errors[1])


class _Boom(Exception):
    pass


NEVER_500 = {
    "backend raises a non-backend error": dict(backend=FailingBackend(RuntimeError("bug"))),
    "backend raises a socket error": dict(backend=FailingBackend(ConnectionResetError())),
    "key function raises": dict(key=lambda request: 1 / 0),
    "cost function raises": dict(rules=[Rule("/*", "5/minute", cost=lambda r: 1 / 0)]),
    "on_refusal raises": dict(on_refusal=lambda request, decision: 1 / 0),
    "on_blocked raises": dict(on_blocked=lambda request, decision: 1 / 0),
    "on_blocked returns junk": dict(on_blocked=lambda request, decision: 42),
    "count_when raises": dict(count_when=lambda status: 1 / 0),
    "on_backend_error raises": dict(backend=FailingBackend(BackendError("down")),
                                    on_backend_error=lambda request, error: 1 / 0),
    "penalty callable returns a naive datetime": dict(
        default=rl.Policy("1/minute", penalty=lambda: __import__("datetime").datetime.now())),
}


@pytest.mark.parametrize("fault", list(NEVER_500), ids=list(NEVER_500))
def test_nothing_the_limiter_calls_can_turn_a_request_into_a_500(fault: str) -> None:
    options = dict(NEVER_500[fault])
    backend = options.pop("backend", rl.MemoryBackend())
    options.setdefault("default", "1/minute")
    c = client(echo_app, rl.Limiter(backend), backend_cooldown=0, **options)
    statuses = {c.get("/").status_code for _ in range(3)}
    assert statuses <= {200, 429}
    assert 200 in statuses


# -- modes and hooks -----------------------------------------------------------------------
def test_on_refusal_gets_the_request_and_the_decision_of_each_refusal(
    limiter: rl.Limiter,
) -> None:
    seen: list[tuple[Any, rl.Decision]] = []
    c = client(echo_app, limiter, default="1/minute",
               on_refusal=lambda request, decision: seen.append((request, decision)))
    c.get("/")
    c.get("/x")
    c.get("/y")
    assert [request.path for request, _ in seen] == ["/x", "/y"]
    assert all(not decision.allowed and decision.retry_after == 60 for _, decision in seen)


def test_the_decision_is_left_in_the_environ_for_the_app(limiter: rl.Limiter) -> None:
    seen: list[Any] = []

    def app(environ: Environ, start_response: Any) -> list[bytes]:
        seen.append(environ.get(DECISION_KEY))
        start_response("204 No Content", [])
        return []

    c = client(app, limiter, default="3/minute", rules={"/limited": "1/minute"})
    c.get("/limited")
    assert isinstance(seen[0], rl.Decision)
    assert (seen[0].allowed, seen[0].remaining, seen[0].limit) == (True, 0, 1)
    no_policy = client(app, limiter, rules={"/limited": "1/minute"})
    no_policy.get("/free")
    assert seen[1] is None


# -- count_when ----------------------------------------------------------------------------
def login_app(environ: Environ, start_response: Any) -> list[bytes]:
    ok = environ.get("QUERY_STRING") == "password=right"
    start_response("200 OK" if ok else "401 Unauthorized", [("Content-Type", "text/plain")])
    return [b"welcome" if ok else b"no"]


def test_the_refund_waits_until_the_server_closes_the_body(limiter: rl.Limiter) -> None:
    policy = rl.Policy("2/minute")
    middleware = RateLimitMiddleware(login_app, limiter, default=policy,
                                     count_when=lambda s: s >= 400)
    started: list[str] = []
    body = middleware(environ("/", query_string="password=right"),
                      lambda status, headers, exc_info=None: started.append(status))
    assert b"".join(body) == b"welcome"
    assert limiter.peek(policy, PEER).remaining == 1  # still counted
    body.close()  # type: ignore[attr-defined]
    assert limiter.peek(policy, PEER).remaining == 2
    assert started == ["200 OK"]


@pytest.mark.parametrize(("restart", "remaining"), [(None, 1), ("500 Internal Server Error", 1),
                                                    ("405 Method Not Allowed", 2)])
def test_the_last_status_of_a_response_decides_what_comes_back(
    limiter: rl.Limiter, restart: str | None, remaining: int
) -> None:
    # The defaults: a 405 is not charged, and nothing else comes back. A response started as
    # a 200 and started again while its body is read (PEP 3333's exc_info) counts by its
    # last status: given back only when that is a 405.
    def app(environ: Environ, start_response: Any) -> Any:
        start_response("200 OK", [])

        def body() -> Any:
            if restart is not None:
                try:
                    raise LookupError("found out while the body was made")
                except LookupError:
                    start_response(restart, [], sys.exc_info())
            yield b"body"

        return body()

    policy = rl.Policy("2/minute")
    started: list[str] = []
    body = RateLimitMiddleware(app, limiter, default=policy)(
        environ(), lambda status, headers, exc_info=None: started.append(status))
    assert b"".join(body) == b"body"
    getattr(body, "close", lambda: None)()
    assert started == ["200 OK"] + ([restart] if restart else [])
    assert limiter.peek(policy, PEER).remaining == remaining


def test_an_app_that_raises_is_judged_as_the_500_the_server_will_send(
    limiter: rl.Limiter,
) -> None:
    def broken(environ: Environ, start_response: Any) -> list[bytes]:
        raise _Boom

    policy = rl.Policy("2/minute")
    not_5xx = RateLimitMiddleware(broken, limiter, default=policy,
                                  count_when=lambda s: s < 500)
    with pytest.raises(_Boom):
        not_5xx(environ(), lambda *a: None)
    assert limiter.peek(policy, PEER).remaining == 2
    only_5xx = RateLimitMiddleware(broken, limiter, default=policy,
                                   count_when=lambda s: s >= 500)
    with pytest.raises(_Boom):
        only_5xx(environ(), lambda *a: None)
    assert limiter.peek(policy, PEER).remaining == 1


def test_a_refund_that_fails_is_logged_and_the_response_stands(
    caplog: pytest.LogCaptureFixture,
) -> None:
    memory = rl.MemoryBackend()
    state = {"fail": False}

    class Flaky:
        is_cluster = False

        def run(self, call: Any, deadline: float | None = None) -> list[int]:
            if state["fail"]:
                raise BackendError("gone")
            return memory.run(call)

    class Closing:
        def __iter__(self) -> Any:
            return iter([b"ok"])

        def close(self) -> None:
            state["fail"] = True

    def app(environ: Environ, start_response: Any) -> Closing:
        start_response("200 OK", [])
        return Closing()

    c = client(app, rl.Limiter(Flaky()), default="2/minute",
               count_when=lambda s: s >= 400)
    with caplog.at_level(logging.WARNING, logger="ratelimit_mw"):
        response = c.get("/")
        response.close()
    assert response.status_code == 200
    assert any("give back" in r.getMessage() for r in caplog.records)


def test_no_refund_is_attempted_while_the_backend_cools_down() -> None:
    counting = CountingBackend(rl.MemoryBackend())
    middleware = RateLimitMiddleware(login_app, rl.Limiter(counting), default="2/minute",
                                     count_when=lambda s: s >= 400, backend_cooldown=60)
    c = ServerClient(middleware)
    body = middleware(environ("/", query_string="password=right"), lambda *a: None)
    middleware.guard.breaker.failed("down")  # the backend failed meanwhile
    body.close()  # type: ignore[attr-defined]
    assert counting.calls == 1  # the hit, and no refund call
    middleware.guard.breaker.succeeded()
    c.get("/", query_string="password=right")
    assert counting.calls == 3  # hit and refund


# -- configuration -------------------------------------------------------------------------
@pytest.mark.parametrize("bad, message", [
    (dict(limiter=rl.AsyncLimiter()), "sync Limiter"),
    (dict(limiter=rl.MemoryBackend()), "sync Limiter"),
    (dict(mode="audit"), "enforce"),
    (dict(on_backend_error="ignore"), "on_backend_error"),
    (dict(on_blocked="429.html"), "on_blocked"),
    (dict(default="5 per fortnight"), "fortnight"),
    (dict(app=None), "WSGI application"),
])
def test_configuration_mistakes_fail_at_construction(bad: dict[str, Any], message: str) -> None:
    options: dict[str, Any] = {"app": echo_app, "limiter": memory_limiter()}
    options.update(bad)
    with pytest.raises(ConfigurationError, match=message):
        RateLimitMiddleware(options.pop("app"), options.pop("limiter"), **options)
