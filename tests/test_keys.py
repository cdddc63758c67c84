"""Key functions against real Starlette (ASGI) and Werkzeug/Flask (WSGI) request objects.

Each table row runs under both kinds of request: a key function must give the same identity
for the same HTTP request whichever server stack delivered it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import flask
import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.authentication import BaseUser, SimpleUser, UnauthenticatedUser
from starlette.requests import Request as StarletteRequest
from werkzeug.test import EnvironBuilder
from werkzeug.wrappers import Request as WerkzeugRequest

from ratelimit_mw import keys
from ratelimit_mw.core.errors import ConfigurationError

Headers = list[tuple[str, str]]


def asgi_request(
    peer: str | None = "203.0.113.9",
    headers: Sequence[tuple[str, str]] = (),
    extra: dict[str, Any] | None = None,
    path: str = "/items/42",
) -> StarletteRequest:
    scope: dict[str, Any] = {
        "type": "http",
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        # ASGI: lower-case names, raw bytes; the server keeps repeated lines separate.
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
        "client": None if peer is None else (peer, 50123),
        "server": ("testserver", 80),
    }
    scope.update(extra or {})
    return StarletteRequest(scope)


def wsgi_request(
    peer: str | None = "203.0.113.9",
    headers: Sequence[tuple[str, str]] = (),
    extra: dict[str, Any] | None = None,
    path: str = "/items/42",
) -> WerkzeugRequest:
    environ = EnvironBuilder(path=path).get_environ()
    environ.pop("REMOTE_ADDR", None)
    if peer is not None:
        environ["REMOTE_ADDR"] = peer
    for name, value in headers:
        key = "HTTP_" + name.upper().replace("-", "_")
        # What WSGI servers do with repeated header lines: join them with commas.
        environ[key] = f"{environ[key]},{value}" if key in environ else value
    environ.update(extra or {})
    return WerkzeugRequest(environ)


BOTH = pytest.mark.parametrize("make", [asgi_request, wsgi_request], ids=["asgi", "wsgi"])
Make = Callable[..., Any]


def test_public_surface() -> None:
    assert set(keys.__all__) >= {"KeyFunc", "client_ip", "header", "user", "route", "compose"}
    func: keys.KeyFunc = keys.client_ip()
    assert callable(func)


# --- client_ip ---------------------------------------------------------------------------

NETS = ["10.0.0.0/8", "::1"]

# (id, trusted_proxies, ipv6_prefix, peer, headers, expected key)
CLIENT_IP_CASES: list[tuple[str, Any, int, str | None, Headers, str]] = [
    ("peer", None, 64, "203.0.113.9", [], "ip:203.0.113.9"),
    (
        "spoofed XFF ignored without trust",
        None,
        64,
        "203.0.113.9",
        [("X-Forwarded-For", "198.51.100.66")],
        "ip:203.0.113.9",
    ),
    (
        "spoofed Forwarded ignored without trust",
        None,
        64,
        "203.0.113.9",
        [("Forwarded", "for=198.51.100.66")],
        "ip:203.0.113.9",
    ),
    (
        "trusted proxy: XFF walked from the right",
        NETS,
        64,
        "10.0.0.5",
        [("X-Forwarded-For", "198.51.100.66, 203.0.113.9, 10.0.0.7")],
        "ip:203.0.113.9",
    ),
    (
        "untrusted peer: XFF ignored",
        NETS,
        64,
        "192.0.2.50",
        [("X-Forwarded-For", "203.0.113.9")],
        "ip:192.0.2.50",
    ),
    (
        "Forwarded preferred over XFF",
        NETS,
        64,
        "10.0.0.5",
        [("X-Forwarded-For", "198.51.100.66"), ("Forwarded", 'for="[2001:db8::9]:443"')],
        "ip:2001:db8::/64",
    ),
    (
        "repeated XFF lines are one list",
        NETS,
        64,
        "10.0.0.5",
        [("X-Forwarded-For", "198.51.100.66"), ("X-Forwarded-For", "203.0.113.9")],
        "ip:203.0.113.9",
    ),
    (
        "repeated Forwarded lines are one list",
        NETS,
        64,
        "10.0.0.5",
        [("Forwarded", "for=198.51.100.66"), ("Forwarded", "for=203.0.113.9;proto=https")],
        "ip:203.0.113.9",
    ),
    (
        "hop count",
        1,
        64,
        "172.17.0.1",
        [("X-Forwarded-For", "198.51.100.66, 203.0.113.9")],
        "ip:203.0.113.9",
    ),
    ("hop count, no header → peer", 1, 64, "172.17.0.1", [], "ip:172.17.0.1"),
    (
        "hop count without a peer (Unix socket)",
        1,
        64,
        None,
        [("X-Forwarded-For", "203.0.113.9")],
        "ip:203.0.113.9",
    ),
    ("IPv6 grouped by /64", None, 64, "2001:db8:1:2:aaaa::1", [], "ip:2001:db8:1:2::/64"),
    ("IPv6 grouped by /48", None, 48, "2001:db8:1:2:aaaa::1", [], "ip:2001:db8:1::/48"),
    ("IPv6 per address", None, 128, "2001:db8:1:2:aaaa::1", [], "ip:2001:db8:1:2:aaaa::1"),
    ("IPv4-mapped peer", None, 64, "::ffff:203.0.113.9", [], "ip:203.0.113.9"),
    ("no peer", None, 64, None, [], "ip:unknown"),
    ("non-IP peer", None, 64, "testclient", [], "ip:unknown"),
    (
        "no peer with networks: headers not believed",
        NETS,
        64,
        None,
        [("X-Forwarded-For", "203.0.113.9")],
        "ip:unknown",
    ),
    (
        "garbage header → last trusted hop",
        NETS,
        64,
        "10.0.0.5",
        [("X-Forwarded-For", "203.0.113.9, \x00bogus\x7f")],
        "ip:10.0.0.5",
    ),
]


@BOTH
@pytest.mark.parametrize(
    ("trusted", "prefix", "peer", "headers", "expected"),
    [pytest.param(*case[1:], id=case[0]) for case in CLIENT_IP_CASES],
)
def test_client_ip(
    make: Make, trusted: Any, prefix: int, peer: str | None, headers: Headers, expected: str
) -> None:
    key = keys.client_ip(trusted_proxies=trusted, ipv6_prefix=prefix)
    assert key(make(peer, headers)) == expected


@BOTH
def test_client_ip_same_slash_64_is_one_bucket(make: Make) -> None:
    key = keys.client_ip()
    assert key(make("2001:db8:1:2::1")) == key(make("2001:db8:1:2:ffff:ffff:ffff:ffff"))
    assert key(make("2001:db8:1:2::1")) != key(make("2001:db8:1:3::1"))


@pytest.mark.parametrize(
    ("kwargs", "expected_in_message"),
    [
        ({"trusted_proxies": "10.0.0.0/8"}, "trusted_proxies=['10.0.0.0/8']"),
        ({"trusted_proxies": ["10.0.0.1/8"]}, "'10.0.0.0/8'"),
        ({"trusted_proxies": -1}, "trusted_proxies=1"),
        ({"ipv6_prefix": 129}, "ipv6_prefix=64"),
        ({"ipv6_prefix": -1}, "ipv6_prefix=64"),
        ({"ipv6_prefix": True}, "ipv6_prefix=64"),
        ({"ipv6_prefix": "64"}, "ipv6_prefix=64"),
    ],
)
def test_client_ip_bad_configuration(kwargs: dict[str, Any], expected_in_message: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        keys.client_ip(**kwargs)
    assert expected_in_message in str(info.value)


def test_client_ip_repr() -> None:
    assert repr(keys.client_ip()) == "keys.client_ip()"
    assert (
        repr(keys.client_ip(("10.0.0.0/8",), ipv6_prefix=56))
        == "keys.client_ip(trusted_proxies=['10.0.0.0/8'], ipv6_prefix=56)"
    )
    assert repr(keys.client_ip(2)) == "keys.client_ip(trusted_proxies=2)"


def test_client_ip_does_not_use_starlette_request_client() -> None:
    # A malformed client entry from an odd server must not raise.
    request = asgi_request(extra={"client": 12345})
    assert keys.client_ip()(request) == "ip:unknown"


# --- header ------------------------------------------------------------------------------

# (id, factory kwargs, request headers, expected key)
HEADER_CASES: list[tuple[str, dict[str, Any], Headers, str | None]] = [
    ("present", {}, [("X-Api-Key", "k-123")], "h:x-api-key:k-123"),
    ("name is case-insensitive", {"name": "X-API-KEY"}, [("x-api-key", "k")], "h:x-api-key:k"),
    ("missing → policy does not apply", {}, [], None),
    ("empty → policy does not apply", {}, [("X-Api-Key", "")], None),
    ("required, missing → one shared bucket", {"required": True}, [], "h:x-api-key"),
    ("required, present", {"required": True}, [("X-Api-Key", "k")], "h:x-api-key:k"),
    ("value kept verbatim", {}, [("X-Api-Key", "a:b|c d")], "h:x-api-key:a:b|c d"),
]


@BOTH
@pytest.mark.parametrize(
    ("kwargs", "headers", "expected"),
    [pytest.param(*case[1:], id=case[0]) for case in HEADER_CASES],
)
def test_header(make: Make, kwargs: dict[str, Any], headers: Headers, expected: str | None) -> None:
    kwargs = {"name": "X-Api-Key", **kwargs}
    key = keys.header(kwargs.pop("name"), **kwargs)
    assert key(make(headers=headers)) == expected


def test_header_required_bucket_cannot_be_reached_by_a_value() -> None:
    # Every present value keys as "h:<name>:..." — with the colon — so no client can land
    # in (or escape to) the bucket of the requests that sent no header.
    key = keys.header("X-Api-Key", required=True)
    missing = key(asgi_request())
    assert missing == "h:x-api-key"
    for value in [":", " ", "x", "h:x-api-key"]:
        assert key(asgi_request(headers=[("X-Api-Key", value)])) != missing


@pytest.mark.parametrize("name", ["", "X Api", "X:Api", "é", "X-Api\r\n", None, 42])
def test_header_bad_name(name: Any) -> None:
    with pytest.raises(ConfigurationError, match=re.escape('keys.header("X-Api-Key")')):
        keys.header(name)


def test_header_repr() -> None:
    assert repr(keys.header("X-Api-Key")) == "keys.header('x-api-key')"
    assert (
        repr(keys.header("X-Api-Key", required=True)) == "keys.header('x-api-key', required=True)"
    )


# --- user --------------------------------------------------------------------------------


class DisplayOnlyUser(BaseUser):
    """A user class that does not implement identity (BaseUser's raises)."""

    @property
    def is_authenticated(self) -> bool:
        return True

    @property
    def display_name(self) -> str:
        return "Dana"


class BrokenUser(BaseUser):
    """Every property raises: still no exception out of the key function."""


# (id, ASGI scope extras, expected key)
ASGI_USER_CASES: list[tuple[str, dict[str, Any], str | None]] = [
    ("authenticated user → identity", {"user": SimpleUser("ann")}, "user:ann"),
    ("identity not implemented → display_name", {"user": DisplayOnlyUser()}, "user:Dana"),
    ("unauthenticated → None", {"user": UnauthenticatedUser()}, None),
    ("no AuthenticationMiddleware → None", {}, None),
    ("user object raising → None", {"user": BrokenUser()}, None),
    ("empty identity → None", {"user": SimpleUser("")}, None),
]


@pytest.mark.parametrize(
    ("extra", "expected"), [pytest.param(*case[1:], id=case[0]) for case in ASGI_USER_CASES]
)
def test_user_asgi(extra: dict[str, Any], expected: str | None) -> None:
    assert keys.user()(asgi_request(extra=extra)) == expected


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        pytest.param({"REMOTE_USER": "bob"}, "user:bob", id="REMOTE_USER"),
        pytest.param({}, None, id="no REMOTE_USER → None"),
        pytest.param({"REMOTE_USER": ""}, None, id="empty REMOTE_USER → None"),
    ],
)
def test_user_wsgi(extra: dict[str, Any], expected: str | None) -> None:
    assert keys.user()(wsgi_request(extra=extra)) == expected


