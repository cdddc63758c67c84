"""Client address resolution: the peer, trusted proxies and forwarding headers.

The table reads as the specification: (peer, Forwarded, X-Forwarded-For, trusted_proxies)
→ the client address (None: no usable address).
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.keys.client_ip import (
    MAX_ELEMENTS,
    MAX_HEADER_CHARS,
    TrustedProxies,
    check_ipv6_prefix,
    ip_key,
    resolve_client,
)

NETS = ["10.0.0.0/8", "::1", "fd00::/8"]
PROXY = "10.0.0.1"  # a trusted peer
CLIENT = "203.0.113.9"
SPOOF = "198.51.100.66"  # what a client would like to be


def ip(text: str | None) -> Any:
    return None if text is None else ipaddress.ip_address(text)


# (id, peer, forwarded, x_forwarded_for, trusted_proxies, expected client)
CASES: list[tuple[str, str | None, str | None, str | None, Any, str | None]] = [
    # --- no trusted proxies: the peer, whatever the headers say ---------------------------
    ("no trust: peer", CLIENT, None, None, None, CLIENT),
    ("no trust: spoofed XFF ignored", CLIENT, None, SPOOF, None, CLIENT),
    ("no trust: spoofed Forwarded ignored", CLIENT, f"for={SPOOF}", SPOOF, None, CLIENT),
    ("no trust: IPv6 peer", "2001:db8::7", None, SPOOF, None, "2001:db8::7"),
    ("no trust: IPv4-mapped peer is IPv4", f"::ffff:{CLIENT}", None, None, None, CLIENT),
    ("no trust: zone id dropped from peer", "fe80::1%eth0", None, None, None, "fe80::1"),
    ("no trust: no peer", None, None, SPOOF, None, None),
    ("no trust: non-IP peer", "testclient", None, SPOOF, None, None),
    ("no trust: empty peer", "", None, None, None, None),
    # --- trusted networks: X-Forwarded-For ------------------------------------------------
    ("nets: untrusted peer is the client", CLIENT, None, SPOOF, NETS, CLIENT),
    ("nets: untrusted peer, Forwarded ignored", CLIENT, f"for={SPOOF}", None, NETS, CLIENT),
    ("nets: trusted peer, no headers", PROXY, None, None, NETS, PROXY),
    ("nets: one hop", PROXY, None, CLIENT, NETS, CLIENT),
    ("nets: spoofed left part ignored", PROXY, None, f"{SPOOF}, {CLIENT}", NETS, CLIENT),
    (
        "nets: trusted hops skipped",
        PROXY,
        None,
        f"{SPOOF}, {CLIENT}, 10.0.0.7, 10.9.9.9",
        NETS,
        CLIENT,
    ),
    ("nets: no spaces", PROXY, None, f"{SPOOF},{CLIENT},10.0.0.7", NETS, CLIENT),
    ("nets: IPv6 trusted peer", "::1", None, CLIENT, NETS, CLIENT),
    ("nets: all trusted → leftmost", PROXY, None, "10.0.0.3, 10.0.0.2", NETS, "10.0.0.3"),
    ("nets: empty element stops the walk", PROXY, None, f"{CLIENT}, , 10.0.0.2", NETS, "10.0.0.2"),
    ("nets: garbage stops the walk", PROXY, None, f"{CLIENT}, bogus, 10.0.0.2", NETS, "10.0.0.2"),
    ("nets: garbage first → peer", PROXY, None, f"{CLIENT}, bogus", NETS, PROXY),
    ("nets: unknown stops the walk", PROXY, None, f"{CLIENT}, unknown", NETS, PROXY),
    ("nets: empty header → peer", PROXY, None, "", NETS, PROXY),
    ("nets: trailing comma → peer", PROXY, None, f"{CLIENT},", NETS, PROXY),
    ("nets: v4 with port", PROXY, None, f"{CLIENT}:4711", NETS, CLIENT),
    ("nets: bracketed v6 with port", PROXY, None, "[2001:db8::7]:443", NETS, "2001:db8::7"),
    ("nets: bracketed v6", PROXY, None, "[2001:db8::7]", NETS, "2001:db8::7"),
    ("nets: bare v6", PROXY, None, "2001:db8::7, ::1", NETS, "2001:db8::7"),
    ("nets: mapped entry is IPv4", PROXY, None, f"::ffff:{CLIENT}", NETS, CLIENT),
    ("nets: mapped proxy is trusted", PROXY, None, f"{CLIENT}, ::ffff:10.0.0.4", NETS, CLIENT),
    ("nets: mapped peer is trusted", "::ffff:10.0.0.1", None, CLIENT, NETS, CLIENT),
    ("nets: no peer → None", None, None, CLIENT, NETS, None),
    ("nets: garbage peer → None", "unix:/run/app.sock", None, CLIENT, NETS, None),
    # --- trusted networks: Forwarded (RFC 7239) -------------------------------------------
    ("fwd: preferred over XFF", PROXY, f"for={CLIENT}", SPOOF, NETS, CLIENT),
    ("fwd: empty still preferred → peer", PROXY, "", CLIENT, NETS, PROXY),
    ("fwd: quoted v4 with port", PROXY, f'for="{CLIENT}:47011"', None, NETS, CLIENT),
    (
        "fwd: quoted bracketed v6 with port",
        PROXY,
        'for="[2001:db8:cafe::17]:4711"',
        None,
        NETS,
        "2001:db8:cafe::17",
    ),
    ("fwd: quoted bracketed v6", PROXY, 'for="[2001:db8::17]"', None, NETS, "2001:db8::17"),
    ("fwd: obfuscated port", PROXY, f'for="{CLIENT}:_p1"', None, NETS, CLIENT),
    ("fwd: parameter name case", PROXY, f"For={CLIENT};proto=http", None, NETS, CLIENT),
    ("fwd: for after other params", PROXY, f"proto=https;for={CLIENT};by=_b", None, NETS, CLIENT),
    ("fwd: spaces around pairs", PROXY, f"proto=https; for = {CLIENT}", None, NETS, CLIENT),
    (
        "fwd: elements walked from the right",
        PROXY,
        f"for={SPOOF}, for={CLIENT};proto=https, for=10.0.0.7;by=10.0.0.1",
        None,
        NETS,
        CLIENT,
    ),
    ("fwd: all trusted → leftmost", PROXY, "for=10.0.0.7, for=10.0.0.8", None, NETS, "10.0.0.7"),
    ("fwd: unknown rightmost → peer", PROXY, f"for={CLIENT}, for=unknown", None, NETS, PROXY),
    (
        "fwd: unknown stops at last trusted hop",
        PROXY,
        f"for={CLIENT}, for=unknown, for=10.0.0.3",
        None,
        NETS,
        "10.0.0.3",
    ),
    (
        "fwd: obfuscated stops at last trusted hop",
        PROXY,
        f"for={CLIENT}, for=_hidden, for=10.0.0.3",
        None,
        NETS,
        "10.0.0.3",
    ),
    ("fwd: quoted obfuscated → peer", PROXY, 'for="_gazonk"', None, NETS, PROXY),
    ("fwd: element without for → peer", PROXY, "proto=https;by=10.0.0.1", None, NETS, PROXY),
    ("fwd: empty element → peer", PROXY, f"for={CLIENT}, ", None, NETS, PROXY),
    ("fwd: for twice in one element", PROXY, f"for={SPOOF};for={CLIENT}", None, NETS, PROXY),
    ("fwd: for without value", PROXY, "for", None, NETS, PROXY),
    ("fwd: unterminated quote", PROXY, f'for="{CLIENT}', None, NETS, PROXY),
    ("fwd: quote inside token", PROXY, 'for=203.0.113."9"', None, NETS, PROXY),
    ("fwd: text after closing quote", PROXY, f'for="{CLIENT}"x', None, NETS, PROXY),
    ("fwd: v4 in brackets", PROXY, f'for="[{CLIENT}]"', None, NETS, PROXY),
    ("fwd: unquoted bare v6 tolerated", PROXY, "for=2001:db8::9", None, NETS, "2001:db8::9"),
    ("fwd: mapped v6 is IPv4", PROXY, f'for="[::ffff:{CLIENT}]"', None, NETS, CLIENT),
    ("fwd: escaped chars unquoted", PROXY, 'for="\\2\\03.0.113.9"', None, NETS, CLIENT),
    (
        "fwd: comma inside a quoted value",
        PROXY,
        f'for={CLIENT};host="a,b", for=10.0.0.9',
        None,
        NETS,
        CLIENT,
    ),
    (
        "fwd: client's unterminated quote cannot swallow the proxy's element",
        PROXY,
        f'for="{SPOOF}, for={CLIENT}',
        None,
        NETS,
        CLIENT,
    ),
    (
        "fwd: escaped quotes in a proxy's quoted value cannot inject an element",
        PROXY,
        f'for=10.0.0.9;host="a, \\"x, for={SPOOF};q=\\"z"',
        None,
        NETS,
        "10.0.0.9",
    ),
    (
        "fwd: escaped quote and ; inside a quoted value",
        PROXY,
        f'for={CLIENT};host="a\\";b"',
        None,
        NETS,
        CLIENT,
    ),
    ("fwd: backslash outside quotes is garbage", PROXY, f"x=\\;for={CLIENT}", None, NETS, PROXY),
    # --- hop counts (Werkzeug ProxyFix x_for=N) --------------------------------------------
    ("hops 0: peer only", CLIENT, f"for={SPOOF}", SPOOF, 0, CLIENT),
    ("hops 1: last entry", "172.17.0.1", None, f"{SPOOF}, {CLIENT}", 1, CLIENT),
    ("hops 2: second from the right", "172.17.0.1", None, f"{CLIENT}, 10.1.1.1", 2, CLIENT),
    ("hops 1: peer not examined", CLIENT, None, "192.0.2.1", 1, "192.0.2.1"),
    ("hops 1: works without a peer (Unix socket)", None, None, CLIENT, 1, CLIENT),
    ("hops 3: too few entries → peer", PROXY, None, f"{SPOOF}, {CLIENT}", 3, PROXY),
    ("hops 1: no header → peer", PROXY, None, None, 1, PROXY),
    ("hops 1: empty header → peer", PROXY, None, "", 1, PROXY),
    ("hops 2: N-th is garbage → peer", PROXY, None, f"bogus, {CLIENT}", 2, PROXY),
    ("hops 1: N-th is unknown → peer", PROXY, "for=unknown", None, 1, PROXY),
    ("hops 2: garbage right of N-th is ignored", PROXY, None, f"{CLIENT}, x", 2, CLIENT),
    ("hops 1: Forwarded preferred", PROXY, 'for="[2001:db8::5]:1"', SPOOF, 1, "2001:db8::5"),
    ("hops 1: mapped entry is IPv4", PROXY, None, f"::ffff:{CLIENT}", 1, CLIENT),
    # --- garbage: never raises, falls back --------------------------------------------------
    ("garbage: huge token", PROXY, None, "9" * 100_000, NETS, PROXY),
    ("garbage: fullwidth digits", PROXY, None, "２０３.０.１１３.９", NETS, PROXY),
    ("garbage: Arabic-Indic digits", PROXY, None, "٢٠٣.0.113.9", NETS, PROXY),
    ("garbage: NUL", PROXY, None, f"{CLIENT}\x00", NETS, PROXY),
    ("garbage: CR LF", PROXY, None, f"{CLIENT}\r\n", NETS, PROXY),
    ("garbage: zone id", PROXY, None, "fe80::1%eth0", NETS, PROXY),
    ("garbage: port too large", PROXY, None, f"{CLIENT}:65536", NETS, PROXY),
    ("garbage: port too long", PROXY, None, f"{CLIENT}:000080", NETS, PROXY),
    ("garbage: empty port", PROXY, None, f"{CLIENT}:", NETS, PROXY),
    ("garbage: negative port", PROXY, None, f"{CLIENT}:-1", NETS, PROXY),
    ("garbage: v6 port too large", PROXY, None, "[2001:db8::1]:70000", NETS, PROXY),
    ("garbage: junk after bracket", PROXY, None, "[2001:db8::1]x", NETS, PROXY),
    ("garbage: missing bracket", PROXY, None, "[2001:db8::1", NETS, PROXY),
    ("garbage: leading zeros", PROXY, None, "010.0.0.1", NETS, PROXY),
    ("garbage: CIDR", PROXY, None, "203.0.113.0/24", NETS, PROXY),
    ("garbage: quoted XFF", PROXY, None, f'"{CLIENT}"', NETS, PROXY),
    ("garbage: Forwarded zone id", PROXY, 'for="[fe80::1%eth0]"', None, NETS, PROXY),
    ("garbage: Forwarded huge quoted", PROXY, 'for="' + "a," * 5000, None, NETS, PROXY),
    ("garbage: Forwarded backslashes", PROXY, "\\" * 10_000, None, NETS, PROXY),
    ("garbage: Forwarded quotes only", PROXY, '"' * 10_001, None, NETS, PROXY),
    (
        "garbage: huge header, client at the right",
        PROXY,
        None,
        "x," * 50_000 + CLIENT,
        NETS,
        CLIENT,
    ),
    (
        "garbage: huge Forwarded, client at the right",
        PROXY,
        '"' + "x," * 50_000 + f", for={CLIENT}",
        None,
        NETS,
        CLIENT,
    ),
]


@pytest.mark.parametrize(
    ("peer", "forwarded", "xff", "trusted", "expected"),
    [pytest.param(*case[1:], id=case[0]) for case in CASES],
)
def test_resolve_client(
    peer: str | None, forwarded: str | None, xff: str | None, trusted: Any, expected: str | None
) -> None:
    proxies = None if trusted is None else TrustedProxies(trusted)
    assert resolve_client(peer, forwarded, xff, proxies) == ip(expected)


# --- bounds ------------------------------------------------------------------------------


def test_walk_examines_at_most_max_elements_then_stops_at_last_trusted_hop() -> None:
    hops = [f"10.0.{i // 256}.{i % 256}" for i in range(1, 201)]
    header = ", ".join([SPOOF, *hops])
    got = resolve_client(PROXY, None, header, TrustedProxies(NETS))
    assert got == ip(hops[-MAX_ELEMENTS])


def test_partial_element_at_the_header_cut_is_dropped() -> None:
    # The first 8 KiB boundary falls inside "203.0.113.99": read as is, the fragment would be
    # "3.0.113.99", an address nobody sent.
    tail_element = " " * (MAX_HEADER_CHARS - len("3.0.113.99,") - len("10.0.0.1")) + "10.0.0.1"
    header = "203.0.113.99," + tail_element
    assert len(header) == MAX_HEADER_CHARS + 2
    assert header[-MAX_HEADER_CHARS:].startswith("3.0.113.99,")
    got = resolve_client(PROXY, None, header, TrustedProxies(NETS))
    assert got == ip("10.0.0.1")


def test_hop_count_at_the_element_bound() -> None:
    entries = [f"192.0.2.{i}" for i in range(MAX_ELEMENTS)]
    got = resolve_client(PROXY, None, ", ".join(entries), TrustedProxies(MAX_ELEMENTS))
    assert got == ip(entries[0])


# --- TrustedProxies configuration ----------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected_in_message"),
    [
        pytest.param("10.0.0.0/8", "trusted_proxies=['10.0.0.0/8']", id="bare string"),
        pytest.param(True, 'trusted_proxies=["10.0.0.0/8"', id="bool"),
        pytest.param(-1, "trusted_proxies=1", id="negative hops"),
        pytest.param(MAX_ELEMENTS + 1, "trusted_proxies=1", id="too many hops"),
        pytest.param(1.5, 'trusted_proxies=["10.0.0.0/8"', id="float"),
        pytest.param(["not-an-ip"], 'trusted_proxies=["10.0.0.0/8"', id="not an address"),
        pytest.param(["10.0.0.1/8"], "'10.0.0.0/8'", id="host bits set"),
        pytest.param(["10.0.0.0/33"], 'trusted_proxies=["10.0.0.0/8"', id="bad prefix"),
        pytest.param([b"10.0.0.0/8"], 'trusted_proxies=["10.0.0.0/8"', id="bytes entry"),
        pytest.param([None], 'trusted_proxies=["10.0.0.0/8"', id="None entry"),
        pytest.param(["0.0.0.0/0"], "trusted_proxies=1", id="trust every IPv4"),
        pytest.param(["::/0"], "trusted_proxies=1", id="trust every IPv6"),
        # Mapped networks are folded to IPv4 before the test: this one is 0.0.0.0/0.
        pytest.param(["::ffff:0:0/96"], "trusted_proxies=1", id="trust every mapped IPv4"),
        pytest.param(["0.0.0.0/1", "10.0.0.0/8", "128.0.0.0/1"], "cover every IPv4",
                     id="halves that cover every IPv4"),
        pytest.param(["::/1", "8000::/1"], "cover every IPv6", id="halves that cover every IPv6"),
        pytest.param(["fe80::1%eth0"], "'fe80::/10'", id="zone id"),
    ],
)
def test_bad_trusted_proxies_raise_with_an_example(spec: Any, expected_in_message: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        TrustedProxies(spec)
    assert expected_in_message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_trusted_networks_are_precomputed_and_mapped_networks_become_ipv4() -> None:
    proxies = TrustedProxies(["::ffff:10.0.0.0/104", " 127.0.0.1 ", "::1", "fd00::/8"])
    assert [str(n) for n in proxies.networks] == [
        "10.0.0.0/8",
        "127.0.0.1/32",
        "::1/128",
        "fd00::/8",
    ]
    assert proxies.hops is None
    assert ip("10.200.0.1") in proxies
    assert ip("fd12::1") in proxies
    assert ip("11.0.0.1") not in proxies
    assert ip("::2") not in proxies
    assert "10.0.0.1" not in proxies  # only parsed addresses are members
    assert repr(proxies) == "TrustedProxies(['10.0.0.0/8', '127.0.0.1/32', '::1/128', 'fd00::/8'])"


def test_hop_count_and_empty_list() -> None:
    assert TrustedProxies(2).hops == 2
    assert TrustedProxies(2).networks == ()
    assert repr(TrustedProxies(2)) == "TrustedProxies(2)"
    assert TrustedProxies(2) == TrustedProxies(2)
    assert TrustedProxies(("10.0.0.0/8",)) == TrustedProxies(["10.0.0.0/8"])
    # An empty list trusts nobody: the peer is always the client.
    assert resolve_client(PROXY, None, CLIENT, TrustedProxies([])) == ip(PROXY)


# --- ip_key -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("addr", "prefix", "expected"),
    [
        ("192.0.2.1", 64, "192.0.2.1"),
        ("192.0.2.1", 128, "192.0.2.1"),
        ("2001:db8:1:2:3:4:5:6", 64, "2001:db8:1:2::/64"),
        ("2001:db8:1:2:ffff::1", 64, "2001:db8:1:2::/64"),
        ("2001:db8:1:2:3:4:5:6", 48, "2001:db8:1::/48"),
        ("2001:db8:1:2:3:4:5:6", 56, "2001:db8:1::/56"),
        ("2001:db8:1:2ff:3:4:5:6", 56, "2001:db8:1:200::/56"),
        ("2001:0db8:0000::0001", 128, "2001:db8::1"),
        ("2001:db8::1", 0, "::/0"),
        ("::ffff:192.0.2.1", 64, "192.0.2.1"),
    ],
)
def test_ip_key(addr: str, prefix: int, expected: str) -> None:
    assert ip_key(ip(addr), prefix) == expected


def test_ip_key_rejects_a_bad_prefix() -> None:
    with pytest.raises(ValueError, match=re.escape("0..128")):
        ip_key(ip("2001:db8::1"), 129)


@pytest.mark.parametrize("value", [-1, 129, True, "64", None, 64.0])
def test_check_ipv6_prefix_rejects(value: Any) -> None:
    with pytest.raises(ConfigurationError, match="ipv6_prefix=64"):
        check_ipv6_prefix(value)


@pytest.mark.parametrize("value", [0, 48, 64, 128])
def test_check_ipv6_prefix_accepts(value: int) -> None:
    assert check_ipv6_prefix(value) == value


# --- properties ---------------------------------------------------------------------------

# Text that exercises the parsers' special characters more often than st.text() alone.
header_text = st.one_of(
    st.text(),
    st.text(alphabet=st.sampled_from(list('",;=\\[]:._% \tforFORunknown0123456789abcdef'))),
    st.lists(
        st.one_of(
            st.ip_addresses().map(str),
            st.ip_addresses().map(lambda a: f'for="[{a}]:80"'),
            st.sampled_from(["unknown", "_x", "", '"', "\\", "for=", ";", "10.0.0.3"]),
        )
    ).map(", ".join),
)
# The last: nearly every address trusted (all of them together is refused at configuration).
trust_configs = st.sampled_from([None, 0, 1, 2, 5, NETS,
                                 ["0.0.0.0/1", "128.0.0.0/2", "192.0.0.0/3", "::/1"]])
peers = st.one_of(st.none(), st.ip_addresses().map(str), st.text(), st.just(PROXY))


@given(
    peer=peers, forwarded=st.none() | header_text, xff=st.none() | header_text, spec=trust_configs
)
def test_resolve_client_never_raises(
    peer: str | None, forwarded: str | None, xff: str | None, spec: Any
) -> None:
    trusted = None if spec is None else TrustedProxies(spec)
    got = resolve_client(peer, forwarded, xff, trusted)
    assert got is None or isinstance(got, (ipaddress.IPv4Address, ipaddress.IPv6Address))
    if got is not None:
        ip_key(got)


@given(peer=st.ip_addresses(), forwarded=st.none() | header_text, xff=st.none() | header_text)
def test_without_trusted_proxies_the_client_is_the_peer(
    peer: ipaddress.IPv4Address | ipaddress.IPv6Address, forwarded: str | None, xff: str | None
) -> None:
    expected = peer.ipv4_mapped if isinstance(peer, ipaddress.IPv6Address) else None
    assert resolve_client(str(peer), forwarded, xff, None) == (expected or peer)


@given(client_text=header_text, hops=st.integers(0, 3))
def test_client_text_cannot_change_what_trusted_proxies_appended_xff(
    client_text: str, hops: int
) -> None:
    # Whatever the client sent, each trusted proxy appends one entry; the client's own text
    # stays on the left and cannot alter how the right part is read.
    appended = [CLIENT] + [f"10.0.0.{i + 2}" for i in range(hops)]
    header = ", ".join([client_text, *appended])
    by_nets = resolve_client(PROXY, None, header, TrustedProxies(NETS))
    by_count = resolve_client(PROXY, None, header, TrustedProxies(hops + 1))
    assert by_nets == by_count == ip(CLIENT)


@given(client_text=header_text, client=st.sampled_from([CLIENT, "2001:db8::9"]))
def test_client_text_cannot_change_what_trusted_proxies_appended_forwarded(
    client_text: str, client: str
) -> None:
    node = f'"[{client}]:4711"' if ":" in client else f'"{client}:4711"'
    header = f'{client_text}, for={node};proto=https;host="example.com", for=10.0.0.7'
    by_nets = resolve_client(PROXY, header, SPOOF, TrustedProxies(NETS))
    by_count = resolve_client(PROXY, header, SPOOF, TrustedProxies(2))
    assert by_nets == by_count == ip(client)
