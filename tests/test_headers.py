"""Rendering decisions into HTTP: Retry-After, RateLimit / RateLimit-Policy (draft-10), bodies."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ratelimit_mw as rl
from ratelimit_mw.http.headers import (
    PolicyHeader,
    rate_limit_headers,
    refusal_shape,
    retry_after_seconds,
    too_many_requests_body,
    unavailable_body,
)

MINUTE = rl.Rate(10, 60_000)


def decision(allowed: bool, retry: float = 0.0, reset: float = 0.0, remaining: int = 0,
             policy: rl.Policy | None = None, rate: rl.Rate | None = MINUTE,
             banned: bool = False) -> rl.Decision:
    return rl.Decision(allowed=allowed, limit=rate.limit if rate else 0, remaining=remaining,
                       retry_after=retry, reset_after=reset, policy=policy, rate=rate,
                       banned=banned)


@pytest.mark.parametrize(
    ("retry", "seconds"),
    [(0.0, 1), (0.001, 1), (0.999, 1), (1.0, 1), (1.001, 2), (59.5, 60), (3600.0, 3600)],
)
def test_retry_after_is_whole_seconds_rounded_up_and_never_zero(retry: float,
                                                                seconds: int) -> None:
    assert retry_after_seconds(decision(False, retry)) == seconds


def test_a_never_admissible_cost_reports_the_governing_period() -> None:
    assert retry_after_seconds(decision(False, math.inf)) == 60
    assert retry_after_seconds(decision(False, math.inf, rate=rl.Rate(1, 1_500))) == 2
    assert retry_after_seconds(decision(False, math.inf, rate=None)) == 60


def test_the_policy_header_lists_every_tier_with_quota_and_window() -> None:
    policy = rl.Policy("1/minute;5/hour;10/day")
    header = PolicyHeader([policy])
    assert header.value == '"minute";q=1;w=60, "hour";q=5;w=3600, "day";q=10;w=86400'


def test_sub_second_and_odd_windows_round_up_to_whole_seconds() -> None:
    header = PolicyHeader([rl.Policy("3/1500 ms;4/30 seconds")])
    assert header.value == '"1500ms";q=3;w=2, "30s";q=4;w=30'


def test_tiers_of_the_same_period_in_two_policies_are_named_by_policy() -> None:
    ip = rl.Policy("100/minute", name="ip")
    user = rl.Policy("10/minute;50/hour", name="user")
    header = PolicyHeader([ip, user])
    assert header.value == ('"ip minute";q=100;w=60, "user minute";q=10;w=60, '
                            '"user hour";q=50;w=3600')
    refused = decision(False, 12.2, 40.0, policy=user, rate=user.rates[0])
    assert header.ratelimit(refused) == '"user minute";r=0;t=13'


def test_policy_names_are_quoted_as_structured_field_strings() -> None:
    policy = rl.Policy("1/minute", name='a"b\\c\u00e9')
    other = rl.Policy("2/minute", name="x")
    value = PolicyHeader([policy, other]).value
    assert value.startswith('"a\\"b\\\\c? minute";q=1;w=60')
    assert all(" " <= ch <= "~" for ch in value)


def test_ratelimit_says_remaining_and_reset_when_admitted() -> None:
    policy = rl.Policy("10/minute")
    header = PolicyHeader([policy])
    admitted = decision(True, reset=41.2, remaining=3, policy=policy, rate=policy.rates[0])
    assert header.ratelimit(admitted) == '"minute";r=3;t=42'


def test_ratelimit_of_a_tier_it_does_not_know_still_renders() -> None:
    header = PolicyHeader([rl.Policy("10/minute")])
    assert header.ratelimit(decision(True, reset=1.0, remaining=9)) == '"limit";r=9;t=1'


def test_a_refusal_carries_retry_after_and_the_same_t() -> None:
    policy = rl.Policy("10/minute")
    header = PolicyHeader([policy])
    refused = decision(False, 7.01, 50.0, policy=policy, rate=policy.rates[0])
    assert rate_limit_headers(refused, header) == [
        ("RateLimit-Policy", '"minute";q=10;w=60'),
        ("RateLimit", '"minute";r=0;t=8'),
        ("Retry-After", "8"),
    ]


def test_admitted_responses_have_no_retry_after_and_legacy_headers_on_request() -> None:
    policy = rl.Policy("10/minute")
    header = PolicyHeader([policy])
    admitted = decision(True, reset=59.5, remaining=9, policy=policy, rate=policy.rates[0])
    names = [name for name, _ in rate_limit_headers(admitted, header)]
    assert names == ["RateLimit-Policy", "RateLimit"]
    legacy = dict(rate_limit_headers(admitted, header, legacy=True))
    assert (legacy["X-RateLimit-Limit"], legacy["X-RateLimit-Remaining"],
            legacy["X-RateLimit-Reset"]) == ("10", "9", "60")
    refused = dict(rate_limit_headers(decision(False, 0.2, 30.0, policy=policy,
                                               rate=policy.rates[0]), header, legacy=True))
    assert refused["X-RateLimit-Reset"] == refused["Retry-After"] == "1"


@pytest.mark.parametrize(
    ("refusal", "detail"),
    [
        (decision(False, 2.5), "Too Many Requests"),
        (decision(False, math.inf), "costs more than the limit"),
        (decision(False, 30.0, banned=True), "banned"),
    ],
)
def test_the_429_body_is_json_with_the_whole_second_wait(refusal: rl.Decision,
                                                         detail: str) -> None:
    body = json.loads(too_many_requests_body(refusal))
    assert set(body) == {"detail", "retry_after"}
    assert detail in body["detail"]
    assert body["retry_after"] == retry_after_seconds(refusal) >= 1


def test_the_503_body_names_the_limiter() -> None:
    assert json.loads(unavailable_body(3)) == {"detail": "Rate limiter unavailable",
                                               "retry_after": 3}


def test_headers_from_a_real_decision(step_clock: object) -> None:
    limiter = rl.Limiter(clock=step_clock)  # type: ignore[arg-type]
    policy = rl.Policy("2/minute;3/hour", algorithm="fixed-window", name="api")
    header = PolicyHeader([policy])
    limiter.hit(policy, "u")
    limiter.hit(policy, "u")
    refused = dict(rate_limit_headers(limiter.hit(policy, "u"), header))
    assert refused["RateLimit-Policy"] == '"minute";q=2;w=60, "hour";q=3;w=3600'
    assert refused["RateLimit"] == '"minute";r=0;t=60' and refused["Retry-After"] == "60"


_SHAPED = [rl.Policy("10/minute;100/hour", name="api"),
           rl.Policy("2/second", algorithm="gcra", penalty="1 minute"),
           rl.Policy.in_flight(3)]
_HEADERS = PolicyHeader(_SHAPED)
# Few values, so that two draws often agree on all but one field.
_WAITS = st.sampled_from([math.inf, 0.2, 0.9, 1.0, 4.2, 4.8, 59.5, 60.0])


_FIELDS = {
    "policy": st.sampled_from(_SHAPED),
    "rate": st.sampled_from([rate for policy in _SHAPED for rate in policy.rates]),
    "limit": st.sampled_from([2, 7, 10]),
    "remaining": st.integers(0, 1),
    "retry_after": _WAITS,
    "reset_after": _WAITS,
    "identity": st.sampled_from(["ip:1", "ip:2"]),
    "banned": st.booleans(),
    "at_us": st.integers(0, 10),
}


@st.composite
def _refusal_pairs(draw: st.DrawFn) -> tuple[rl.Decision, rl.Decision]:
    """A refusal, and another that differs from it in one or two fields."""
    policy = draw(_FIELDS["policy"])
    first = rl.Decision(allowed=False, limit=draw(_FIELDS["limit"]),
                        remaining=draw(_FIELDS["remaining"]),
                        retry_after=draw(_WAITS), reset_after=draw(_WAITS), policy=policy,
                        rate=draw(st.sampled_from(policy.rates)),
                        identity=draw(_FIELDS["identity"]), banned=draw(st.booleans()))
    changed = draw(st.lists(st.sampled_from(sorted(_FIELDS)), min_size=1, max_size=2))
    return first, first._replace(**{name: draw(_FIELDS[name]) for name in changed})


def _rendered(refusal: rl.Decision) -> tuple[object, ...]:
    return (rate_limit_headers(refusal, _HEADERS), rate_limit_headers(refusal, _HEADERS, True),
            too_many_requests_body(refusal))


@settings(max_examples=500)
@given(pair=_refusal_pairs())
def test_refusals_of_one_shape_render_the_same_429(
    pair: tuple[rl.Decision, rl.Decision]
) -> None:
    """The guard renders a flood's 429 once per shape (`refusal_shape`): whatever else two
    refusals differ in (their milliseconds, identity, reset) must not show in the bytes.
    (Each field of the shape left out fails this.)"""
    first, second = pair
    if refusal_shape(first) == refusal_shape(second):
        assert _rendered(first) == _rendered(second)


def test_a_refusal_a_millisecond_later_has_the_same_shape() -> None:
    policy = _SHAPED[0]
    early = decision(False, retry=4.2, reset=4.2, policy=policy, rate=policy.rates[0])
    later = early._replace(retry_after=4.199, reset_after=4.199)
    assert refusal_shape(early) == refusal_shape(later)
    assert refusal_shape(early) != refusal_shape(early._replace(retry_after=3.9))
    assert refusal_shape(early) != refusal_shape(early._replace(retry_after=math.inf))
