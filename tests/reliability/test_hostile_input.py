"""Hostile input through the ASGI and WSGI middleware (hypothesis).

Clients control the path, the method and every header: ``X-Forwarded-For``, ``Forwarded``,
the API-key and user headers that key functions read. Hypothesis sends garbage, huge values,
non-ASCII, control characters, braces, colons and percent-escapes at a real app on a real
Redis (a private server, and the cluster), and then:

- no exception escapes the middleware (the test clients re-raise them) and nothing answers
  5xx (the middleware runs with ``on_backend_error="deny"``, so a failed Redis call, e.g. a
  CROSSSLOT on the cluster, would show as a 503);
- every key written is at most 200 bytes, carries a TTL, and its hash tag is exactly the
  encoding of one identity a key function returned (``_keyenc.encode_identity``): the
  cluster slot depends on the identity alone and no client text escapes the tag;
- no two different identities share a key (``_keyenc.identity_head`` is injective on
  everything the key functions produced);
- a spoofed ``X-Forwarded-For`` / ``Forwarded`` never changes the client-IP key: without
  trusted proxies, and with trusted proxies the peer is not one of, the key is the peer.
"""

from __future__ import annotations

import os
import string
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import redis.cluster
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient
from werkzeug.test import EnvironBuilder, run_wsgi_app

import ratelimit_mw as rl
from ratelimit_mw import asgi, keys, wsgi
from ratelimit_mw.core.identity import encode_identity, identity_head
from reliability._apps import wsgi_app
from reliability._support import PrivateRedis

pytestmark = pytest.mark.slow

PEER = "192.0.2.10"
PEER_KEY = f"ip:{PEER}"
EXAMPLES = int(os.environ.get("RATELIMIT_HOSTILE_EXAMPLES", "120"))


class Recording:
    """A key function that remembers every identity it hands to the limiter."""

    def __init__(self, name: str, key: Any, sink: set[tuple[str, str]]) -> None:
        self.name = name
        self.key = key
        self.sink = sink

    def __call__(self, request: Any) -> str | None:
        identity: str | None = self.key(request)
        if identity is not None:
            self.sink.add((self.name, identity))
        return identity


def _policies() -> dict[str, rl.Policy]:
    return {
        "default": rl.Policy("1000/hour", name="default"),
        "api": rl.Policy("1000/hour;5000/day", algorithm="sliding-window", name="api"),
        "tight": rl.Policy("2/hour", algorithm="fixed-window", name="tight",
                           penalty="1 minute"),
        "trusted": rl.Policy("1000/hour", algorithm="gcra", name="trusted"),
        "user": rl.Policy("1000/hour", name="user"),
    }


def _rules(policies: dict[str, rl.Policy], sink: set[tuple[str, str]]) -> list[Any]:
    return [
        asgi.Rule("/api/*", policies["api"],
                  key=Recording("api", keys.header("X-Api-Key"), sink)),
        asgi.Rule("/tight/*", policies["tight"],
                  key=Recording("tight", keys.header("X-Api-Key", required=True), sink)),
        asgi.Rule("/trusted/*", policies["trusted"],
                  key=Recording("trusted", keys.client_ip(trusted_proxies=["10.0.0.0/8"]),
                                sink)),
    ]


# -- what hostile clients send ---------------------------------------------------------------
_nasty_text = st.one_of(
    st.text(max_size=40),
    st.text(alphabet="{}:#%/.,;=\"' \t\\", max_size=40),
    st.text(alphabet=st.characters(codec="latin-1"), max_size=300),
    st.builds(lambda c, n: c * n, st.sampled_from("a{}:é#"), st.integers(60, 12_000)),
    st.sampled_from(["", " ", "unknown", "_hidden", "for=", 'for="[::1]:80"', "1.2.3.4, ",
                     "::ffff:10.0.0.1", "10.0.0.1, 203.0.113.5", "{x}", "}{", "#", ":::",
                     "for=10.0.0.1;proto=http, for=198.51.100.7"]),
)
# Header values as bytes: latin-1 covers every byte a server can pass on; UTF-8 for the
# non-ASCII clients actually send.
header_values = st.one_of(
    _nasty_text.map(lambda s: s.encode("latin-1", "replace")),
    _nasty_text.map(lambda s: s.encode("utf-8", "surrogatepass")),
    st.binary(max_size=200),
)
_segment = st.one_of(
    st.text(alphabet=string.ascii_letters + string.digits + "{}:#@=+-._~", max_size=20),
    st.binary(max_size=30).map(lambda b: urllib.parse.quote(b, safe="")),
    st.text(max_size=15).map(lambda s: urllib.parse.quote(s.encode("utf-8", "surrogatepass"),
                                                          safe="")),
    st.builds(lambda n: "x" * n, st.integers(100, 3000)),
)


