"""Who is the client? Pure resolution of the client address from the peer and proxy headers.

Security model (the same one as Werkzeug's ``ProxyFix``):

* The socket peer is the client, unless the peer is a proxy you trust. Every byte of a
  ``Forwarded`` or ``X-Forwarded-For`` header can be written by the client, so these headers
  are read **only** when trusted proxies are configured (``TrustedProxies``); without that
  configuration a spoofed header changes nothing.
* A trusted proxy appends the address it received the request from to the **right** of the
  header. Only the right end is therefore worth anything, and the header is walked from right
  to left:

  - With networks (``TrustedProxies(["10.0.0.0/8", "::1"])``): the peer must itself be
    trusted, otherwise it is the client. Then every address inside the trusted networks is a
    proxy hop and is skipped; the first address outside them is the client. An element with no
    usable address (``unknown``, an obfuscated ``_name``, an empty element, garbage) stops the
    walk: whatever lies to its left was written by somebody we cannot vouch for, so the client
    is the last trusted hop (the address just to its right, or the peer). If every element is
    trusted, the leftmost is the client.
  - With a hop count (``TrustedProxies(2)``): exactly that many proxies sit in front of the
    app and each appended one entry, so the client is the N-th entry from the right (Werkzeug
    ``ProxyFix(x_for=N)`` semantics). Fewer entries than N, or garbage in that position, means
    the request did not come through the expected proxies: the peer is the client. The peer is
    not examined, which is what makes a hop count work behind a proxy on a Unix socket (where
    there is no peer address to match against networks).

* ``Forwarded`` (RFC 7239) is used when the request carries it, otherwise
  ``X-Forwarded-For``. Consequence: if your proxies maintain only ``X-Forwarded-For``, they
  must strip a client-sent ``Forwarded`` header, or a client can choose its address.
* An IPv4-mapped IPv6 address (``::ffff:192.0.2.1``) is the IPv4 client, in headers, in the
  peer and in the trusted networks, so one client has one identity whichever socket family
  reached it.
* Garbage never raises; it is an unusable element. Work is bounded whatever the client sends:
  only the rightmost ``MAX_HEADER_CHARS`` (8 KiB) of a header are looked at (the partial
  element at the cut is dropped) and at most ``MAX_ELEMENTS`` (64) elements are examined from
  the right. A walk that reaches either bound without finding the client stops at the last
  trusted hop, as for garbage.
* ``Forwarded`` elements are split right to left, and a comma inside a quoted string merges
  fragments only leftwards. Text a client puts to the left of (or, properly escaped, inside)
  an element a trusted proxy appended can therefore never change how that element parses;
  a left-to-right parser would let an unterminated quote from the client swallow it.

This module imports no web framework; ``ratelimit_mw.keys`` adapts it to request objects.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import lru_cache
from ipaddress import (
    IPv4Address,
    IPv4Network,
    IPv6Address,
    IPv6Network,
    collapse_addresses,
    ip_address,
    ip_network,
)
from itertools import islice
from typing import TypeAlias

from ratelimit_mw.core.errors import ConfigurationError

__all__ = ["MAX_ELEMENTS", "MAX_HEADER_CHARS", "IPAddress", "TrustedProxies", "check_ipv6_prefix",
           "ip_key", "resolve_client"]

IPAddress: TypeAlias = IPv4Address | IPv6Address

#: Only this many characters from the right end of a header are examined.
MAX_HEADER_CHARS = 8192
#: At most this many elements are examined, from the right.
MAX_ELEMENTS = 64

# The longest textual address ipaddress accepts is 45 characters (full IPv6 with an embedded
# IPv4): longer text never reaches the parser or its cache, however large the headers.
_MAX_ADDR_CHARS = 45
# "[" + 45 + "]:" + a port; longer obfuscated ports exist in theory, not in practice.
_MAX_NODE_CHARS = 64

_EXAMPLE = 'trusted_proxies=["10.0.0.0/8", "127.0.0.1", "::1"] or trusted_proxies=1'
_OBFPORT_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
_MAPPED_V4 = IPv6Network("::ffff:0:0/96")
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"', re.S)
_ESCAPED = re.compile(r"\\(.)", re.S)


class TrustedProxies:
    """The proxies whose forwarding headers are believed: IP networks
    (``TrustedProxies(["10.0.0.0/8", "::1"])``, held in ``networks``, IPv4-mapped ones as IPv4)
    or the number of proxies in front of the app (``TrustedProxies(1)``, held in ``hops``)."""

    __slots__ = ("_v4", "_v6", "hops", "networks")

    def __init__(self, spec: Sequence[str] | int) -> None:
        if isinstance(spec, (str, bytes)):
            # A bare string is iterable character by character: "10.0.0.1" would become
            # ["1", "0", ...] and fail confusingly, or worse, succeed.
            raise ConfigurationError(f"trusted_proxies must be a list, not the single string "
                                     f"{spec!r}; write trusted_proxies=[{spec!r}] ({_EXAMPLE})")
        # bool is an int subclass; True would silently mean "one hop".
        if isinstance(spec, bool) or not isinstance(spec, (int, Iterable)):
            raise ConfigurationError(f"trusted_proxies must be a list of networks or a hop "
                                     f"count, not {spec!r}; write {_EXAMPLE}")
        if isinstance(spec, int) and not 0 <= spec <= MAX_ELEMENTS:
            raise ConfigurationError(
                f"trusted_proxies hop count must be between 0 and {MAX_ELEMENTS}, got {spec};"
                " write e.g. trusted_proxies=1 for one proxy in front"
            )
        self.hops = spec if isinstance(spec, int) else None
        self.networks: tuple[IPv4Network | IPv6Network, ...] = (
            () if isinstance(spec, int) else tuple(map(_parse_trusted_network, spec)))
        # (network, mask) integer pairs per family: a bitwise test, cheaper than
        # `addr in network`, against the address's own family only.
        v4, v6 = ([n for n in self.networks if n.version == version] for version in (4, 6))
        for family, members in ((4, v4), (6, v6)):
            # Entries may together cover a family (0.0.0.0/1 and 128.0.0.0/1) as 0.0.0.0/0 does.
            whole = list(collapse_addresses(members))  # type: ignore[type-var]
            if len(whole) == 1 and whole[0].prefixlen == 0:
                raise ConfigurationError(
                    f"trusted_proxies {[str(n) for n in members]!r} cover every IPv{family}"
                    " address, so any client could choose its own IP through X-Forwarded-For;"
                    " list your proxies' networks, or give the number of proxies in front of"
                    " the app, e.g. trusted_proxies=1"
                )
        self._v4 = tuple((int(n.network_address), int(n.netmask)) for n in v4)
        self._v6 = tuple((int(n.network_address), int(n.netmask)) for n in v6)

    def __contains__(self, addr: object) -> bool:
        """Is ``addr`` inside the trusted networks? (Always False for a hop count.)"""
        if isinstance(addr, IPv4Address):
            pairs = self._v4
        elif isinstance(addr, IPv6Address):
            pairs = self._v6
        else:
            return False
        value = int(addr)
        return any(value & mask == net for net, mask in pairs)

    def __repr__(self) -> str:
        shown = self.hops if self.hops is not None else [str(n) for n in self.networks]
        return f"TrustedProxies({shown!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TrustedProxies):
            return NotImplemented
        return (self.hops, self.networks) == (other.hops, other.networks)

    def __hash__(self) -> int:
        return hash((self.hops, self.networks))


def _parse_trusted_network(item: object) -> IPv4Network | IPv6Network:
    if not isinstance(item, str):
        raise ConfigurationError(f"trusted_proxies entries must be strings such as '10.0.0.0/8',"
                                 f" got {item!r}; write {_EXAMPLE}")
    text = item.strip()
    if "%" in text:
        # A zone id names an interface of this host, not an address a header can carry.
        raise ConfigurationError(
            f"trusted_proxies entry {item!r} has a zone id (%...); drop it, e.g. 'fe80::/10'"
        )
    try:
        network = ip_network(text)
    except ValueError:
        # Host bits set ("10.0.0.1/8") is the common typo: say which network was meant rather
        # than guess, since trusting too much or too little are both security mistakes.
        try:
            loose = ip_network(text, strict=False)
        except ValueError:
            raise ConfigurationError(f"trusted_proxies entry {item!r} is not an IP address or "
                                     f"network; write {_EXAMPLE}") from None
        raise ConfigurationError(
            f"trusted_proxies entry {item!r} has host bits set; write {str(loose)!r}"
            f" for the whole network or {text.split('/')[0]!r} for the single address"
        ) from None
    if isinstance(network, IPv6Network) and network.subnet_of(_MAPPED_V4):
        # Addresses are mapped to IPv4 before the test, so the network must be too.
        return IPv4Network((int(network.network_address) & 0xFFFFFFFF, network.prefixlen - 96))
    return network


def check_ipv6_prefix(value: object) -> int:
    """Validate an IPv6 grouping prefix at configuration; returns it."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 128:
        raise ConfigurationError(
            f"ipv6_prefix must be an integer from 0 to 128, got {value!r};"
            " write e.g. ipv6_prefix=64 (one bucket per /64, the usual allocation to one"
            " host or LAN) or ipv6_prefix=128 (one bucket per address)"
        )
    return value


