"""Backend URLs, read and checked once, at configuration time (pure: no I/O, no redis-py).

A mistake in a URL must stop the app at start-up with a message that shows what to write,
never reach redis-py (whose ValueError names no fix) or be dropped silently. The schemes are
`SCHEMES`, the query options `_CONVERT` (which scheme takes which: `_ALLOWED`, `_TLS`), as
docs/backends.md lists them.

Valkey speaks Redis's protocol: each ``valkey`` scheme means what its ``redis`` twin means
(`VALKEY`) and is served by the same redis-py client.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import SplitResult, parse_qsl, unquote, urlsplit

from ratelimit_mw.core.errors import ConfigurationError

# Scheme → (kind, an example of it).
SCHEMES = {
    "redis": ("redis", "redis://127.0.0.1:6379/0"),
    "rediss": ("redis", "rediss://:password@redis.example.com:6380/0"),
    "unix": ("redis", "unix:///var/run/redis/redis.sock?db=0"),
    "redis+cluster": ("cluster", "redis+cluster://10.0.0.1:7000"),
    "rediss+cluster": ("cluster", "rediss+cluster://10.0.0.1:7000"),
    "redis+sentinel": ("sentinel", "redis+sentinel://10.0.0.1:26379,10.0.0.2:26379/mymaster/0"),
    "rediss+sentinel": ("sentinel", "rediss+sentinel://10.0.0.1:26379,10.0.0.2:26379/mymaster/0"),
    "valkey": ("redis", "valkey://127.0.0.1:6379/0"),
    "valkeys": ("redis", "valkeys://:password@valkey.example.com:6380/0"),
    "valkey+unix": ("redis", "valkey+unix:///var/run/valkey/valkey.sock?db=0"),
    "valkey+cluster": ("cluster", "valkey+cluster://10.0.0.1:7000"),
    "valkeys+cluster": ("cluster", "valkeys+cluster://10.0.0.1:7000"),
    "valkey+sentinel": ("sentinel", "valkey+sentinel://10.0.0.1:26379,10.0.0.2:26379/mymaster/0"),
    "valkeys+sentinel": ("sentinel",
                         "valkeys+sentinel://10.0.0.1:26379,10.0.0.2:26379/mymaster/0"),
    "memory": ("memory", "memory://"),
}
# Each Valkey scheme → its Redis twin: what it means, and what redis-py reads (``valkey+unix``
# names a Unix socket, as ``unix://`` does).
VALKEY = {"valkey": "redis", "valkeys": "rediss", "valkey+unix": "unix",
          "valkey+cluster": "redis+cluster", "valkeys+cluster": "rediss+cluster",
          "valkey+sentinel": "redis+sentinel", "valkeys+sentinel": "rediss+sentinel"}
SENTINEL_PORT = 26379


_BOOLS = {"1": True, "true": True, "yes": True, "on": True,
          "0": False, "false": False, "no": False, "off": False}

# Option → (converter, the check its value must pass, what a valid value looks like).
_CONVERT: dict[str, tuple[Callable[[str], Any], Callable[[Any], bool], str]] = {
    # 0 would make a socket non-blocking: every call would fail at once.
    **dict.fromkeys(("socket_timeout", "socket_connect_timeout"), (
        float, lambda value: 0 < value < math.inf, "a number of seconds above 0, e.g. 0.1")),
    **dict.fromkeys(("socket_keepalive", "retry_on_timeout", "ssl_check_hostname"), (
        lambda text: _BOOLS[text.lower()], lambda value: True, "true or false")),
    **dict.fromkeys(("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "sentinel_username",
                     "sentinel_password"), (str, lambda value: True, "text")),
    "timeout": (float, lambda value: 0 <= value < math.inf, "a number of seconds, e.g. 0.1"),
    "health_check_interval": (int, lambda value: value >= 0, "a whole number of seconds, e.g. 0"),
    "max_connections": (int, lambda value: value >= 0, "a whole number, e.g. 100"),
    "db": (int, lambda value: value >= 0, "a database number, e.g. 0"),
    "protocol": (int, lambda value: value in (2, 3), "2 or 3"),
    # CLIENT SETNAME refuses spaces, newlines and other special characters.
    "client_name": (str, lambda value: value.isascii() and all(33 <= ord(c) <= 126 for c in value),
                    "a name without spaces, e.g. api-worker"),
    "ssl_cert_reqs": (str.lower, lambda value: value in ("none", "optional", "required"),
                      "none, optional or required"),
}
_COMMON = frozenset({"socket_timeout", "socket_connect_timeout", "health_check_interval",
                     "max_connections", "socket_keepalive", "retry_on_timeout",
                     "client_name", "protocol"})
_TLS = frozenset({"ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile",
                  "ssl_check_hostname"})
_ALLOWED = {
    "redis": _COMMON | {"timeout", "db"},
    "cluster": _COMMON,
    "sentinel": _COMMON | {"sentinel_username", "sentinel_password"},
}


@dataclass(frozen=True)
class BackendURL:
    """A checked backend URL. ``client_url`` is what redis-py's ``from_url`` reads for the
    single-node and cluster kinds (without ``+cluster`` and the query); ``options`` are the
    query's, typed. Sentinel URLs are read here whole (``sentinels``, ``service``, ``db``, the
    primary's credentials)."""

    kind: str  # "redis" | "cluster" | "sentinel" | "memory"
    scheme: str
    client_url: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    sentinels: tuple[tuple[str, int], ...] = ()
    service: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None

    @property
    def tls(self) -> bool:
        return _is_tls(self.scheme)