def _path(head: str, segments: list[str]) -> str:
    path = head + "/".join(segments)
    # A leading "//" reads as a URL authority to the HTTP client; raw scopes send those.
    return "/x" + path if path.startswith("//") else path


paths = st.builds(
    _path,
    st.sampled_from(["/", "/api/", "/tight/", "/trusted/", "/items/", "/items/{x}/", "/x//"]),
    st.lists(_segment, max_size=4),
)
HEADER_NAMES = ["x-forwarded-for", "forwarded", "x-api-key", "x-user"]
header_sets = st.dictionaries(st.sampled_from(HEADER_NAMES), header_values, max_size=4)


# -- stores ----------------------------------------------------------------------------------
class Store:
    def __init__(self, url: str, client: Any) -> None:
        self.url = url
        self.client = client

    def keys(self, prefix: str) -> list[bytes]:
        return list(self.client.scan_iter(match=f"{prefix}:*", count=1000))


@pytest.fixture(params=["redis", "cluster"])
def store(request: pytest.FixtureRequest,
          private_redis: Callable[..., PrivateRedis]) -> Iterator[Store]:
    if request.param == "cluster":
        url = request.getfixturevalue("redis_cluster_url")
        client: Any = redis.cluster.RedisCluster.from_url(url.replace("+cluster", ""))
    else:
        server = private_redis()
        url = server.url
        client = server.client()
    yield Store(url, client)
    client.close()


def _check_store(store: Store, prefix: str, seen: set[tuple[str, str]]) -> None:
    identities = {identity for _, identity in seen}
    # Injective: as many distinct heads as distinct identities.
    heads = {identity_head(prefix, identity) for identity in identities}
    assert len(heads) == len(identities)
    tags = {encode_identity(identity) for identity in identities}
    written = store.keys(prefix)
    assert written, "the run wrote nothing: the test would prove nothing"
    for raw in written:
        assert len(raw) <= 200, raw
        key = raw.decode("ascii")  # every key is plain ASCII, whatever the client sent
        start = key.index("{")
        tag = key[start + 1:key.index("}", start)]
        assert key.startswith(f"{prefix}:{{") and tag in tags, key
        assert store.client.pttl(raw) > 0, key  # every key expires
    # A spoofed X-Forwarded-For / Forwarded never moved the client-IP key.
    assert {i for name, i in seen if name in ("default", "trusted")} == {PEER_KEY}