@lru_cache(maxsize=4096)
def _parse_ip(text: str) -> IPAddress | None:
    """An address from exact text (no port, no brackets; callers keep it short, the cache
    key), IPv4-mapped folded to IPv4."""
    if "%" in text or not text.isascii():
        # Zone ids are host-local; non-ASCII digits are not digits in an address.
        return None
    try:
        addr = ip_address(text)
    except ValueError:
        return None
    mapped = addr.ipv4_mapped if isinstance(addr, IPv6Address) else None
    return addr if mapped is None else mapped


def _is_port(text: str) -> bool:
    # RFC 7239 node-port: 1*5DIGIT (we also demand <= 65535) or an obfuscated "_name".
    if text[:1] == "_":
        return len(text) > 1 and set(text) <= _OBFPORT_CHARS
    return 0 < len(text) <= 5 and text.isascii() and text.isdigit() and int(text) <= 65535


@lru_cache(maxsize=4096)
def _parse_node(text: str) -> IPAddress | None:
    """An address from a header node: ``1.2.3.4``, ``1.2.3.4:80``, ``2001:db8::1``,
    ``[2001:db8::1]`` or ``[2001:db8::1]:443``. ``unknown`` / ``_obf`` / garbage → None.
    Callers strip the text and bound it to _MAX_NODE_CHARS (the cache key)."""
    if text[:1] == "[":
        inner, bracket, rest = text[1:].partition("]")
        # Brackets are for IPv6 only; "[1.2.3.4]" is malformed (a mapped v6 inside is fine).
        if not bracket or (rest and (rest[0] != ":" or not _is_port(rest[1:]))):
            return None
        return _parse_ip(inner) if ":" in inner and len(inner) <= _MAX_ADDR_CHARS else None
    if text.count(":") == 1:
        # Exactly one colon: an IPv4 address with a port (an IPv6 address has at least two).
        host, _, port = text.partition(":")
        return _parse_ip(host) if "." in host and _is_port(port) else None
    return _parse_ip(text) if 0 < len(text) <= _MAX_ADDR_CHARS else None


