"""Rate strings: the notations users write, and a helpful error for every mistake."""

from __future__ import annotations

import pytest

import ratelimit_mw as rl
from ratelimit_mw.core.rates import parse_rates

MINUTE = 60_000
HOUR = 60 * MINUTE
DAY = 24 * HOUR


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10/minute", [(10, MINUTE)]),
        ("10 per minute", [(10, MINUTE)]),
        ("10/minutes", [(10, MINUTE)]),
        ("5/30 seconds", [(5, 30_000)]),
        ("5/30seconds", [(5, 30_000)]),
        ("100/day", [(100, DAY)]),
        ("3/hour", [(3, HOUR)]),
        ("7/2 hours", [(7, 2 * HOUR)]),
        ("1/week", [(1, 7 * DAY)]),
        ("2/500 ms", [(2, 500)]),
        ("1/s", [(1, 1_000)]),
        ("10/MINUTE", [(10, MINUTE)]),
        ("10 PER Minute", [(10, MINUTE)]),
        ("  10 / minute  ", [(10, MINUTE)]),
        ("1/minute;5/hour;10/day", [(1, MINUTE), (5, HOUR), (10, DAY)]),
        ("1/minute; 5/hour ;10/day;", [(1, MINUTE), (5, HOUR), (10, DAY)]),
        ("10/day;1/minute", [(10, DAY), (1, MINUTE)]),
    ],
)
def test_rate_strings_parse_to_limit_and_period(text: str, expected: list[tuple[int, int]]) -> None:
    assert [(r.limit, r.period_ms) for r in parse_rates(text)] == expected


def test_rate_parse_reads_one_rate_and_exposes_seconds() -> None:
    rate = rl.Rate.parse("5/30 seconds")
    assert rate == rl.Rate(5, 30_000)
    assert rate.period == 30.0
    assert rate.period_seconds_ceil == 30


@pytest.mark.parametrize(
    ("rate", "text", "name"),
    [
        (rl.Rate(10, MINUTE), "10/minute", "minute"),
        (rl.Rate(5, 30_000), "5/30 seconds", "30s"),
        (rl.Rate(100, DAY), "100/day", "day"),
        (rl.Rate(3, 2 * HOUR), "3/2 hours", "2h"),
        (rl.Rate(2, 1_500), "2/1500 milliseconds", "1500ms"),
    ],
)
def test_rate_renders_back_to_text_and_a_tier_name(rate: rl.Rate, text: str, name: str) -> None:
    assert str(rate) == text
    assert rate.name == name
    assert rl.Rate.parse(str(rate)) == rate


def test_sub_second_periods_round_up_for_the_policy_header() -> None:
    assert rl.Rate(1, 1_500).period_seconds_ceil == 2


EXAMPLE = '"10/minute"'


@pytest.mark.parametrize(
    "text",
    [
        "10/fortnight",  # unknown unit
        "10/minut",  # typo
        "0/minute",  # zero limit
        "-1/minute",  # negative limit
        "10/0 seconds",  # zero period
        "10/-5 seconds",  # negative period
        "ten/minute",
        "10 minute",
        "10/",
        "",
        " ; ",
        "1.5/minute",
        "10/minute;5",
    ],
)
def test_every_malformed_rate_raises_configuration_error_with_an_example(text: str) -> None:
    with pytest.raises(rl.ConfigurationError) as info:
        parse_rates(text)
    assert EXAMPLE in str(info.value)


def test_rate_parse_refuses_several_tiers_and_points_to_policy() -> None:
    with pytest.raises(rl.ConfigurationError, match=r'Policy\("1/minute;5/hour"\)'):
        rl.Rate.parse("1/minute;5/hour")


def test_a_non_string_rate_is_a_configuration_error() -> None:
    with pytest.raises(rl.ConfigurationError, match=EXAMPLE):
        parse_rates(10)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("limit", "period_ms"),
    [(0, 1000), (-3, 1000), (1, 0), (1, -1), (True, 1000), (1.5, 1000), (1, 2.5), (2**40, 2**20)],
)
def test_rate_constructor_rejects_what_cannot_be_counted_exactly(
    limit: object, period_ms: object
) -> None:
    with pytest.raises(rl.ConfigurationError):
        rl.Rate(limit, period_ms)  # type: ignore[arg-type]


def test_configuration_error_is_a_value_error() -> None:
    assert issubclass(rl.ConfigurationError, ValueError)
