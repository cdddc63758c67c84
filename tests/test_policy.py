"""Policy: tiers, algorithms, penalties and time zones, checked at configuration time."""

from __future__ import annotations

import datetime as dt
import itertools
import subprocess
import sys
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

import ratelimit_mw as rl
from ratelimit_mw.core import wire
from ratelimit_mw.core.policy import DEFAULT_ALGORITHM, Algorithm, as_policy, check_shared_logs


def test_the_default_algorithm_is_sliding_log() -> None:
    assert DEFAULT_ALGORITHM == "sliding-log"
    assert rl.Policy("10/minute").algorithm == "sliding-log"


@pytest.mark.parametrize(("algorithm", "code"), sorted(wire.CODES.items()))
def test_each_algorithm_has_its_wire_code(algorithm: Algorithm, code: str) -> None:
    assert {*rl.ALGORITHMS, "concurrency"} == set(wire.CODES)
    policy = rl.Policy("10/minute", algorithm=algorithm)
    assert wire.code(policy) == code
    assert wire.wire(policy).segment.endswith("." + code)


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
    assert wire.ban_end(policy) == f"d{ms}"


def test_no_penalty_sends_no_ban() -> None:
    assert wire.ban_end(rl.Policy("1/minute")) == ""


def test_a_penalty_callable_gives_an_absolute_end_in_ms() -> None:
    end = dt.datetime(2027, 1, 1, tzinfo=ZoneInfo("Asia/Shanghai"))
    policy = rl.Policy("1/minute", penalty=lambda: end)
    assert policy.penalty_ms == 0
    assert wire.ban_end(policy) == f"a{int(end.timestamp() * 1000)}"


@pytest.mark.parametrize("end", [dt.datetime(2027, 1, 1), "tomorrow", 0])
def test_a_penalty_callable_must_return_an_aware_datetime(end: object) -> None:
    policy = rl.Policy("1/minute", penalty=lambda: end)  # type: ignore[arg-type,return-value]
    with pytest.raises(rl.ConfigurationError, match="aware datetime or None"):
        wire.ban_end(policy)


def test_a_penalty_callable_returning_none_starts_no_ban() -> None:
    # It still reads its ban (a pause's), so it is not the static, ban-free form.
    policy = rl.Policy("1/minute", penalty=lambda: None)
    assert wire.ban_end(policy) == ""
    assert not wire.wire(policy).static


def _ms(*args: int, zone: str) -> int:
    return int(dt.datetime(*args, tzinfo=ZoneInfo(zone)).timestamp() * 1000)  # type: ignore[misc]


def _window(policy: rl.Policy, tier: int, now: int, app_ms: int | None = None) -> list[int]:
    """The calendar window holding Redis's `now`, from the schedule an app at `app_ms` sends."""
    assert policy.tz is not None
    cal = wire.schedule(policy.tz, now if app_ms is None else app_ms)
    return list(wire.calendar_window(cal, policy.rates[tier].period_ms, now))


def test_calendar_day_windows_run_from_local_midnight() -> None:
    policy = rl.Policy("100/day", algorithm="fixed-window", tz="Asia/Shanghai")
    now = _ms(2026, 5, 1, 15, 0, zone="Asia/Shanghai")
    assert _window(policy, 0, now) == [
        _ms(2026, 5, 1, zone="Asia/Shanghai"),
        _ms(2026, 5, 2, zone="Asia/Shanghai"),
    ]


def test_calendar_days_across_a_dst_change_are_23_or_25_hours() -> None:
    policy = rl.Policy("10/day", algorithm="fixed-window", tz="Europe/Paris")
    # 2026-03-29: clocks go forward in Paris; 2026-10-25: back.
    start, stop = _window(policy, 0, _ms(2026, 3, 29, 12, zone="Europe/Paris"))
    assert stop - start == 23 * 3_600_000
    start, stop = _window(policy, 0, _ms(2026, 10, 25, 12, zone="Europe/Paris"))
    assert stop - start == 25 * 3_600_000


@pytest.mark.parametrize("skew_days", [-400, -48 / 24, 2, 30, 365])
def test_the_window_depends_on_redis_s_clock_not_on_the_app_s(skew_days: float) -> None:
    policy = rl.Policy("10/day;3/week", algorithm="fixed-window", tz="America/New_York")
    now = _ms(2026, 11, 1, 12, zone="America/New_York")  # the day clocks go back
    app_ms = now + int(skew_days * 86_400_000)
    assert _window(policy, 0, now, app_ms) == [_ms(2026, 11, 1, zone="America/New_York"),
                                               _ms(2026, 11, 2, zone="America/New_York")]
    assert _window(policy, 1, now, app_ms) == [_ms(2026, 10, 26, zone="America/New_York"),
                                               _ms(2026, 11, 2, zone="America/New_York")]