def _node(text: str) -> IPAddress | None:
    text = text.strip(" \t")
    return _parse_node(text) if len(text) <= _MAX_NODE_CHARS else None


def _parse_peer(peer: object) -> IPAddress | None:
    if not isinstance(peer, str):
        return None
    text = peer.strip()
    if "%" in text and ":" in text:
        # A link-local peer arrives as "fe80::1%eth0"; the zone names our interface, not the
        # client, so it is dropped (in headers, by contrast, a zone id is garbage).
        text = text.partition("%")[0]
    return _parse_ip(text) if len(text) <= _MAX_ADDR_CHARS else None


def _window(value: str) -> list[str]:
    """The comma-separated fragments of a header's right end, left to right."""
    if len(value) <= MAX_HEADER_CHARS:
        return value.split(",")
    # The leftmost fragment was cut in the middle: it is not an element of the header.
    return value[-MAX_HEADER_CHARS:].split(",")[1:]


def _quote_count(text: str) -> int:
    """Unescaped double quotes in ``text``. A backslash escapes the next character even
    outside a quoted string (where it is invalid anyway): a fragment cut from inside a
    proxy's quoted string then still counts the proxy's escaped quotes (\\") as escaped, so
    the fragment holding the closing quote is seen as unbalanced and merges leftwards."""
    return _ESCAPED.sub("", text).count('"') if "\\" in text else text.count('"')


def _forwarded_elements(value: str) -> Iterator[str]:
    """Forwarded elements, right to left: comma-split fragments merged leftwards until the
    quotes balance (the module docstring says why not left to right). The quote count of a
    join is the sum of its parts' counts, so each fragment is scanned once."""
    fragments = _window(value)
    end = len(fragments)  # exclusive end of the element being assembled
    parity = 0
    for i in range(len(fragments) - 1, -1, -1):
        parity ^= _quote_count(fragments[i]) & 1
        if not parity:
            yield fragments[i] if end == i + 1 else ",".join(fragments[i:end])
            end = i
    if end > 0:
        # An unterminated quote reached the left end: one unusable element.
        yield ",".join(fragments[:end])


