"""Key encoding: injective, slot-stable (client text never reaches the hash tag) and bounded."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st
from redis.crc import key_slot

import ratelimit_mw as rl
from ratelimit_mw.core import codec
from ratelimit_mw.core.identity import encode_identity, encode_segment, identity_head
from ratelimit_mw.core.rates import GCRA_SPAN_US

MAX_KEY_BYTES = 200

identities = st.one_of(
    st.text(max_size=300),
    st.text(alphabet="{}#:ab/@", max_size=20),
    st.from_regex(r"[A-Za-z0-9_.:/@=+\-]{1,64}", fullmatch=True),
    st.from_regex(r"[A-Za-z0-9_.:/@=+\-]{60,70}", fullmatch=True),
    st.sampled_from(["", "#", "{", "}", "{}", "a}b{c", "#abc", "1.2.3.4", "::1", "é", "\ud800"]),
)
names = st.one_of(st.text(min_size=1, max_size=80), st.from_regex(r"[a-z;/:]{1,50}",
                                                                    fullmatch=True))
prefixes = st.from_regex(r"[A-Za-z0-9_.:\-]{1,32}", fullmatch=True)
algorithms = st.sampled_from(sorted(rl.ALGORITHMS))


def hash_tag(key: str) -> str:
    start = key.index("{")
    return key[start + 1 : key.index("}", start)]


@settings(max_examples=150)
@given(a=identities, b=identities)
def test_different_identities_never_share_an_encoding(a: str, b: str) -> None:
    if a != b:
        assert encode_identity(a) != encode_identity(b)
    else:
        assert encode_identity(a) == encode_identity(b)


@settings(max_examples=150)
@given(identity=identities)
def test_an_encoded_identity_holds_no_braces_and_is_short(identity: str) -> None:
    encoded = encode_identity(identity)
    assert "{" not in encoded and "}" not in encoded
    assert 1 <= len(encoded.encode()) <= 64


@given(identity=st.from_regex(r"[A-Za-z0-9_.:/@=+\-]{1,64}", fullmatch=True))
def test_short_plain_identities_stay_readable(identity: str) -> None:
    assert encode_identity(identity) == identity


@given(identity=st.one_of(st.text(min_size=65), st.text().filter(lambda s: not re.fullmatch(
    r"[A-Za-z0-9_.:/@=+\-]{1,64}", s))))
def test_long_or_unusual_identities_are_hashed(identity: str) -> None:
    encoded = encode_identity(identity)
    assert encoded.startswith("#")
    assert re.fullmatch(r"#[A-Za-z0-9_\-]{22}", encoded)


@settings(max_examples=100)
@given(identity=identities, prefix=prefixes, name=names, algorithm=algorithms,
       other_name=names, other_prefix=prefixes)
def test_the_hash_tag_depends_only_on_the_identity(
    identity: str, prefix: str, name: str, algorithm: str, other_name: str, other_prefix: str
) -> None:
    first = codec.build(codec.HIT, [codec.Check(rl.Policy("1/minute;5/hour", algorithm=algorithm,
                                                       name=name, penalty=60), identity)],
                       prefix)
    second = codec.build(codec.PEEK, [codec.Check(rl.Policy("3/day", name=other_name), identity)],
                        other_prefix)
    tags = {hash_tag(key) for key in first.keys + second.keys}
    assert tags == {encode_identity(identity)}
    assert len({key_slot(key.encode()) for key in first.keys + second.keys}) == 1


@settings(max_examples=150)
@given(identity=identities, prefix=prefixes, name=names, algorithm=algorithms)
def test_every_key_fits_in_200_bytes(identity: str, prefix: str, name: str,
                                     algorithm: str) -> None:
    # The longest period each algorithm takes (GCRA's counts µs: core/rates.GCRA_SPAN_US).
    longest = GCRA_SPAN_US // 1000 if algorithm == "gcra" else 10**15 // 2
    policy = rl.Policy([rl.Rate(1, 1), rl.Rate(1, longest)], algorithm=algorithm, name=name,
                       penalty=1)
    call = codec.build(codec.HIT, [codec.Check(policy, identity)], prefix)
    for key in call.keys:
        assert len(key.encode("utf-8", "surrogatepass")) <= MAX_KEY_BYTES


@settings(max_examples=150)
@given(a=st.tuples(identities, names, algorithms), b=st.tuples(identities, names, algorithms))
def test_keys_of_different_identities_or_policies_never_collide(
    a: tuple[str, str, str], b: tuple[str, str, str]
) -> None:
    def keys(identity: str, name: str, algorithm: str) -> set[str]:
        policy = rl.Policy("1/minute;2/hour", algorithm=algorithm, name=name, penalty=5)
        return set(codec.build(codec.HIT, [codec.Check(policy, identity)], "rl").keys)

    if a == b:
        assert keys(*a) == keys(*b)
    else:
        # Sliding-log tiers share one log key; every other pair of cells is disjoint.
        assert not keys(*a) & keys(*b)


@given(name=names)
def test_policy_segments_are_injective_and_brace_free(name: str) -> None:
    segment = encode_segment(name)
    assert "{" not in segment and "}" not in segment
    assert len(segment) <= 48
    assert encode_segment(name + "x") != segment


def test_the_identity_head_is_prefix_then_hash_tag() -> None:
    assert identity_head("rl", "user:42") == "rl:{user:42}:"
    assert identity_head("rl", "a}b") == "rl:{" + encode_identity("a}b") + "}:"


def test_key_layout_per_algorithm() -> None:
    def keys(algorithm: str) -> list[str]:
        policy = rl.Policy("1/minute;5/hour", algorithm=algorithm, name="p", penalty=9)
        return codec.build(codec.HIT, [codec.Check(policy, "u")], "rl").keys

    assert keys("fixed-window") == ["rl:{u}:p.fw:60000", "rl:{u}:p.fw:3600000", "rl:{u}:p.fw:ban"]
    assert keys("sliding-log") == ["rl:{u}:p.sl:log", "rl:{u}:p.sl:log", "rl:{u}:p.sl:ban"]
