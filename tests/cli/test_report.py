"""The CLI's pure part: key names read back, listings grouped and bounded, reports shaped."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

import ratelimit_mw as rl
from ratelimit_mw.backends.urls import redact
from ratelimit_mw.cli import report
from ratelimit_mw.core import codec
from ratelimit_mw.core.decision import Decision, TierState
from ratelimit_mw.core.identity import encode_identity, encode_segment

NOW_MS = 1_800_000_000_000


@given(
    identity=st.text(min_size=1, max_size=80),
    name=st.text(min_size=1, max_size=60),
    algorithm=st.sampled_from(sorted(rl.ALGORITHMS)),
    prefix=st.from_regex(r"[A-Za-z0-9_.:\-]{1,32}", fullmatch=True),
)
def test_every_key_the_limiter_writes_reads_back_to_its_identity_and_policy(
    identity: str, name: str, algorithm: str, prefix: str,
) -> None:
    policy = rl.Policy("3/second;10/hour", algorithm=algorithm, name=name, penalty=60)
    call = codec.build(codec.HIT, (codec.Check(policy, identity),), prefix)
    for key in call.keys:
        parts = report.parse_key(prefix, key)
        assert parts is not None, key
        assert parts.identity == encode_identity(identity)
        assert parts.name == encode_segment(name)
        assert parts.algorithm == algorithm
        assert parts.tier in {"ban", "log", "1000", "3600000"}
    assert report.parse_key(prefix, call.keys[0].replace(prefix, prefix + "x", 1)) is None


def test_keys_of_other_prefixes_and_strangers_are_ignored() -> None:
    assert report.parse_key("rl", "rl:x:{u}:p.sl:log") is None  # prefix "rl:x"
    assert report.parse_key("rl", "rl:{u}:p.zz:1") is None  # no such algorithm
    assert report.parse_key("rl", "rl:{u}") is None
    assert report.parse_key("rl", "session:{u}:p.sl:log") is None
    assert report.parse_key("rl", "rl:{u}:a:b.c.fw:60000") == report.StoredKey(
        "u", "a:b.c", "fixed-window", "60000")


def test_the_listing_groups_keys_by_identity_and_stops_at_the_limit() -> None:
    keys = ["rl:{b}:p.sl:log", "rl:{a}:p.fw:60000", "rl:{a}:q.gc:1000", "rl:{a}:q.gc:ban",
            "rl:{#abc}:p.sl:log", "other", "rl:{c}:p.sl:log"]
    listing = report.list_report("rl", keys, 3, None)
    assert [e["identity"] for e in listing["identities"]] == ["#abc", "a", "b"]
    a = listing["identities"][1]
    assert a == {"identity": "a", "hashed": False, "policies": ["p (fixed-window)", "q (gcra)"],
                 "keys": 3, "banned": True}
    assert listing["truncated"] is True and listing["note"] == report.HASHED_NOTE
    text = report.render_list(listing)
    assert "stopped at --limit 3" in text and "banned" in text


def test_the_scan_pattern_narrows_to_one_policy() -> None:
    policy = rl.Policy("5/minute", algorithm="gcra", name="login")
    assert report.scan_pattern("rl", None) == "rl:{*"
    assert report.scan_pattern("rl", policy) == "rl:{*}:login.gc:*"


def test_a_wait_that_never_ends_is_null_in_json_and_never_in_text() -> None:
    policy = rl.Policy("2/minute")
    rate = policy.rates[0]
    tier = TierState(policy, rate, "u", False, 0, math.inf, 30.0)
    decision = Decision(False, 2, 0, math.inf, 30.0, policy, rate, "u", tiers=(tier,))
    data = report.inspect_report(policy, "u", decision, None, NOW_MS)
    assert data["tiers"][0]["retry_after"] is None and data["tiers"][0]["retry_at"] is None
    assert data["tiers"][0]["reset_at"] == "2027-01-15T08:00:30.000+00:00"
    assert "never" in report.render_inspect(data)


def test_a_ban_that_has_ended_is_no_ban() -> None:
    policy = rl.Policy("2/minute")
    decision = Decision(True, 2, 2, 0.0, 0.0, policy, policy.rates[0], "u",
                        tiers=(TierState(policy, policy.rates[0], "u", True, 2, 0.0, 0.0),))
    assert report.inspect_report(policy, "u", decision, NOW_MS - 1, NOW_MS)["ban"] is None
    live = report.inspect_report(policy, "u", decision, NOW_MS + 90_000, NOW_MS)
    assert live["ban"] == {"ends_at": "2027-01-15T08:01:30.000+00:00", "left": 90.0}
    assert live["allowed"] is False


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
    ("rediss://app:pw@h/0", "rediss://app:***@h/0"),
    ("redis+sentinel://u:pw@s1:26379,s2:26379/main/0",
     "redis+sentinel://u:***@s1:26379,s2:26379/main/0"),
    ("redis://h:6379/0", "redis://h:6379/0"),
    ("redis://user@h:6379/0", "redis://user@h:6379/0"),
    # A password holding '/' or '@' (the parser refuses the first; the message must not
    # show it either), and passwords given as query options.
    ("redis://:S3C/RET@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
    ("redis://user:S3C@RET@h:6379/x", "redis://user:***@h:6379/x"),
    ("redis+sentinel://s:26379/m/0?sentinel_password=S3CRET&socket_timeout=1",
     "redis+sentinel://s:26379/m/0?sentinel_password=***&socket_timeout=1"),
    ("redis://h:6379/0?password=S3CRET", "redis://h:6379/0?password=***"),
])
def test_passwords_never_reach_a_message(url: str, shown: str) -> None:
    assert redact(url) == shown