def test_a_schedule_lists_the_zone_s_offset_changes() -> None:
    hour = 3_600_000
    assert wire.schedule(ZoneInfo("Asia/Shanghai"), _ms(2026, 5, 1, zone="UTC")) == str(8 * hour)
    paris = [int(v) for v in wire.schedule(ZoneInfo("Europe/Paris"),
                                           _ms(2026, 5, 1, zone="UTC")).split(",")]
    # Offsets and instants alternate: o0, t1, o1, t2, o2, ...; both DST changes of 2026 listed.
    offsets = paris[::2]
    assert set(offsets) == {hour, 2 * hour}
    assert all(a != b for a, b in itertools.pairwise(offsets))  # each entry is a change
    assert len(offsets) >= 5  # at least two years of changes: 400 days either side
    assert _ms(2026, 3, 29, 1, zone="UTC") in paris[1::2]
    assert _ms(2026, 10, 25, 1, zone="UTC") in paris[1::2]


def test_a_day_that_skips_midnight_starts_when_the_clock_jumps() -> None:
    # Santiago moves its clocks forward AT midnight on 2026-09-06: the day starts at 01:00.
    policy = rl.Policy("1/day", algorithm="fixed-window", tz="America/Santiago")
    start, stop = _window(policy, 0, _ms(2026, 9, 6, 12, zone="UTC"))
    assert start == _ms(2026, 9, 6, 4, zone="UTC")
    assert stop - start == 23 * 3_600_000


def test_week_calendar_windows_start_on_monday() -> None:
    policy = rl.Policy("100/week", algorithm="fixed-window", tz="UTC")
    now = _ms(2026, 5, 1, 9, zone="UTC")  # a Friday
    start, stop = _window(policy, 0, now)
    day = dt.datetime.fromtimestamp(start / 1000, dt.timezone.utc)
    assert day.weekday() == 0 and day.hour == 0
    assert start <= now < stop == start + 7 * 86_400_000


def test_mypy_catches_a_mistyped_algorithm(tmp_path: Path) -> None:
    """algorithm= is a Literal of the four names: a typo fails type-checking, not only at run
    time (where ConfigurationError still names the choices)."""
    snippet = tmp_path / "snippet.py"
    snippet.write_text('import ratelimit_mw as rl\n'
                       'rl.Policy("1/second", algorithm="gcra")\n'
                       'rl.Policy("1/second", algorithm="sliding_log")\n')
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental",
         "--cache-dir", str(tmp_path / "cache"), str(snippet)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert result.returncode == 1, result.stdout
    assert 'snippet.py:3: error: Argument "algorithm"' in result.stdout
    assert "snippet.py:2" not in result.stdout
    with pytest.raises(rl.ConfigurationError, match="'sliding-log'"):
        rl.Policy("1/second", algorithm="sliding_log")  # type: ignore[arg-type]


# -- sliding-log namesakes: one log, so one longest window -------------------------------

@pytest.mark.parametrize(
    ("policies", "clash"),
    [
        # Different names, or another algorithm: nothing shared.
        ([rl.Policy("5/minute"), rl.Policy("50/hour")], False),
        ([rl.Policy("5/minute", name="x", algorithm="gcra"), rl.Policy("50/hour", name="x")],
         False),
        ([rl.Policy("5/minute", name="x", algorithm="fixed-window"),
          rl.Policy("50/hour", name="x", algorithm="fixed-window")], False),
        # One log, one longest window: what the docs recommend.
        ([rl.Policy("5/minute;50/hour", name="x"), rl.Policy("50/hour", name="x")], False),
        ([rl.Policy("5/minute", name="x"), rl.Policy("9/minute", name="x")], False),
        # One log kept for two windows: the shorter would trim what the longer counts.
        ([rl.Policy("5/minute", name="x"), rl.Policy("50/hour", name="x")], True),
        ([rl.Policy("1/second;5/minute", name="x"), rl.Policy("2/3 hours", name="x")], True),
        ([rl.Policy("50/hour"), rl.Policy("5/minute", name="50/hour")], True),
    ],
)
def test_sliding_log_namesakes_must_keep_their_log_for_one_window(
    policies: list[rl.Policy], clash: bool
) -> None:
    if not clash:
        check_shared_logs(policies)
        return
    with pytest.raises(rl.ConfigurationError, match="share the name") as raised:
        check_shared_logs(policies)
    message = str(raised.value)
    assert "Give them different names, or one longest window" in message
    assert repr(policies[0]) in message and repr(policies[1]) in message


def test_the_namesake_error_shows_the_windows_and_a_policy_that_fits_both() -> None:
    with pytest.raises(rl.ConfigurationError) as raised:
        check_shared_logs([rl.Policy("1/second;5/minute", name="x"),
                           rl.Policy("3/minute;2/3 hours", name="x")])
    message = str(raised.value)
    assert "(1 minute and 3 hours)" in message
    assert "Policy(\"1/second;3/minute;2/3 hours\", name='x')" in message