# -- ASGI ------------------------------------------------------------------------------------
def _asgi_stack(url: str, prefix: str, sink: set[tuple[str, str]]) -> tuple[Any, Any]:
    backend = rl.AsyncRedisBackend.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    limiter = rl.AsyncLimiter(backend, prefix=prefix)
    policies = _policies()

    async def endpoint(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    @limiter.limit(policies["user"], key=Recording("user", keys.header("X-User"), sink))
    async def item(request: Request) -> JSONResponse:
        return JSONResponse({"item": request.path_params["item_id"]})

    app = Starlette(routes=[
        Route("/items/{item_id}", item, methods=["GET", "POST"]),
        Route("/{path:path}", endpoint, methods=["GET", "POST", "PUT", "DELETE", "PATCH"]),
    ])
    mw = asgi.RateLimitMiddleware(
        app, limiter, default=policies["default"], rules=_rules(policies, sink),
        key=Recording("default", keys.client_ip(), sink), on_backend_error="deny",
        backend_timeout=5.0,
    )
    return mw, backend


def test_hostile_requests_through_the_asgi_middleware(store: Store) -> None:
    prefix = "trel" + uuid.uuid4().hex[:10]
    seen: set[tuple[str, str]] = set()
    mw, backend = _asgi_stack(store.url, prefix, seen)
    statuses: set[int] = set()

    with TestClient(mw, client=(PEER, 50000)) as client:

        @settings(max_examples=EXAMPLES, deadline=None,
                  suppress_health_check=[HealthCheck.too_slow])
        @given(method=st.sampled_from(["GET", "POST", "DELETE"]), path=paths,
               headers=header_sets)
        def one(method: str, path: str, headers: dict[str, bytes]) -> None:
            response = client.request(method, path, headers=headers)
            assert response.status_code < 500, (path, headers, response.text)
            statuses.add(response.status_code)

        one()

        # Below the HTTP client: a raw ASGI scope with any path text and any header bytes.
        @settings(max_examples=EXAMPLES, deadline=None,
                  suppress_health_check=[HealthCheck.too_slow])
        @given(method=st.sampled_from(["GET", "POST", "BREW", ""]),
               path=st.text(max_size=300).map(lambda s: "/" + s),
               raw=st.lists(st.tuples(st.sampled_from(HEADER_NAMES).map(str.encode),
                                      header_values), max_size=6))
        def raw_scope(method: str, path: str, raw: list[tuple[bytes, bytes]]) -> None:
            status = client.portal.call(_call_asgi, mw, method, path, raw)
            assert status < 500, (method, path, raw)

        raw_scope()
        # After the storm the limits are still in force, refusals included.
        after = [client.get("/tight/x", headers={"x-api-key": "after-the-storm"}).status_code
                 for _ in range(3)]
        client.portal.call(backend.aclose)

    assert 200 in statuses
    assert after == [200, 200, 429]
    _check_store(store, prefix, seen)


async def _call_asgi(app: Any, method: str, path: str, raw: list[tuple[bytes, bytes]]) -> int:
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
        "method": method, "scheme": "http", "path": path,
        "raw_path": path.encode("utf-8", "surrogatepass"), "root_path": "",
        "query_string": b"", "headers": raw, "client": (PEER, 50000),
        "server": ("testserver", 80),
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert len(starts) == 1
    return int(starts[0]["status"])


# -- WSGI ------------------------------------------------------------------------------------
def test_hostile_requests_through_the_wsgi_middleware(store: Store) -> None:
    prefix = "trel" + uuid.uuid4().hex[:10]
    seen: set[tuple[str, str]] = set()
    backend = rl.RedisBackend.from_url(store.url, socket_timeout=5, socket_connect_timeout=5)
    policies = _policies()
    mw = wsgi.RateLimitMiddleware(
        wsgi_app, rl.Limiter(backend, prefix=prefix), default=policies["default"],
        rules=[*_rules(policies, seen),
               wsgi.Rule("/items/*", policies["user"],
                         key=Recording("user", keys.header("X-User"), seen))],
        key=Recording("default", keys.client_ip(), seen), on_backend_error="deny",
    )
    statuses: set[int] = set()

    @settings(max_examples=EXAMPLES * 2, deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(method=st.sampled_from(["GET", "POST", "BREW", ""]),
           path=st.one_of(paths, st.text(alphabet=st.characters(codec="latin-1"),
                                         max_size=300).map(lambda s: "/" + s)),
           headers=header_sets)
    def one(method: str, path: str, headers: dict[str, bytes]) -> None:
        environ = EnvironBuilder(method=method or "GET").get_environ()
        # What a WSGI server hands over: PATH_INFO and headers as latin-1 text (PEP 3333).
        environ["REQUEST_METHOD"] = method
        environ["PATH_INFO"] = path
        environ["REMOTE_ADDR"] = PEER
        for name, value in headers.items():
            environ["HTTP_" + name.upper().replace("-", "_")] = value.decode("latin-1")
        body, status, _ = run_wsgi_app(mw, environ, buffered=True)
        b"".join(body)
        code = int(status.split()[0])
        assert code < 500, (path, headers, status)
        statuses.add(code)

    one()
    after = []
    for _ in range(3):
        environ = EnvironBuilder(path="/tight/x", headers={"X-Api-Key": "after-the-storm"},
                                 environ_base={"REMOTE_ADDR": PEER}).get_environ()
        _, status, _ = run_wsgi_app(mw, environ, buffered=True)
        after.append(int(status.split()[0]))
    backend.close()
    assert 200 in statuses
    assert after == [200, 200, 429]  # after the storm the limits are still in force
    _check_store(store, prefix, seen)