@BOTH
@pytest.mark.parametrize(
    ("getter", "expected"),
    [
        pytest.param(lambda request: 42, "user:42", id="any value is str()-ed"),
        pytest.param(lambda request: None, None, id="None → policy does not apply"),
        pytest.param(lambda request: request.headers.get("x-account"), "user:acme", id="header"),
    ],
)
def test_user_custom_getter(
    make: Make, getter: Callable[[Any], object], expected: str | None
) -> None:
    request = make(headers=[("X-Account", "acme")])
    assert keys.user(getter)(request) == expected


def test_user_bad_getter_and_repr() -> None:
    with pytest.raises(ConfigurationError, match=re.escape("keys.user(lambda request")):
        keys.user("account_id")  # type: ignore[arg-type]
    assert repr(keys.user()) == "keys.user()"

    def account_of(request: Any) -> object:
        return None

    assert repr(keys.user(account_of)).startswith("keys.user(")
    assert "account_of" in repr(keys.user(account_of))


# --- route -------------------------------------------------------------------------------


@BOTH
@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        pytest.param({keys.ROUTE_SCOPE_KEY: "/items/{id}"}, "route:/items/{id}", id="template"),
        pytest.param({}, "route:<unmatched>", id="no template → one shared bucket"),
        pytest.param({keys.ROUTE_SCOPE_KEY: ""}, "route:<unmatched>", id="empty template"),
        pytest.param({keys.ROUTE_SCOPE_KEY: 7}, "route:<unmatched>", id="non-str template"),
    ],
)
def test_route(make: Make, extra: dict[str, Any], expected: str) -> None:
    # The raw path (/items/42) never appears: it is client-chosen.
    assert keys.route()(make(extra=extra, path="/items/42")) == expected


