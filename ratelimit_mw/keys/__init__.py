"""Key functions: which identity a request is counted under.

A key function takes one argument, the request as the framework gives it — a Starlette
``Request`` under ASGI, a Werkzeug/Flask ``Request`` under WSGI, Django's ``HttpRequest`` —
and returns a string, the
identity whose quota the request spends, or ``None``: "this policy does not apply to this
request". Any callable of that shape works (see ``KeyFunc``); the factories here cover the
usual cases::

    from ratelimit_mw import keys

    keys.client_ip()                                  # the default: per client address
    keys.client_ip(trusted_proxies=["10.0.0.0/8"])    # behind your own load balancers
    keys.header("X-Api-Key")                          # per API key (validated upstream!)
    keys.user()                                       # per authenticated user
    keys.compose(keys.user(), keys.route())           # per user per endpoint
    keys.first(keys.header("X-User-Id"), keys.client_ip())   # the header, else the address

Which one to use:

* ``client_ip()`` for anonymous traffic and login endpoints. Behind a reverse proxy or load
  balancer it must be told which proxies to believe (``trusted_proxies``), otherwise every
  request seems to come from the proxy and all clients share one bucket.
* ``user()`` once requests are authenticated: NAT and mobile carriers put many users behind
  one IP address, and one user may roam across many.
* ``header(name)`` for API keys, but only for keys the app (or a gateway) validates: the
  header is whatever the client sends, so an unvalidated header lets a client pick a fresh
  bucket for every request.
* ``route()`` combined with another key (``compose``) to give each endpoint its own quota.

Client-IP security model (details in ``ratelimit_mw.keys.client_ip``): the socket peer is the
client. ``Forwarded`` / ``X-Forwarded-For`` are read only when ``trusted_proxies`` is given,
either as the proxies' networks or as the number of proxies in front of the app; the header is
walked from the right, where trusted proxies append, and garbage falls back to the last
trusted hop, never raising. Servers may already have rewritten the peer: uvicorn's
``--proxy-headers`` (on by default, trusting 127.0.0.1) and Werkzeug's ``ProxyFix`` put the
forwarded client in the peer. With those in place, use ``client_ip()`` without
``trusted_proxies`` rather than resolving the header twice.

No framework is imported: the request is recognised by duck typing (`kind`), so Starlette,
Werkzeug, Flask and Django stay optional.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any, TypeAlias

from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.keys.client_ip import (
    IPAddress,
    TrustedProxies,
    check_ipv6_prefix,
    ip_key,
    resolve_client,
)

__all__ = [
    "ROUTE_SCOPE_KEY",
    "KeyFunc",
    "client_ip",
    "compose",
    "first",
    "header",
    "reads",
    "route",
    "shared_route",
    "user",
]

#: A key function: request → identity string, or None when the policy does not apply.
KeyFunc: TypeAlias = Callable[[Any], str | None]

#: Where the middleware leaves the matched route template: ``scope[ROUTE_SCOPE_KEY]`` under
#: ASGI, ``environ[ROUTE_SCOPE_KEY]`` under WSGI.
ROUTE_SCOPE_KEY = "ratelimit_mw.route"

#: What a key function may read, declared as its ``reads`` attribute: the socket peer
#: ("client"), request headers ("headers"), the authenticated user ("user"), the route
#: template ("route"). A callable that declares nothing may read anything (`ANYTHING`).
ANYTHING = frozenset({"client", "headers", "user", "route"})


def reads(key: object) -> frozenset[str]:
    """What `key` declares it reads (`ANYTHING` for a callable that does not say).

    The middleware resolves the route template for every request only when a key in use
    reads "route"; write ``my_key.reads = frozenset({"headers"})`` on your own key function
    to spare that work.
    """
    declared = getattr(key, "reads", None)
    return declared if isinstance(declared, frozenset) else ANYTHING


_UNKNOWN_IP = "ip:unknown"
_UNMATCHED_ROUTE = "route:<unmatched>"

# RFC 9110 token characters: the only ones a header name can have.
_TCHARS = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


ASGI, WSGI, DJANGO = "asgi", "wsgi", "django"
_KINDS: dict[type, str] = {}
# The request classes whose kind is remembered per class: the frameworks' own. Any other
# object (a test's SimpleNamespace, a Mock) is looked at every time.
_FRAMEWORKS = frozenset({"starlette", "fastapi", "werkzeug", "flask", "django",
                         "ratelimit_mw"})


def kind(request: Any) -> str:
    """Which framework's request this is: Django's ``HttpRequest`` (WSGI and ASGI Django
    alike: it has ``.META``, and ASGI Django's a ``.scope`` too), a Starlette ``Request``
    (``.scope``) or a Werkzeug/Flask ``Request`` (``.environ``)."""
    cls = type(request)
    found = _KINDS.get(cls)
    if found is not None:
        return found
    module = cls.__module__.partition(".")[0]
    if module == "django" or (hasattr(request, "META") and not hasattr(request, "scope")
                              and not hasattr(request, "environ")):
        found = DJANGO
    else:
        found = ASGI if hasattr(request, "scope") else WSGI
    if module in _FRAMEWORKS:
        _KINDS[cls] = found
    return found


def _is_asgi(request: Any) -> bool:
    # The remembered kind first: a frame fewer on every request.
    return (_KINDS.get(type(request)) or kind(request)) == ASGI


def _joined(values: list[str]) -> str | None:
    # Several header lines are one comma-separated list (RFC 9110 §5.3).
    if not values:
        return None
    return values[0] if len(values) == 1 else ", ".join(values)


# --- client_ip ---------------------------------------------------------------------------


# Peers remembered per client_ip() without trusted proxies, and the longest peer text kept
# (an address with a zone id; longer text is rejected by the parser anyway).
_PEER_CACHE_SIZE = 4096
_MAX_PEER_CHARS = 64


class _ClientIP:
    __slots__ = ("_by_peer", "_ipv6_prefix", "_spec", "_trusted")
    reads = frozenset({"client", "headers"})

    def __init__(self, trusted_proxies: Sequence[str] | int | None, ipv6_prefix: int) -> None:
        self._spec = trusted_proxies
        self._trusted = None if trusted_proxies is None else TrustedProxies(trusted_proxies)
        self._ipv6_prefix = check_ipv6_prefix(ipv6_prefix)
        # Without trusted proxies the key is a pure function of the peer text, and parsing
        # and formatting an address costs more than the rest of the key function: remember
        # the keys of recent peers (bounded, dropped whole when full, like the path caches).
        self._by_peer: dict[str, str] = {}

    def __call__(self, request: Any) -> str:
        forwarded: str | None = None
        x_forwarded_for: str | None = None
        if (_KINDS.get(type(request)) or kind(request)) == ASGI:  # _is_asgi, inline
            scope = request.scope
            client = scope.get("client")
            # ASGI says [host, port] or None; read the scope rather than request.client so a
            # malformed value from an odd server cannot raise here.
            peer = client[0] if isinstance(client, (tuple, list)) and client else None
            if self._trusted is None:
                # The cached key of a peer seen before, else `_peer_key` (any odd value).
                found = self._by_peer.get(peer) if type(peer) is str else None
                return found if found is not None else self._peer_key(peer)
            headers = request.headers
            forwarded = _joined(headers.getlist("forwarded"))
            if forwarded is None:
                x_forwarded_for = _joined(headers.getlist("x-forwarded-for"))
        else:
            # Django's META holds the same names under WSGI and ASGI.
            environ = request.environ if kind(request) == WSGI else request.META
            peer = environ.get("REMOTE_ADDR")
            if self._trusted is None:
                return self._peer_key(peer)
            # The server (or Django) has already joined repeated header lines.
            forwarded = environ.get("HTTP_FORWARDED")
            if forwarded is None:
                x_forwarded_for = environ.get("HTTP_X_FORWARDED_FOR")
        return self._key(resolve_client(peer, forwarded, x_forwarded_for, self._trusted))

    def _peer_key(self, peer: object) -> str:
        """The key when the peer is the client (no trusted proxies), cached per peer text."""
        if type(peer) is not str or len(peer) > _MAX_PEER_CHARS:
            return self._key(resolve_client(peer, None, None, None))  # type: ignore[arg-type]
        cache = self._by_peer
        found = cache.get(peer)
        if found is None:
            found = self._key(resolve_client(peer, None, None, None))
            if len(cache) >= _PEER_CACHE_SIZE:
                cache.clear()
            cache[peer] = found
        return found

    def _key(self, addr: IPAddress | None) -> str:
        if addr is None:
            # No usable address (Unix socket, a test client's "testclient", garbage). Such
            # requests are still limited, together as one bucket: returning None would exempt
            # them, which would make "send no usable address" a way around the limit.
            return _UNKNOWN_IP
        return "ip:" + ip_key(addr, self._ipv6_prefix)

    def __repr__(self) -> str:
        args = []
        if self._spec is not None:
            spec = self._spec if isinstance(self._spec, int) else list(self._spec)
            args.append(f"trusted_proxies={spec!r}")
        if self._ipv6_prefix != 64:
            args.append(f"ipv6_prefix={self._ipv6_prefix}")
        return f"keys.client_ip({', '.join(args)})"


def client_ip(trusted_proxies: Sequence[str] | int | None = None, ipv6_prefix: int = 64) -> KeyFunc:
    """Key by client IP address: ``"ip:<address>"``.

    Without ``trusted_proxies`` the socket peer is the client and forwarding headers are
    ignored, because any client can write them. Behind proxies you run, give their networks
    (``["10.0.0.0/8", "::1"]``) or their number (``1`` for a single load balancer); then
    ``Forwarded`` (or, when absent, ``X-Forwarded-For``) is walked from the right to the first
    address that is not a trusted proxy.

    IPv6 clients are grouped by ``ipv6_prefix`` (default /64, what one host or LAN usually
    gets; ``128`` for per-address). A request with no usable address is keyed
    ``"ip:unknown"``: one shared bucket, so it is limited rather than exempt.

    >>> key = client_ip(trusted_proxies=["10.0.0.0/8"])
    >>> key
    keys.client_ip(trusted_proxies=['10.0.0.0/8'])

    A request from peer 10.0.0.5 with ``X-Forwarded-For: 203.0.113.9, 10.0.0.7`` gives
    ``"ip:203.0.113.9"``; one from 2001:db8:1:2::99 gives ``"ip:2001:db8:1:2::/64"``.
    """
    return _ClientIP(trusted_proxies, ipv6_prefix)


# --- header ------------------------------------------------------------------------------


class _Header:
    __slots__ = ("_missing", "_name", "_prefix", "_required")
    reads = frozenset({"headers"})

    def __init__(self, name: str, required: bool) -> None:
        if not isinstance(name, str) or not name or not set(name) <= _TCHARS:
            raise ConfigurationError(
                f"header name must be a non-empty HTTP token, got {name!r};"
                ' write e.g. keys.header("X-Api-Key")'
            )
        self._name = name.lower()
        self._required = bool(required)
        self._prefix = f"h:{self._name}:"
        # No colon after the name: no header value can produce this key.
        self._missing: str | None = f"h:{self._name}" if self._required else None

    def __call__(self, request: Any) -> str | None:
        # request.headers.get gives what the app's own code sees: the first line under
        # Starlette, the server-joined lines under WSGI. Keying on anything else could count
        # a request under a different key than the one the app authenticated.
        value: str | None = request.headers.get(self._name)
        if not value:
            return self._missing
        return self._prefix + value

    def __repr__(self) -> str:
        required = ", required=True" if self._required else ""
        return f"keys.header({self._name!r}{required})"


def header(name: str, *, required: bool = False) -> KeyFunc:
    """Key by the value of a request header: ``"h:<lower-case name>:<value>"``.

    The value is whatever the client sent. Use this only for values the app or a gateway
    validates (an API key that must exist), otherwise a client can spend a new bucket on
    every request by changing the header.

    A missing or empty header gives ``None``: the policy does not apply (typically such
    requests are rejected by authentication anyway, or limited by another policy). With
    ``required=True`` they share one bucket instead, keyed ``"h:<name>"``, so that
    leaving the header out is not a way around the limit.

    >>> key = header("X-Api-Key")
    >>> key
    keys.header('x-api-key')

    ``X-Api-Key: k-123`` gives ``"h:x-api-key:k-123"``; no header gives ``None``.
    """
    return _Header(name, required)


# --- user --------------------------------------------------------------------------------


def _default_user(request: Any) -> object:
    if _is_asgi(request):
        # scope.get, not request.user: Starlette's request.user asserts when
        # AuthenticationMiddleware is not installed.
        found = request.scope.get("user")
        if found is None:
            return None
        # BaseUser's properties raise NotImplementedError unless overridden, and a user
        # object is app code: whatever it raises means "no usable user", never a 500.
        try:
            if not found.is_authenticated:
                return None
        except Exception:
            return None
        for attribute in ("identity", "display_name"):
            try:
                value = getattr(found, attribute)
            except Exception:
                continue
            if value is not None and value != "":
                return value
        return None
    if kind(request) == DJANGO:
        # request.user as django.contrib.auth's middleware sets it: its primary key.
        found = getattr(request, "user", None)
        try:
            return found.pk if found is not None and found.is_authenticated else None
        except Exception:
            return None
    environ = getattr(request, "environ", None)
    return environ.get("REMOTE_USER") if environ is not None else None


class _User:
    __slots__ = ("_getter", "reads")

    def __init__(self, getter: Callable[[Any], object] | None) -> None:
        if getter is not None and not callable(getter):
            raise ConfigurationError(
                f"user getter must be a callable taking the request, got {getter!r};"
                " write e.g. keys.user(lambda request: request.state.account_id)"
            )
        self._getter = getter
        # A getter of the app's may read anything.
        self.reads = frozenset({"user"}) if getter is None else ANYTHING

    def __call__(self, request: Any) -> str | None:
        getter = self._getter
        found = _default_user(request) if getter is None else getter(request)
        if found is None:
            return None
        text = str(found)
        # An empty id (e.g. REMOTE_USER="") is not a user: one shared "user:" bucket for all
        # of them would throttle unrelated clients together.
        return "user:" + text if text else None

    def __repr__(self) -> str:
        if self._getter is None:
            return "keys.user()"
        return f"keys.user({getattr(self._getter, '__qualname__', self._getter)!s})"


def user(getter: Callable[[Any], object] | None = None) -> KeyFunc:
    """Key by authenticated user: ``"user:<id>"``; ``None`` (policy does not apply) when the
    request has no authenticated user.

    By default the user is, under ASGI, ``scope["user"]`` as Starlette's
    ``AuthenticationMiddleware`` sets it (when ``is_authenticated``: its ``identity``, else
    its ``display_name``), and under WSGI the ``REMOTE_USER`` of the environ. Otherwise pass
    ``getter``, a callable taking the request and returning an id (anything ``str()`` can
    render) or ``None``; exceptions it raises propagate.

    >>> key = user(lambda request: request.headers.get("X-Account"))
    >>> key
    keys.user(<lambda>)

    A Starlette request whose ``scope["user"]`` is ``SimpleUser("ann")`` gives ``"user:ann"``
    with ``keys.user()``.
    """
    return _User(getter)


# --- route -------------------------------------------------------------------------------


# The name a limit shared by `name=` counts under, while its key runs (`shared_route`):
# `route()` then gives the name, so that every route the limit is on counts together.
_SHARED: ContextVar[str | None] = ContextVar("ratelimit_mw_shared_route", default=None)


class _Route:
    __slots__ = ()
    reads = frozenset({"route"})

    def __call__(self, request: Any) -> str:
        shared = _SHARED.get()
        if shared is not None:
            return "shared:" + shared
        found = kind(request)
        if found == ASGI:
            template = request.scope.get(ROUTE_SCOPE_KEY)
        elif found == DJANGO:
            # The URL pattern Django matched ("items/<int:pk>/"), once it has resolved.
            match = getattr(request, "resolver_match", None)
            route = getattr(match, "route", None)
            template = "/" + route if isinstance(route, str) else None
        else:
            template = request.environ.get(ROUTE_SCOPE_KEY)
            if template is None:
                # Inside Flask (e.g. the extension's before_request) the matched rule is on
                # the request; blueprint prefixes are already part of rule.rule.
                template = getattr(getattr(request, "url_rule", None), "rule", None)
        if isinstance(template, str) and template:
            return "route:" + template
        # Never the raw path: a client could mint a fresh bucket per request from random
        # paths. Everything that matched no route shares this one.
        return _UNMATCHED_ROUTE

    def __repr__(self) -> str:
        return "keys.route()"


def route() -> KeyFunc:
    """Key by route template: ``"route:/users/{id}"``, never the raw path.

    The template comes from the middleware (``scope`` / ``environ`` entry
    ``ROUTE_SCOPE_KEY``) or, inside Flask, from ``request.url_rule``. Requests that matched no
    route share the key ``"route:<unmatched>"``. Mostly useful inside ``compose``.

    >>> keys_per_endpoint = compose(client_ip(), route())
    >>> keys_per_endpoint
    keys.compose(keys.client_ip(), keys.route())
    """
    return _Route()


class _SharedRoute:
    """`key` with `route()` standing for the shared limit's name (see `shared_route`)."""

    __slots__ = ("_key", "_name", "reads")

    def __init__(self, key: KeyFunc, name: str) -> None:
        self._key = key
        self._name = name
        self.reads = reads(key)

    def __call__(self, request: Any) -> str | None:
        token = _SHARED.set(self._name)
        try:
            return self._key(request)
        finally:
            _SHARED.reset(token)

    def __repr__(self) -> str:
        return f"keys.shared_route({self._key!r}, {self._name!r})"


class _AsyncSharedRoute(_SharedRoute):
    __slots__ = ()

    async def __call__(self, request: Any) -> str | None:  # type: ignore[override]
        token = _SHARED.set(self._name)
        try:
            return await self._key(request)  # type: ignore[no-any-return,misc]
        finally:
            _SHARED.reset(token)


def shared_route(key: KeyFunc, name: str) -> KeyFunc:
    """`key` for a limit shared by ``name=`` across routes: inside it, `route()` gives
    ``"shared:<name>"`` instead of the route's template, so that with
    ``keys.compose(keys.client_ip(), keys.route())`` the routes that share the limit share
    one counter. The middleware applies it to every named limit whose key reads the route."""
    call = getattr(key, "__call__", None)  # noqa: B004 - the method, not callable()
    if inspect.iscoroutinefunction(key) or inspect.iscoroutinefunction(call):
        return _AsyncSharedRoute(key, name)  # type: ignore[return-value]
    return _SharedRoute(key, name)


# --- compose -----------------------------------------------------------------------------


class _Compose:
    __slots__ = ("_funcs", "reads")
    _word = "compose"

    def __init__(self, funcs: tuple[KeyFunc, ...]) -> None:
        if not funcs:
            raise ConfigurationError(
                f"{self._word} needs at least one key function;"
                f" write e.g. keys.{self._word}(keys.user(), keys.client_ip())"
            )
        for func in funcs:
            if not callable(func):
                raise ConfigurationError(
                    f"{self._word} takes key functions, got {func!r};"
                    f" write e.g. keys.{self._word}(keys.user(), keys.client_ip())"
                )
        self._funcs = funcs
        self.reads = frozenset().union(*map(reads, funcs))

    def __call__(self, request: Any) -> str | None:
        encoded = []
        for func in self._funcs:
            part = func(request)
            if part is None:
                return None
            if not isinstance(part, str):
                raise TypeError(
                    f"key function {func!r} returned {type(part).__name__}; expected str or None"
                )
            # Length-prefixed, so the join is injective: with a plain separator, a client
            # value containing it ("a|b") could pose as a different split of the parts.
            encoded.append(f"{len(part)}:{part}")
        return "|".join(encoded)

    def __repr__(self) -> str:
        return f"keys.compose({', '.join(repr(f) for f in self._funcs)})"


def compose(*funcs: KeyFunc) -> KeyFunc:
    """Key by several key functions at once; ``None`` if any of them gives ``None``.

    The parts are joined as ``<len>:<part>`` separated by ``|``, which no choice of part
    values can make ambiguous.

    >>> per_user_route = compose(user(), route())
    >>> per_user_route
    keys.compose(keys.user(), keys.route())

    For user ``ann`` on ``/items/{id}``: ``"8:user:ann|17:route:/items/{id}"``.
    """
    return _Compose(funcs)


# --- first -------------------------------------------------------------------------------


class _First(_Compose):
    __slots__ = ()
    _word = "first"

    def __call__(self, request: Any) -> str | None:
        for func in self._funcs:
            found = func(request)
            if found is not None:
                return found
        return None

    def __repr__(self) -> str:
        return f"keys.first({', '.join(repr(f) for f in self._funcs)})"


def first(*funcs: KeyFunc) -> KeyFunc:
    """The first identity any of `funcs` gives; ``None`` only if all of them give ``None``.

    The usual fallback: per user id when the request names one, else per client address, so
    that leaving the header out is not a way around the limit::

        @limiter.limit("100/minute", key=keys.first(keys.header("X-User-Id"), keys.client_ip()))

    The identities keep their own prefixes (``"h:x-user-id:42"``, ``"ip:203.0.113.9"``), so
    a header value can never pose as an address.

    >>> first(header("X-User-Id"), client_ip())
    keys.first(keys.header('x-user-id'), keys.client_ip())
    """
    return _First(funcs)
