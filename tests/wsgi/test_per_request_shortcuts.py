"""What the per-request shortcuts must not change.

The WSGI middleware hands key functions a werkzeug Request that is parsed on first use, picks
the policies once when there are no path rules, and the Flask extension picks them once per
endpoint; `keys.client_ip()` without trusted proxies remembers the key of recent peers. Each
must give exactly what the long way gives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from flask import Flask
from werkzeug.test import EnvironBuilder
from werkzeug.wrappers import Request
from wsgi_support import Environ, ServerClient, echo_app

import ratelimit_mw as rl
from ratelimit_mw import keys
from ratelimit_mw.flask import RateLimit
from ratelimit_mw.keys.client_ip import ip_key, resolve_client
from ratelimit_mw.wsgi import DECISION_KEY, RateLimitMiddleware, Rule

PARSED = ("method", "scheme", "server", "root_path", "path", "query_string", "remote_addr",
          "shallow", "url", "base_url", "host", "args", "full_path", "content_type")


def built(path: str, **kwargs: Any) -> Environ:
    kwargs.setdefault("environ_base", {"REMOTE_ADDR": "192.0.2.7"})
    return EnvironBuilder(path, **kwargs).get_environ()


ENVIRONS = {
    "plain": built("/"),
    "query and headers": built("/a/b?x=1&y=%20", method="POST",
                               headers={"X-Api-Key": "k", "User-Agent": "ua/1"}),
    "mounted": built("/x", base_url="https://example.test:8443/root/"),
    "non-ascii path": built("/caf\u00e9/\u2603"),
    "no peer": built("/", environ_base={}),
}


def discard(status: str, headers: list[tuple[str, str]],
            exc_info: Any = None) -> Callable[[bytes], object]:
    return lambda data: None


def seen_by_key_function(environ: Environ) -> Any:
    seen: list[Any] = []

    def key(request: Any) -> str:
        seen.append(request)
        return "k"

    middleware = RateLimitMiddleware(echo_app, rl.Limiter(), default="5/minute", key=key)
    body = middleware(environ, discard)
    list(body)
    assert len(seen) == 1
    return seen[0]


# -- the request the WSGI middleware hands over --------------------------------------------
@pytest.mark.parametrize("name", ENVIRONS)
def test_the_request_reads_exactly_what_a_werkzeug_request_reads(name: str) -> None:
    environ = ENVIRONS[name]
    request = seen_by_key_function(dict(environ))
    reference = Request(dict(environ))
    assert isinstance(request, Request)
    for attribute in PARSED:
        assert getattr(request, attribute) == getattr(reference, attribute), attribute
    assert dict(request.headers) == dict(reference.headers)
    assert request.user_agent.string == reference.user_agent.string


def test_the_request_is_registered_in_the_environ_as_werkzeug_does() -> None:
    environ = built("/")
    request = seen_by_key_function(environ)
    assert environ["werkzeug.request"] is request
    assert request.environ is environ


def test_what_a_key_function_sets_before_the_request_is_parsed_survives_parsing() -> None:
    made: list[str] = []

    def key(request: Any) -> str:
        request.method = "OVERRIDDEN"
        request.tenant = "t1"
        made.append(f"{request.tenant}:{request.path}:{request.method}:{request.args['q']}")
        return made[-1]

    middleware = RateLimitMiddleware(echo_app, rl.Limiter(), default="1/minute", key=key)
    list(middleware(built("/p?q=1"), discard))
    assert made == ["t1:/p:OVERRIDDEN:1"]


def test_an_unknown_attribute_is_an_attribute_error_and_hasattr_says_so() -> None:
    request = seen_by_key_function(built("/"))
    assert not hasattr(request, "scope")  # keys.py tells WSGI from ASGI by this
    with pytest.raises(AttributeError):
        _ = request.no_such_attribute


# -- policies chosen once ------------------------------------------------------------------
def test_without_rules_every_path_and_method_shares_the_default() -> None:
    c = ServerClient(RateLimitMiddleware(echo_app, rl.Limiter(), default="3/minute"))
    answers = [c.get("/a"), c.post("/b"), c.open("/c\u00e9", method="PUT")]
    assert [r.status_code for r in answers] == [200, 200, 200]
    assert [r.headers["RateLimit"] for r in answers] == [
        '"minute";r=2;t=60', '"minute";r=1;t=60', '"minute";r=0;t=60'
    ]
    assert c.get("/d").status_code == 429


def test_with_rules_the_path_still_chooses_the_policies() -> None:
    middleware = RateLimitMiddleware(echo_app, rl.Limiter(), rules=[Rule("/api/*", "1/minute")])
    c = ServerClient(middleware)
    assert [c.get("/api/x").status_code, c.get("/api/x").status_code] == [200, 429]
    other = c.get("/other")
    assert other.status_code == 200
    assert "RateLimit" not in other.headers
    environ = built("/other")
    list(middleware(environ, discard))
    assert environ[DECISION_KEY] is None


def two_paths_one_view() -> Flask:
    app = Flask(__name__)

    @app.route("/first/<int:n>")
    @app.route("/second/<int:n>")
    def view(n: int) -> str:
        return str(n)

    return app


def test_flask_one_endpoint_under_two_rules_keeps_a_route_template_per_rule() -> None:
    app = two_paths_one_view()
    key = keys.compose(keys.client_ip(), keys.route())
    RateLimit(app, limiter=rl.Limiter(), default="1/minute", key=key)
    c = app.test_client()
    assert [c.get("/first/1").status_code, c.get("/first/2").status_code] == [200, 429]
    assert [c.get("/second/1").status_code, c.get("/second/2").status_code] == [200, 429]


def test_flask_path_rules_still_tell_apart_paths_of_one_endpoint() -> None:
    app = two_paths_one_view()
    RateLimit(app, limiter=rl.Limiter(), rules={"/second/*": "1/minute"})
    c = app.test_client()
    assert [c.get("/first/1").status_code for _ in range(3)] == [200] * 3
    assert "RateLimit" not in c.get("/first/1").headers
    assert [c.get("/second/1").status_code, c.get("/second/2").status_code] == [200, 429]


def test_flask_unmatched_paths_share_the_default_after_the_first() -> None:
    app = two_paths_one_view()
    RateLimit(app, limiter=rl.Limiter(), default="2/minute")
    c = app.test_client()
    assert [c.get("/nowhere").status_code, c.get("/elsewhere").status_code] == [404, 404]
    refused = c.get("/first/1")
    assert refused.status_code == 429


# -- client_ip's peer cache ----------------------------------------------------------------
PEERS: list[object] = [
    "192.0.2.1", " 192.0.2.1 ", "::ffff:192.0.2.1", "2001:db8:1:2::99", "2001:DB8:1:2:0:0:0:1",
    "fe80::1%eth0", "fe80::1%" + "x" * 80, "::1", "testclient", "", "unix:/tmp/s", "1.2.3",
    "192.0.2.1:80", "\u0661.2.3.4", None, 42, ("192.0.2.1",), "9" * 100,
]


def uncached(peer: object, prefix: int) -> str:
    addr = resolve_client(peer if isinstance(peer, str) else None, None, None, None)
    return "ip:unknown" if addr is None else "ip:" + ip_key(addr, prefix)


class WSGIRequest:
    def __init__(self, peer: object) -> None:
        self.environ = {"REMOTE_ADDR": peer}


class ASGIRequest:
    def __init__(self, peer: object) -> None:
        self.scope = {"client": (peer, 1234)}


@pytest.mark.parametrize("prefix", [64, 128, 48])
@pytest.mark.parametrize("make", [WSGIRequest, ASGIRequest])
def test_client_ip_gives_the_uncached_key_first_and_every_later_time(
    make: type, prefix: int
) -> None:
    key = keys.client_ip(ipv6_prefix=prefix)
    for _ in range(3):
        assert [key(make(peer)) for peer in PEERS] == [uncached(p, prefix) for p in PEERS]


def test_client_ip_cache_stays_bounded_and_right_under_a_flood_of_peers() -> None:
    key = keys.client_ip()
    peers = [f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}" for i in range(10_000)]
    assert [key(WSGIRequest(p)) for p in peers] == ["ip:" + p for p in peers]
    assert len(key._by_peer) <= 4096  # type: ignore[attr-defined]
    assert key(WSGIRequest(peers[0])) == "ip:" + peers[0]


def test_client_ip_with_trusted_proxies_still_reads_the_headers_every_time() -> None:
    key = keys.client_ip(trusted_proxies=["10.0.0.0/8"])
    request = WSGIRequest("10.0.0.1")
    request.environ["HTTP_X_FORWARDED_FOR"] = "203.0.113.5"
    assert key(request) == "ip:203.0.113.5"
    request.environ["HTTP_X_FORWARDED_FOR"] = "203.0.113.6"
    assert key(request) == "ip:203.0.113.6"