def test_route_from_flask_url_rule() -> None:
    app = flask.Flask(__name__)
    blueprint = flask.Blueprint("shop", __name__, url_prefix="/shop")

    @blueprint.route("/items/<int:item_id>")
    def item(item_id: int) -> str:
        return str(item_id)

    app.register_blueprint(blueprint)
    with app.test_request_context("/shop/items/5"):
        request = flask.request._get_current_object()  # type: ignore[attr-defined]
        assert keys.route()(request) == "route:/shop/items/<int:item_id>"
        # The middleware's entry, when present, wins over Flask's rule.
        request.environ[keys.ROUTE_SCOPE_KEY] = "/from-middleware"
        assert keys.route()(request) == "route:/from-middleware"
    with app.test_request_context("/nowhere"):
        request = flask.request._get_current_object()  # type: ignore[attr-defined]
        assert keys.route()(request) == "route:<unmatched>"


def test_route_repr() -> None:
    assert repr(keys.route()) == "keys.route()"


# --- compose -----------------------------------------------------------------------------


def constant(value: str | None) -> keys.KeyFunc:
    return lambda request: value


@BOTH
def test_compose_joins_length_prefixed_parts(make: Make) -> None:
    key = keys.compose(keys.header("X-A"), keys.route())
    request = make(headers=[("X-A", "v|1:x")], extra={keys.ROUTE_SCOPE_KEY: "/a"})
    assert key(request) == "11:h:x-a:v|1:x|8:route:/a"