def _is_tls(scheme: str) -> bool:
    return VALKEY.get(scheme, scheme).startswith("rediss")


def _fail(url: str, problem: str, scheme: str = "redis") -> ConfigurationError:
    example = SCHEMES.get(scheme, SCHEMES["redis"])[1]
    return ConfigurationError(f"bad backend URL {redact(url)!r}: {problem}; e.g. {example!r}")


def redact(url: str) -> str:
    """The URL with every password hidden, for messages (they end up in logs); text-based,
    so that it holds for URLs the parser refuses. The user information is everything before
    the LAST '@' ahead of the query (a password may hold '@' or '/'); a query option whose
    name holds "password" loses its value."""
    head, sep, rest = url.partition("://")
    if not sep:
        head, rest = "", url
    main, question, query = rest.partition("?")
    userinfo, at, hosts = main.rpartition("@")
    if at and ":" in userinfo:  # a user alone ("user@host") is no secret
        main = f"{userinfo.split(':', 1)[0]}:***@{hosts}"
    if question:
        query = "&".join(
            f"{name}=***" if "password" in name.lower() and is_set else f"{name}{is_set}{value}"
            for name, is_set, value in (item.partition("=") for item in query.split("&"))
        )
    return f"{head}{sep}{main}{question}{query}"


def parse(url: str) -> BackendURL:
    """Check `url` and read it; ConfigurationError (with an example) when it is wrong."""
    if not isinstance(url, str):
        raise ConfigurationError(f"a backend URL is a string, got {type(url).__name__}; "
                                 f"e.g. {SCHEMES['redis'][1]!r}")
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise _fail(url, "no scheme (redis://, rediss://, unix://, redis+cluster://, "
                         "redis+sentinel://, their valkey:// twins or memory://)")
    scheme = scheme.lower()
    if scheme not in SCHEMES:
        raise _fail(url, f"unknown scheme {scheme + '://'!r}; one of "
                         + ", ".join(f"{s}://" for s in SCHEMES))
    kind = SCHEMES[scheme][0]
    if kind == "memory":
        if rest:
            raise _fail(url, "memory:// takes no host, path or options", "memory")
        return BackendURL(kind="memory", scheme=scheme)
    body, _, query = rest.partition("?")
    if "#" in query or "#" in body:
        raise _fail(url, "a URL fragment ('#...') means nothing here; a '#' in a password "
                         "is written %23", scheme)
    options = _options(url, query, kind, scheme)
    if kind == "sentinel":
        return _sentinel(url, scheme, body, options)
    return _single_or_cluster(url, scheme, kind, body, options)


