"""Policy: tiers, algorithms, penalties and time zones, checked at configuration time."""

from __future__ import annotations

import datetime as dt
from zoneinfo import ZoneInfo

import pytest

import ratelimit_mw as rl
from ratelimit_mw.policy import DEFAULT_ALGORITHM, as_policy


def test_the_default_algorithm_is_sliding_log() -> None:
    assert DEFAULT_ALGORITHM == "sliding-log"
    assert rl.Policy("10/minute").algorithm == "sliding-log"


@pytest.mark.parametrize(("algorithm", "code"), sorted(rl.ALGORITHMS.items()))
def test_each_algorithm_has_its_wire_code(algorithm: str, code: str) -> None:
    policy = rl.Policy("10/minute", algorithm=algorithm)
    assert policy.code == code
    assert policy.segment.endswith("." + code)


def test_policy_accepts_a_string_a_rate_or_a_list_of_rates() -> None:
    tiers = (rl.Rate(1, 60_000), rl.Rate(5, 3_600_000))
    assert rl.Policy("1/minute;5/hour").rates == tiers
    assert rl.Policy(list(tiers)).rates == tiers
    assert rl.Policy(tiers[0]).rates == tiers[:1]


def test_the_default_name_is_the_rate_text_and_an_explicit_name_wins() -> None:
    assert rl.Policy("1/minute;5/hour").name == "1/minute;5/hour"
    assert rl.Policy("1/minute", name="login").name == "login"


def test_a_policy_repr_shows_how_to_rebuild_it() -> None:
    policy = rl.Policy("100/day", algorithm="fixed-window", name="up", penalty=60,
                       tz="Asia/Shanghai")
    assert repr(policy) == (
        "Policy('100/day', algorithm='fixed-window', name='up', penalty=60, tz='Asia/Shanghai')"
    )


def test_as_policy_turns_rate_strings_into_default_policies() -> None:
    policy = rl.Policy("3/minute")
    assert as_policy(policy) is policy
    made = as_policy("3/minute", name="rule")
    assert made.name == "rule" and made.algorithm == DEFAULT_ALGORITHM
    with pytest.raises(rl.ConfigurationError, match='"10/minute"'):
        as_policy(3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "example"),
    [
        ({"rates": "10/fortnight"}, '"10/minute"'),
        ({"rates": "0/minute"}, '"10/minute"'),
        ({"rates": "-2/minute"}, '"10/minute"'),
        ({"rates": 10}, 'Policy("10/minute")'),
        ({"rates": []}, 'Policy("10/minute")'),
        ({"rates": "10/minute", "algorithm": "token-bucket"}, 'algorithm="gcra"'),
        ({"rates": "10/minute", "algorithm": "Sliding-Log"}, 'algorithm="gcra"'),
        ({"rates": "10/minute", "algorithm": None}, 'algorithm="gcra"'),
        ({"rates": "5/minute;10/minute"}, '"5/minute;100/hour"'),
        ({"rates": "5/60 seconds;10/minute"}, '"5/minute;100/hour"'),
        ({"rates": "10/minute", "name": ""}, 'name="login"'),
        ({"rates": "100/day", "algorithm": "sliding-log", "tz": "Asia/Shanghai"},
         'algorithm="fixed-window", tz='),
        ({"rates": "100/day", "algorithm": "gcra", "tz": "UTC"}, 'algorithm="fixed-window"'),
        ({"rates": "100/day", "algorithm": "fixed-window", "tz": "Mars/Olympus"},
         'tz="Asia/Shanghai"'),
        ({"rates": "100/day", "algorithm": "fixed-window", "tz": "../etc/passwd"},
         'tz="Asia/Shanghai"'),
        ({"rates": "1/minute", "penalty": 0}, "penalty=3600"),
        ({"rates": "1/minute", "penalty": -5}, "penalty=3600"),
        ({"rates": "1/minute", "penalty": "soon"}, 'penalty="1 hour"'),
        ({"rates": "1/minute", "penalty": "3 fortnights"}, 'penalty="1 hour"'),
        ({"rates": "1/minute", "penalty": True}, "penalty=3600"),
        ({"rates": "1/minute", "penalty": [60]}, "timedelta(hours=1)"),
        ({"rates": "1/minute", "penalty": dt.timedelta(0)}, "penalty=3600"),
    ],
)
def test_every_policy_mistake_raises_with_an_example_of_what_to_write(
    kwargs: dict[str, object], example: str
) -> None:
    with pytest.raises(rl.ConfigurationError) as info:
        rl.Policy(**kwargs)  # type: ignore[arg-type]
    assert example in str(info.value)