@BOTH
def test_compose_is_none_when_any_part_is_none(make: Make) -> None:
    called: list[str] = []

    def spy(request: Any) -> str:
        called.append("spy")
        return "x"

    assert keys.compose(keys.header("X-Missing"), spy)(make()) is None
    assert called == []  # later parts are not computed
    assert keys.compose(spy, keys.header("X-Missing"))(make()) is None


def test_compose_separator_in_values_cannot_mimic_another_split() -> None:
    # A naive "|".join would give "a|b|c" for both.
    one = keys.compose(constant("a|b"), constant("c"))(None)
    other = keys.compose(constant("a"), constant("b|c"))(None)
    assert one != other
    forged = keys.compose(constant("a"), constant("1:b"))(None)
    assert forged != keys.compose(constant("a|1:b"))(None)


parts = st.lists(st.text(alphabet=st.sampled_from(list("ab|:0123456789"))), min_size=1, max_size=4)


@given(first=parts, second=parts)
def test_compose_is_injective(first: list[str], second: list[str]) -> None:
    key_one = keys.compose(*map(constant, first))(None)
    key_two = keys.compose(*map(constant, second))(None)
    assert (key_one == key_two) == (first == second)


def test_compose_bad_configuration_and_results() -> None:
    with pytest.raises(ConfigurationError, match=re.escape("keys.compose(keys.user(), keys.")):
        keys.compose()
    with pytest.raises(ConfigurationError, match=re.escape("keys.compose(keys.user(), keys.")):
        keys.compose("user")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expected str or None"):
        keys.compose(lambda request: 42)(None)  # type: ignore[arg-type,return-value]