def _options(url: str, query: str, kind: str, scheme: str) -> dict[str, Any]:
    allowed = _ALLOWED[kind] | (_TLS if _is_tls(scheme) else frozenset())
    options: dict[str, Any] = {}
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as exc:
        raise _fail(url, f"the query string is not name=value pairs ({exc})", scheme) from exc
    for name, text in pairs:
        if name not in allowed:
            known = ", ".join(sorted(allowed))
            hint = " (TLS options need rediss:// or valkeys://)" if name in _TLS else ""
            raise _fail(url, f"unknown option {name!r}{hint}; known: {known}", scheme)
        if name in options:
            raise _fail(url, f"option {name!r} is given twice", scheme)
        convert, valid, looks_like = _CONVERT[name]
        try:
            options[name] = value = convert(text)
        except (ValueError, KeyError):
            value = None
        if value is None or not valid(value):
            raise _fail(url, f"{name} must be {looks_like}, got {text!r}", scheme)
    return options


def _split(url: str, text: str, scheme: str) -> SplitResult:
    """urlsplit, whose ValueError (an unclosed "[" of an IPv6 address) says what to write."""
    try:
        return urlsplit(text)
    except ValueError as exc:
        raise _fail(url, f"{exc}: an IPv6 address goes in brackets, e.g. [::1]:6379",
                    scheme) from exc


def _single_or_cluster(url: str, scheme: str, kind: str, body: str,
                       options: dict[str, Any]) -> BackendURL:
    plain = VALKEY.get(scheme, scheme).replace("+cluster", "")  # what redis-py reads
    if plain == "unix":
        path = body.rpartition("@")[2]
        if not path.startswith("/") or path == "/":
            raise _fail(url, f"{scheme}:// needs the socket's absolute path", scheme)
        return BackendURL(kind=kind, scheme=scheme, client_url=f"{plain}://{body}",
                          options=options, db=options.get("db", 0))
    parts = _split(url, f"{plain}://{body}", scheme)
    if not parts.hostname:
        raise _fail(url, "no host", scheme)
    if "," in parts.netloc:
        raise _fail(url, "one start-up host only: the cluster's other nodes are discovered "
                         "from it", scheme)
    try:
        parts.port  # noqa: B018 - urlsplit checks the port only when it is read
    except ValueError as exc:
        raise _fail(url, "the port must be a number from 1 to 65535", scheme) from exc
    db = options.get("db", 0)
    path = parts.path.strip("/")
    if path:
        if not path.isdigit():
            raise _fail(url, f"the path is the database number, got {path!r}", scheme)
        if "db" in options:
            raise _fail(url, "the database is given twice (path and ?db=)", scheme)
        db = int(path)
    if kind == "cluster" and db:
        raise _fail(url, "a Redis Cluster has database 0 only", scheme)
    return BackendURL(kind=kind, scheme=scheme,
                      client_url=f"{plain}://{parts.netloc}/{db}", options=options, db=db)


def _address(url: str, text: str, scheme: str) -> tuple[str, int]:
    parts = _split(url, f"//{text}", scheme)
    if not parts.hostname:
        raise _fail(url, f"no host in the sentinel address {text!r}", scheme)
    try:
        port = parts.port
    except ValueError as exc:
        raise _fail(url, f"the port of the sentinel address {text!r} must be a number",
                    scheme) from exc
    return parts.hostname, port or SENTINEL_PORT


def _sentinel(url: str, scheme: str, body: str, options: dict[str, Any]) -> BackendURL:
    netloc, _, path = body.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    if not hosts:
        raise _fail(url, "no sentinel address", scheme)
    sentinels = tuple(_address(url, part, scheme) for part in hosts.split(","))
    segments = [s for s in path.split("/") if s]
    if not segments:
        raise _fail(url, "the path names the service Sentinel watches (the name after "
                         "'sentinel monitor')", scheme)
    if len(segments) > 2:
        raise _fail(url, "the path is /service or /service/db", scheme)
    db = segments[1] if len(segments) == 2 else "0"
    if not db.isdigit():
        raise _fail(url, f"the database after the service must be a number, got {db!r}", scheme)
    return BackendURL(kind="sentinel", scheme=scheme, options=options, sentinels=sentinels,
                      service=unquote(segments[0]), db=int(db), username=username,
                      password=password)