def _split_pairs(element: str) -> Iterator[str]:
    """The ``;``-separated pairs of a Forwarded element, honouring quoted strings."""
    if "\\" not in element:
        # Without escapes a ";" is inside quotes exactly when an odd number of quotes precede
        # it, so the plain split is right when every piece has an even count.
        pairs = element.split(";")
        if all(pair.count('"') % 2 == 0 for pair in pairs):
            yield from pairs
            return
    start = 0
    in_quote = False
    i = 0
    while i < len(element):
        c = element[i]
        if c == "\\":
            i += 1  # the escaped character is skipped
        elif c == '"':
            in_quote = not in_quote
        elif c == ";" and not in_quote:
            yield element[start:i]
            start = i + 1
        i += 1
    yield element[start:]


def _unquote(value: str) -> str | None:
    """A token, or the content of a quoted-string; None if malformed."""
    if not value.startswith('"'):
        return None if '"' in value or "\\" in value else value
    if "\\" not in value:  # valid iff the only other quote is the last character
        inner = value[1:-1]
        return inner if len(value) >= 2 and value[-1] == '"' and '"' not in inner else None
    match = _QUOTED.fullmatch(value)
    return None if match is None else _ESCAPED.sub(lambda escaped: escaped[1], match[1])


def _forwarded_node(element: str) -> IPAddress | None:
    """The address in one Forwarded element's ``for=`` parameter, or None if unusable."""
    found: str | None = None
    for pair in _split_pairs(element):
        name, eq, raw = pair.partition("=")
        if name.strip(" \t").lower() != "for":
            continue
        if not eq or found is not None:
            # "for" without a value, or twice in one element (RFC 7239 forbids it): which
            # one would be the proxy's? Neither can be trusted.
            return None
        found = _unquote(raw.strip(" \t"))
        if found is None:
            return None
    return None if found is None else _node(found)



def resolve_client(
    peer: str | None,
    forwarded: str | None,
    x_forwarded_for: str | None,
    trusted: TrustedProxies | None,
) -> IPAddress | None:
    """The client address, or None if there is no usable one; never raises.

    ``peer`` is the socket peer's host (ASGI ``scope["client"][0]``, WSGI ``REMOTE_ADDR``).
    ``forwarded`` and ``x_forwarded_for`` are the header values with multiple header lines
    joined by commas (None when absent). Headers are ignored unless ``trusted`` is given:
    from peer 10.0.0.2, ``X-Forwarded-For: 203.0.113.7, 10.0.0.1`` with trusted 10.0.0.0/8
    gives 203.0.113.7.
    """
    peer_addr = _parse_peer(peer)
    elements: Iterator[str]
    parse: Callable[[str], IPAddress | None]
    if trusted is None:
        return peer_addr
    if forwarded is not None:
        elements, parse = _forwarded_elements(forwarded), _forwarded_node
    elif x_forwarded_for is not None:
        elements, parse = reversed(_window(x_forwarded_for)), _node
    else:
        return peer_addr
    elements = islice(elements, MAX_ELEMENTS)  # right to left, at most MAX_ELEMENTS
    if trusted.hops is not None:
        # The N-th entry from the right; fewer entries than proxies, or garbage there: not
        # the path we were told about.
        element = next(islice(elements, trusted.hops - 1, None), None) if trusted.hops else None
        addr = None if element is None else parse(element)
        return peer_addr if addr is None else addr
    if peer_addr is None or peer_addr not in trusted:
        # Not from a trusted proxy (or no address at all, e.g. a Unix socket: a hop count
        # handles that case): nobody we trust wrote the headers.
        return peer_addr
    last = peer_addr
    for element in elements:
        addr = parse(element)
        if addr is None:
            return last
        if addr not in trusted:
            return addr
        last = addr
    return last


def ip_key(addr: IPAddress, ipv6_prefix: int = 64) -> str:
    """The identity text of an address: IPv4 as is, IPv6 as its network of ``ipv6_prefix``
    (``2001:db8:1:2::/64``; ``128``: the address). One IPv6 host usually owns a whole /64:
    per-address buckets would let it rotate through 2**64 identities."""
    if isinstance(addr, IPv4Address):
        return str(addr)
    mapped = addr.ipv4_mapped
    if mapped is not None:
        return str(mapped)
    if not 0 <= ipv6_prefix <= 128:  # check_ipv6_prefix guards configuration; this, callers
        raise ValueError(f"ipv6_prefix must be 0..128, got {ipv6_prefix!r}")
    return _ipv6_key(addr, ipv6_prefix)


@lru_cache(maxsize=4096)
def _ipv6_key(addr: IPv6Address, prefix: int) -> str:
    # Cached: str() of an IPv6 address runs the compression algorithm every time.
    if prefix == 128:
        return str(IPv6Address(int(addr)))  # int() drops any scope id
    mask = ((1 << prefix) - 1) << (128 - prefix)
    return f"{IPv6Address(int(addr) & mask)}/{prefix}"