@pytest.mark.parametrize(
    ("penalty", "ms"),
    [
        (30, 30_000),
        (0.5, 500),
        ("1 hour", 3_600_000),
        ("2 hours", 7_200_000),
        ("90", 90_000),
        ("1.5 minutes", 90_000),
        ("500 ms", 500),
        ("500ms", 500),
        ("10s", 10_000),
        ("1 day", 86_400_000),
        (dt.timedelta(minutes=2), 120_000),
    ],
)
def test_penalty_durations_are_read_in_milliseconds(penalty: object, ms: int) -> None:
    policy = rl.Policy("1/minute", penalty=penalty)  # type: ignore[arg-type]
    assert policy.penalty_ms == ms
    assert policy.ban_end() == f"d{ms}"


def test_no_penalty_sends_no_ban() -> None:
    assert rl.Policy("1/minute").ban_end() == ""


def test_a_penalty_callable_gives_an_absolute_end_in_ms() -> None:
    end = dt.datetime(2027, 1, 1, tzinfo=ZoneInfo("Asia/Shanghai"))
    policy = rl.Policy("1/minute", penalty=lambda: end)
    assert policy.penalty_ms == 0
    assert policy.ban_end() == f"a{int(end.timestamp() * 1000)}"


@pytest.mark.parametrize("end", [dt.datetime(2027, 1, 1), "tomorrow", None])
def test_a_penalty_callable_must_return_an_aware_datetime(end: object) -> None:
    policy = rl.Policy("1/minute", penalty=lambda: end)  # type: ignore[arg-type,return-value]
    with pytest.raises(rl.ConfigurationError, match="aware datetime"):
        policy.ban_end()


def _ms(*args: int, zone: str) -> int:
    return int(dt.datetime(*args, tzinfo=ZoneInfo(zone)).timestamp() * 1000)  # type: ignore[misc]


def test_calendar_day_windows_run_from_local_midnight() -> None:
    policy = rl.Policy("100/day", algorithm="fixed-window", tz="Asia/Shanghai")
    now = _ms(2026, 5, 1, 15, 0, zone="Asia/Shanghai")
    bounds = [int(b) for b in policy.calendar(0, now).split(",")]
    assert bounds == [
        _ms(2026, 4, 30, zone="Asia/Shanghai"),
        _ms(2026, 5, 1, zone="Asia/Shanghai"),
        _ms(2026, 5, 2, zone="Asia/Shanghai"),
        _ms(2026, 5, 3, zone="Asia/Shanghai"),
    ]
    assert bounds[1] <= now < bounds[2]


def test_calendar_days_across_a_dst_change_are_23_or_25_hours() -> None:
    policy = rl.Policy("10/day", algorithm="fixed-window", tz="Europe/Paris")
    # 2026-03-29: clocks go forward in Paris; 2026-10-25: back.
    spring = [int(b) for b in policy.calendar(0, _ms(2026, 3, 29, 12, zone="Europe/Paris"))
              .split(",")]
    assert spring[2] - spring[1] == 23 * 3_600_000
    autumn = [int(b) for b in policy.calendar(0, _ms(2026, 10, 25, 12, zone="Europe/Paris"))
              .split(",")]
    assert autumn[2] - autumn[1] == 25 * 3_600_000


def test_calendar_leaves_non_day_tiers_and_zone_less_policies_epoch_aligned() -> None:
    policy = rl.Policy("5/hour;100/day", algorithm="fixed-window", tz="Asia/Shanghai")
    now = _ms(2026, 5, 1, 15, 0, zone="Asia/Shanghai")
    assert policy.calendar(0, now) == ""
    assert policy.calendar(1, now) != ""
    assert rl.Policy("100/day", algorithm="fixed-window").calendar(0, now) == ""


def test_week_calendar_windows_start_on_monday() -> None:
    policy = rl.Policy("100/week", algorithm="fixed-window", tz="UTC")
    now = _ms(2026, 5, 1, 9, zone="UTC")  # a Friday
    start = int(policy.calendar(0, now).split(",")[1])
    day = dt.datetime.fromtimestamp(start / 1000, dt.timezone.utc)
    assert day.weekday() == 0 and day.hour == 0
    assert start <= now < start + 7 * 86_400_000


def test_calendar_boundaries_follow_the_app_clock_into_the_next_day() -> None:
    policy = rl.Policy("100/day", algorithm="fixed-window", tz="UTC")
    today = policy.calendar(0, _ms(2026, 5, 1, 23, 59, zone="UTC"))
    tomorrow = policy.calendar(0, _ms(2026, 5, 2, 0, 1, zone="UTC"))
    assert today.split(",")[2] == tomorrow.split(",")[1]