def test_compose_repr() -> None:
    key = keys.compose(keys.client_ip(1), keys.route())
    assert repr(key) == "keys.compose(keys.client_ip(trusted_proxies=1), keys.route())"


# --- hostile input never raises ------------------------------------------------------------

raw_values = st.one_of(
    st.binary(max_size=300),
    st.binary(min_size=9000, max_size=20_000),
    st.text(alphabet=st.sampled_from(list('",;=\\[]:._% \tfor0123456789')), max_size=200).map(
        str.encode
    ),
)
ALL_KEYS = [
    keys.client_ip(),
    keys.client_ip(NETS),
    keys.client_ip(2),
    keys.header("X-Forwarded-For"),
    keys.header("Forwarded", required=True),
    keys.user(),
    keys.route(),
    keys.compose(keys.client_ip(NETS), keys.header("Forwarded"), keys.route()),
]


@given(xff=raw_values, forwarded=raw_values, peer=st.one_of(st.none(), st.text(max_size=60)))
def test_hostile_headers_never_raise(xff: bytes, forwarded: bytes, peer: str | None) -> None:
    # ASGI servers hand over raw bytes; WSGI servers decode them as latin-1 into the environ.
    xff_text, forwarded_text = xff.decode("latin-1"), forwarded.decode("latin-1")
    scope_request = asgi_request(peer or "10.0.0.1")
    scope_request.scope["headers"] = [(b"x-forwarded-for", xff), (b"forwarded", forwarded)]
    environ_request = wsgi_request(peer or "10.0.0.1")
    environ_request.environ["HTTP_X_FORWARDED_FOR"] = xff_text
    environ_request.environ["HTTP_FORWARDED"] = forwarded_text
    for request in (scope_request, environ_request):
        for key in ALL_KEYS:
            result = key(request)
            assert result is None or isinstance(result, str)
        client = keys.client_ip(NETS)(request)
        assert client is not None and client.startswith("ip:")


@given(xff=raw_values)
def test_hostile_headers_give_the_same_client_under_asgi_and_wsgi(xff: bytes) -> None:
    scope_request = asgi_request("10.0.0.1", [])
    scope_request.scope["headers"] = [(b"x-forwarded-for", xff)]
    environ_request = wsgi_request("10.0.0.1")
    environ_request.environ["HTTP_X_FORWARDED_FOR"] = xff.decode("latin-1")
    key = keys.client_ip(NETS)
    assert key(scope_request) == key(environ_request)


def test_requests_of_no_framework_are_told_apart_each_time() -> None:
    from types import SimpleNamespace

    key = keys.client_ip()
    # A test's stand-ins of one class: one with a scope, the next with an environ.
    assert key(SimpleNamespace(scope={"client": ("198.51.100.1", 1)})) == "ip:198.51.100.1"
    assert key(SimpleNamespace(environ={"REMOTE_ADDR": "198.51.100.2"})) == "ip:198.51.100.2"
