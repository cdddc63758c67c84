"""RateLimitMiddleware on a plain WSGI app, driven by werkzeug's test Client.

Tests taking the `limiter` fixture run twice: on the memory backend and on the real Redis
(per-test prefix), with the fake clock as the scripts' time.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from werkzeug.test import EnvironBuilder
from werkzeug.wrappers import Request, Response
from wsgi_support import (
    CountingBackend,
    Environ,
    FailingBackend,
    ServerClient,
    echo_app,
    retry_after_of,
)

import ratelimit_mw as rl
from ratelimit_mw import keys
from ratelimit_mw._errors import BackendError, ConfigurationError
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
def test_exactly_limit_requests_are_admitted_then_a_json_429_with_every_header(
    limiter: rl.Limiter, clock: Any
) -> None:
    c = client(echo_app, limiter, default="3/minute")
    statuses = [c.get("/").status_code for _ in range(3)]
    refused = c.get("/")
    assert statuses == [200, 200, 200]
    assert refused.status_code == 429
    assert refused.headers["Content-Type"] == "application/json"
    assert refused.headers["Cache-Control"] == "no-store"
    assert refused.headers["Retry-After"] == "60"
    assert refused.headers["RateLimit-Policy"] == '"minute";q=3;w=60'
    assert refused.headers["RateLimit"] == '"minute";r=0;t=60'
    assert int(refused.headers["Content-Length"]) == len(refused.data)
    assert json.loads(refused.data) == {"detail": "Too Many Requests", "retry_after": 60}
    assert "X-App" not in refused.headers  # the app did not run


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


def test_headers_false_leaves_admitted_responses_alone_but_not_the_429(
    limiter: rl.Limiter,
) -> None:
    c = client(echo_app, limiter, default="1/minute", headers=False)
    admitted, refused = c.get("/"), c.get("/")
    assert "RateLimit" not in admitted.headers
    assert "RateLimit-Policy" not in admitted.headers
    assert refused.status_code == 429
    assert refused.headers["RateLimit"] == '"minute";r=0;t=60'
    assert refused.headers["Retry-After"] == "60"


def test_legacy_headers_are_added_on_request(limiter: rl.Limiter) -> None:
    c = client(echo_app, limiter, default="2/minute", legacy_headers=True)
    admitted = c.get("/")
    c.get("/")
    refused = c.get("/")
    assert (admitted.headers["X-RateLimit-Limit"], admitted.headers["X-RateLimit-Remaining"],
            admitted.headers["X-RateLimit-Reset"]) == ("2", "1", "60")
    assert (refused.headers["X-RateLimit-Remaining"], refused.headers["X-RateLimit-Reset"]) == (
        "0", "60")
    assert "X-RateLimit-Limit" not in client(echo_app, limiter, default="2/minute").get(
        "/").headers


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


def test_rules_add_to_the_default_and_both_show_in_the_policy_header(
    limiter: rl.Limiter,
) -> None:
    c = client(echo_app, limiter, default="10/minute",
               rules={"/api/*": rl.Policy("2/second", name="api")})
    response = c.get("/api/x")
    assert response.headers["RateLimit-Policy"] == '"minute";q=10;w=60, "second";q=2;w=1'
    assert response.headers["RateLimit"] == '"second";r=1;t=1'
    c.get("/api/y")
    refused = c.get("/api/z")
    assert refused.status_code == 429
    assert refused.headers["RateLimit"] == '"second";r=0;t=1'
    assert c.get("/elsewhere").status_code == 200  # the refusal consumed nothing


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

    c = client(echo_app, memory_limiter(), default="5/minute",
               rules=[Rule("/*", "5/minute", key=key)], key=key)
    c.get("/x")
    assert len(seen) == 2
    assert isinstance(seen[0], Request)
    assert seen[0] is seen[1]
    assert seen[0].path == "/x"


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
def test_backend_down_with_allow_admits_without_headers_and_logs_once(
    down_backend: rl.RedisBackend, caplog: pytest.LogCaptureFixture
) -> None:
    c = client(echo_app, rl.Limiter(down_backend), default="1/minute",
               backend_cooldown=0)
    with caplog.at_level(logging.WARNING, logger="ratelimit_mw"):
        responses = [c.get("/") for _ in range(4)]
    assert [r.status_code for r in responses] == [200] * 4
    assert all("RateLimit" not in r.headers for r in responses)
    assert all(json.loads(r.data)["remaining"] is None for r in responses)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # throttled: not one line per request
    assert "BackendError" in warnings[0].getMessage() or "Redis" in warnings[0].getMessage()


def test_backend_down_with_deny_answers_503_with_retry_after(
    down_backend: rl.RedisBackend,
) -> None:
    c = client(echo_app, rl.Limiter(down_backend), default="1/minute",
               on_backend_error="deny", backend_cooldown=2.5)
    response = c.get("/")
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "3"
    assert response.headers["Cache-Control"] == "no-store"
    assert response.headers["Content-Type"] == "application/json"
    assert json.loads(response.data) == {"detail": "Rate limiter unavailable", "retry_after": 3}


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


def test_during_the_cool_down_the_backend_is_not_called_at_all(
    down_backend: rl.RedisBackend,
) -> None:
    counting = CountingBackend(down_backend)
    middleware = RateLimitMiddleware(echo_app, rl.Limiter(counting), default="1/minute",
                                     on_backend_error="deny", backend_cooldown=60)
    c = ServerClient(middleware)
    statuses = [c.get("/").status_code for _ in range(5)]
    assert statuses == [503] * 5
    assert counting.calls == 1
    middleware.core.breaker.reset()  # the cool-down is over
    c.get("/")
    assert counting.calls == 2


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


def test_the_backend_is_used_again_once_it_answers(limiter: rl.Limiter) -> None:
    # A failure, then the real backend behind the same middleware once the cool-down ends.
    flaky = CountingBackend(limiter.backend)
    broken = [True]

    def run(call: Any) -> list[int]:
        if broken[0]:
            raise BackendError("down")
        return flaky.run(call)

    flaky_backend = FailingBackend(BackendError("down"))
    flaky_backend.run = run  # type: ignore[method-assign]
    shell = rl.Limiter(flaky_backend, prefix=limiter.prefix, clock=limiter.clock)
    middleware = RateLimitMiddleware(echo_app, shell, default="1/minute", backend_cooldown=60)
    c = ServerClient(middleware)
    assert "RateLimit" not in c.get("/").headers
    broken[0] = False
    middleware.core.breaker.reset()
    assert c.get("/").headers["RateLimit"] == '"minute";r=0;t=60'
    assert c.get("/").status_code == 429


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
def test_shadow_mode_counts_and_reports_but_never_refuses(limiter: rl.Limiter) -> None:
    refusals: list[rl.Decision] = []
    c = client(echo_app, limiter, default="2/minute", mode="shadow",
               on_refusal=lambda request, decision: refusals.append(decision))
    responses = [c.get("/") for _ in range(4)]
    assert [r.status_code for r in responses] == [200] * 4
    assert [r.headers["RateLimit"] for r in responses] == [
        '"minute";r=1;t=60', '"minute";r=0;t=60', '"minute";r=0;t=60', '"minute";r=0;t=60']
    # Served anyway: no Retry-After telling the client to back off from what it just got.
    assert all("Retry-After" not in r.headers for r in responses)
    assert len(refusals) == 2
    assert not refusals[0].allowed
    assert limiter.peek(rl.Policy("2/minute"), PEER).remaining == 0


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


def test_on_blocked_renders_the_refusal_and_keeps_the_rate_limit_headers(
    limiter: rl.Limiter,
) -> None:
    def blocked(request: Any, decision: rl.Decision) -> Response:
        return Response(f"slow down, {decision.retry_after:.0f}s", status=429,
                        headers={"Retry-After": "999"}, content_type="text/plain")

    c = client(echo_app, limiter, default="1/minute", on_blocked=blocked)
    c.get("/")
    refused = c.get("/")
    assert refused.status_code == 429
    assert refused.data == b"slow down, 60s"
    assert refused.headers["Retry-After"] == "999"  # the handler's own value wins
    assert refused.headers["RateLimit"] == '"minute";r=0;t=60'
    assert refused.headers["Cache-Control"] == "no-store"


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


def test_count_when_gives_back_the_hits_of_responses_that_should_not_count(
    limiter: rl.Limiter,
) -> None:
    c = client(login_app, limiter, default="2/minute", count_when=lambda s: s >= 400)
    successes = [c.get("/?password=right").status_code for _ in range(5)]
    failures = [c.get("/?password=wrong").status_code for _ in range(2)]
    assert successes == [200] * 5
    assert failures == [401, 401]
    assert c.get("/?password=right").status_code == 429


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

        def run(self, call: Any) -> list[int]:
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
    middleware.core.breaker.trip()  # the backend failed meanwhile
    body.close()  # type: ignore[attr-defined]
    assert counting.calls == 1  # the hit, and no refund call
    middleware.core.breaker.reset()
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
