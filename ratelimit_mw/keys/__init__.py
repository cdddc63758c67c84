"""Key functions: which identity a request is counted under (docs/keys.md).

A key function takes the request as the framework gives it (a Starlette ``Request``, a
Werkzeug/Flask ``Request``, Django's ``HttpRequest``) and returns the identity string whose
quota it spends, or ``None``: "this policy does not apply to this request". No framework is
imported: the request is recognised by duck typing (`kind`). The client-IP security model is
in ``ratelimit_mw.keys.client_ip``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from typing import Any, TypeAlias
from uuid import UUID

from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.keys.client_ip import (
    IPAddress,
    TrustedProxies,
    check_ipv6_prefix,
    ip_key,
    resolve_client,
)

__all__ = ["ROUTE_SCOPE_KEY", "KeyFunc", "client_ip", "compose", "first", "header", "reads",
           "reads_scope", "route", "shared_route", "user"]

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
    """What `key` declares it reads (`ANYTHING` for a callable that does not say): the
    middleware resolves the route template only when a key in use reads "route"."""
    declared = getattr(key, "reads", None)
    return declared if isinstance(declared, frozenset) else ANYTHING


# RFC 9110 token characters: the only ones a header name can have.
_TCHARS = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")

ASGI, WSGI, DJANGO = "asgi", "wsgi", "django"
_KINDS: dict[type, str] = {}
# Only the frameworks' own request classes have their kind remembered per class: any other
# object (a test's SimpleNamespace, a Mock) is looked at every time.
_FRAMEWORKS = frozenset({"starlette", "fastapi", "werkzeug", "flask", "django", "litestar",
                         "ratelimit_mw"})


def kind(request: Any) -> str:
    """Django's ``HttpRequest`` (``.META``; ASGI Django's has a ``.scope`` too), a Starlette
    ``Request`` (``.scope``) or a Werkzeug/Flask ``Request`` (``.environ``)."""
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


def _header_lines(headers: Any) -> Callable[[str], list[str]]:
    """Every line of a header: Starlette's ``getlist``, or multidict's ``getall`` (Litestar)."""
    getlist = getattr(headers, "getlist", None)
    return getlist if getlist is not None else lambda name: headers.getall(name, [])


def _joined(values: list[str]) -> str | None:
    # Several header lines are one comma-separated list (RFC 9110 §5.3).
    return ", ".join(values) if values else None


# Peers remembered per client_ip() without trusted proxies, and the longest peer text kept
# (an address with a zone id; longer text is rejected by the parser anyway).
_PEER_CACHE_SIZE = 4096
_PAIR = (tuple, list)  # an ASGI scope's client: (host, port)
_MAX_PEER_CHARS = 64


class _ClientIP:
    __slots__ = ("_by_peer", "_ipv6_prefix", "_readers", "_spec", "_trusted")
    reads = frozenset({"client", "headers"})

    def __init__(self, trusted_proxies: Sequence[str] | int | None, ipv6_prefix: int) -> None:
        self._spec = trusted_proxies
        self._trusted = None if trusted_proxies is None else TrustedProxies(trusted_proxies)
        self._ipv6_prefix = check_ipv6_prefix(ipv6_prefix)
        # Without trusted proxies the key is a pure function of the peer text: remembered.
        self._by_peer: dict[str, str] = {}
        self._readers = {found: self._reader(found) for found in (ASGI, WSGI, DJANGO)}

    def __call__(self, request: Any) -> str:
        return self._readers[_KINDS.get(type(request)) or kind(request)](request)

    def for_kind(self, found: str) -> Callable[[Any], str]:
        """This key for the requests of one kind (`ASGI`, `WSGI`, `DJANGO`: an adapter's),
        their kind and the proxies' trust asked once: a handler calls it per request."""
        return self._readers[found]

    def _reader(self, found: str) -> Callable[[Any], str]:
        if self._trusted is not None:
            return lambda request: self._forwarded(found, request)
        by_peer, peer_key = self._by_peer, self._peer_key
        scope = found == ASGI
        # Django's META holds the same names under WSGI and ASGI.
        field = "environ" if found == WSGI else "META"

        def read(request: Any) -> str:
            peer: Any
            if scope:  # the scope rather than request.client: a malformed value cannot raise
                client = request.scope.get("client")
                peer = client[0] if isinstance(client, _PAIR) and client else None
            else:
                peer = getattr(request, field).get("REMOTE_ADDR")
            try:
                known = by_peer.get(peer)
            except TypeError:  # unhashable: no peer text remembered is
                known = None
            return known if known is not None else peer_key(peer)

        return read

    def _forwarded(self, found: str, request: Any) -> str:
        """Behind trusted proxies: ``Forwarded`` (else ``X-Forwarded-For``) walked."""
        if found == ASGI:
            client = request.scope.get("client")
            peer = client[0] if isinstance(client, _PAIR) and client else None
            lines = _header_lines(request.headers)
            forwarded = _joined(lines("forwarded"))
            xff = None if forwarded is not None else _joined(lines("x-forwarded-for"))
        else:  # the server (or Django) has already joined repeated header lines
            environ = request.environ if found == WSGI else request.META
            peer = environ.get("REMOTE_ADDR")
            forwarded = environ.get("HTTP_FORWARDED")
            xff = None if forwarded is not None else environ.get("HTTP_X_FORWARDED_FOR")
        return self._key(resolve_client(peer, forwarded, xff, self._trusted))

    def _peer_key(self, peer: Any) -> str:
        key = self._key(resolve_client(peer, None, None, None))
        if type(peer) is str and len(peer) <= _MAX_PEER_CHARS:
            if len(self._by_peer) >= _PEER_CACHE_SIZE:
                self._by_peer.clear()
            self._by_peer[peer] = key
        return key

    def _key(self, addr: IPAddress | None) -> str:
        # No usable address (Unix socket, a test client's "testclient", garbage): one shared
        # bucket, since None would exempt it and make "send no address" a way around the limit.
        return "ip:unknown" if addr is None else "ip:" + ip_key(addr, self._ipv6_prefix)

    def __repr__(self) -> str:
        args = []
        if self._spec is not None:
            spec = self._spec if isinstance(self._spec, int) else list(self._spec)
            args.append(f"trusted_proxies={spec!r}")
        if self._ipv6_prefix != 64:
            args.append(f"ipv6_prefix={self._ipv6_prefix}")
        return f"keys.client_ip({', '.join(args)})"


def client_ip(trusted_proxies: Sequence[str] | int | None = None, ipv6_prefix: int = 64) -> KeyFunc:
    """Key by client IP address: ``"ip:<address>"``, IPv6 grouped by ``ipv6_prefix``.

    Without ``trusted_proxies`` the socket peer is the client (any client can write forwarding
    headers). Behind proxies you run, give their networks (``["10.0.0.0/8", "::1"]``) or their
    number; then ``Forwarded`` (else ``X-Forwarded-For``) is walked from the right to the first
    address that is not a trusted proxy. No usable address: ``"ip:unknown"``, one bucket.
    """
    return _ClientIP(trusted_proxies, ipv6_prefix)


class _Header:
    __slots__ = ("_missing", "_name", "_prefix")
    reads = frozenset({"headers"})

    def __init__(self, name: str, required: bool) -> None:
        if not isinstance(name, str) or not name or not set(name) <= _TCHARS:
            raise ConfigurationError(f"header name must be a non-empty HTTP token, got {name!r};"
                                     ' write e.g. keys.header("X-Api-Key")')
        self._name = name.lower()
        self._prefix = f"h:{self._name}:"
        # No colon after the name: no header value can produce this key.
        self._missing = f"h:{self._name}" if required else None

    def __call__(self, request: Any) -> str | None:
        # What the app's own code sees (the first line under Starlette, the server-joined
        # lines under WSGI): anything else could count a request under another key than the
        # one the app authenticated.
        value: str | None = request.headers.get(self._name)
        if not value:
            return self._missing
        return self._prefix + value

    def __repr__(self) -> str:
        return f"keys.header({self._name!r}{'' if self._missing is None else ', required=True'})"


def header(name: str, *, required: bool = False) -> KeyFunc:
    """Key by the value of a request header: ``"h:<lower-case name>:<value>"``, only for
    values the app or a gateway validates (else a client picks a new bucket per request). A
    missing or empty header gives ``None``; with ``required=True`` such requests share one
    bucket, ``"h:<name>"``, so that leaving the header out is no way around the limit."""
    return _Header(name, required)


def _default_user(request: Any) -> object:
    found = _KINDS.get(type(request)) or kind(request)
    if found == ASGI:
        # scope.get, not request.user: Starlette's asserts without AuthenticationMiddleware.
        user = request.scope.get("user")
        # A user object is app code (BaseUser's properties raise NotImplementedError unless
        # overridden): whatever it raises means "no usable user", never a 500.
        try:
            if user is None or not user.is_authenticated:
                return None
        except AttributeError:
            return _plain_user(user)
        except Exception:
            return None
        for attribute in ("identity", "display_name"):
            try:
                value = getattr(user, attribute)
            except Exception:
                continue
            if value is not None and value != "":
                return value
        return None
    if found == DJANGO:  # request.user as django.contrib.auth sets it: its primary key
        user = getattr(request, "user", None)
        try:
            return user.pk if user is not None and user.is_authenticated else None
        except Exception:
            return None
    environ = getattr(request, "environ", None)
    return environ.get("REMOTE_USER") if environ is not None else None


def _plain_user(user: object) -> object:
    """Litestar's ``scope["user"]``: whatever the app's authentication retrieved, set only once
    it authenticated: a plain id itself, else its ``id`` (None when it has none)."""
    if isinstance(user, (str, int)) and not isinstance(user, bool):
        return user
    try:
        found = user.get("id") if isinstance(user, Mapping) else getattr(user, "id", None)
    except Exception:
        return None
    return found if isinstance(found, (str, int, UUID)) and not isinstance(found, bool) else None


class _User:
    __slots__ = ("_getter", "reads")

    def __init__(self, getter: Callable[[Any], object] | None) -> None:
        if getter is not None and not callable(getter):
            raise ConfigurationError(f"user getter must be a callable taking the request, got "
                                     f"{getter!r}; write e.g. keys.user(lambda request: "
                                     "request.state.account_id)")
        self._getter = getter
        self.reads = frozenset({"user"}) if getter is None else ANYTHING

    def __call__(self, request: Any) -> str | None:
        found = _default_user(request) if self._getter is None else self._getter(request)
        # An empty id (e.g. REMOTE_USER="") is not a user: one shared "user:" bucket for all
        # of them would throttle unrelated clients together.
        text = "" if found is None else str(found)
        return "user:" + text if text else None

    def __repr__(self) -> str:
        if self._getter is None:
            return "keys.user()"
        return f"keys.user({getattr(self._getter, '__qualname__', self._getter)!s})"


def user(getter: Callable[[Any], object] | None = None) -> KeyFunc:
    """Key by authenticated user: ``"user:<id>"``; ``None`` when there is none.

    By default the user is ``scope["user"]`` as Starlette's ``AuthenticationMiddleware`` sets
    it (its ``identity``, else its ``display_name``), Litestar's ``scope["user"]`` (its ``id``,
    or the user itself when it is a plain id), Django's ``request.user.pk``, or WSGI's
    ``REMOTE_USER``; else ``getter(request)``'s id or ``None`` (what it raises propagates).
    """
    return _User(getter)


# The name a limit shared by `name=` counts under while its key runs (`shared_route`).
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
        elif found == DJANGO:  # the URL pattern Django matched ("items/<int:pk>/")
            route = getattr(getattr(request, "resolver_match", None), "route", None)
            template = "/" + route if isinstance(route, str) else None
        else:
            # Inside Flask (the extension's before_request) the matched rule is on the
            # request; blueprint prefixes are already part of rule.rule.
            template = request.environ.get(ROUTE_SCOPE_KEY) or getattr(
                getattr(request, "url_rule", None), "rule", None)
        if isinstance(template, str) and template:
            return "route:" + template
        # Never the raw path: a client could mint a fresh bucket per request from random paths.
        return "route:<unmatched>"

    def __repr__(self) -> str:
        return "keys.route()"


def route() -> KeyFunc:
    """Key by route template: ``"route:/users/{id}"``, never the raw path, as the middleware
    left it (``ROUTE_SCOPE_KEY``) or Flask's ``request.url_rule`` holds it; requests that
    matched no route share ``"route:<unmatched>"``. Mostly useful inside ``compose``."""
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


class _Compose:
    __slots__ = ("_funcs", "reads")
    _word = "compose"

    def __init__(self, funcs: tuple[KeyFunc, ...]) -> None:
        bad = [repr(func) for func in funcs if not callable(func)]
        if not funcs or bad:
            raise ConfigurationError(
                f"{self._word} takes one or more key functions, got {(bad or ['none'])[0]};"
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
        return f"keys.{self._word}({', '.join(map(repr, self._funcs))})"


def compose(*funcs: KeyFunc) -> KeyFunc:
    """Key by several key functions at once; ``None`` if any of them gives ``None``. The parts
    are joined as ``<len>:<part>`` separated by ``|``, which no part values can make ambiguous:
    for user ``ann`` on ``/items/{id}``, ``"8:user:ann|17:route:/items/{id}"``."""
    return _Compose(funcs)


class _First(_Compose):
    __slots__ = ()
    _word = "first"

    def __call__(self, request: Any) -> str | None:
        for func in self._funcs:
            found = func(request)
            if found is not None:
                return found
        return None


def first(*funcs: KeyFunc) -> KeyFunc:
    """The first identity any of `funcs` gives (``None`` only if all give ``None``), e.g.
    ``keys.first(keys.header("X-User-Id"), keys.client_ip())``. The identities keep their
    prefixes (``"h:x-user-id:42"``, ``"ip:203.0.113.9"``): a header never poses as an address.
    """
    return _First(funcs)


def reads_scope(key: object) -> bool:
    """Whether `key` is a built-in key that reads only what an ASGI scope holds (the
    request's ``.scope`` and ``.headers``): the ASGI middleware then hands it a view of the
    scope instead of building a framework Request. A callable of the app never is, whatever
    it declares it reads."""
    if isinstance(key, (_ClientIP, _Header, _Route)):
        return True
    if isinstance(key, _User):
        return key._getter is None
    if isinstance(key, _SharedRoute):
        return type(key) is _SharedRoute and reads_scope(key._key)
    if isinstance(key, _Compose):
        return all(map(reads_scope, key._funcs))
    return False
