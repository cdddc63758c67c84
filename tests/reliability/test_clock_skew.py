"""Redis's clock decides: app servers whose clocks disagree by hours still share one limit.

Two spawned processes hammer one identity at the same moment, one with ``time.time`` three
hours fast, the other two hours slow, with limiters built as in production (no ``clock=``).
Together they admit exactly the limit under every algorithm (and under calendar days, whose
windows the script computes from Redis's clock and the zone's UTC-offset schedule), and both
read the same window end. Calendar days and weeks hold their limit even with the app clocks
two days either way, or a month ahead.
"""

from __future__ import annotations

import datetime as dt
import multiprocessing
import time
import uuid
from collections.abc import Iterator
from multiprocessing.pool import Pool
from zoneinfo import ZoneInfo

import pytest

from reliability._support import (
    SHARED_REDIS_URL,
    Figures,
    away_from_midnight,
    seconds_to_midnight,
)
from reliability._workers import SKEW_LIMIT, calendar_policies, skew_policies, skewed_hammer

pytestmark = pytest.mark.slow

SKEWS = (3 * 3600.0, -2 * 3600.0)
ATTEMPTS = 12


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    with multiprocessing.get_context("spawn").Pool(len(SKEWS)) as workers:
        workers.map(abs, range(len(SKEWS)))  # both started before the first race
        yield workers


@pytest.mark.parametrize("store", ["redis", "cluster"])
def test_processes_with_clocks_hours_apart_admit_exactly_the_limit_together(
    request: pytest.FixtureRequest, pool: Pool, store: str, figures: Figures
) -> None:
    url = request.getfixturevalue("redis_cluster_url") if store == "cluster" \
        else SHARED_REDIS_URL
    prefix = "trel" + uuid.uuid4().hex[:10]
    identity = "skew:" + uuid.uuid4().hex
    away_from_midnight("Asia/Shanghai")
    start_at = time.time() + 1.0
    results = pool.starmap(
        skewed_hammer,
        [(url, prefix, identity, skew, start_at, ATTEMPTS) for skew in SKEWS],
    )

    # Each process really ran on its own clock.
    for skew, result in zip(SKEWS, results, strict=True):
        assert abs(result["clock_offset"] - skew) < 1
    for name in skew_policies():
        together = sum(result["admitted"][name] for result in results)
        assert together == SKEW_LIMIT, (name, [r["admitted"][name] for r in results])
    # Both read the window end from Redis: equal, not five hours apart (and it is the
    # real time left until midnight, UTC for plain days, Shanghai for calendar days).
    for name, zone in (("fw", "UTC"), ("fw-tz", "Asia/Shanghai")):
        ends = [r["reset_after"][name] for r in results if name in r["reset_after"]]
        assert ends, name
        assert max(ends) - min(ends) < 5, (name, ends)
        assert abs(ends[0] - seconds_to_midnight(zone)) < 10, (name, ends)
    figures.record(f"clock_skew.{store}.admitted_per_process",
                   {name: [r["admitted"][name] for r in results] for name in skew_policies()})


CALENDAR_SKEWS = {
    "two days either way": (48 * 3600.0, -48 * 3600.0),
    "a month ahead": (30 * 86_400.0, 0.0),
}


def _seconds_to_monday(zone: str) -> float:
    now = time.time()
    today = dt.datetime.fromtimestamp(now, ZoneInfo(zone)).date()
    monday = today + dt.timedelta(days=7 - today.weekday())
    start = dt.datetime(monday.year, monday.month, monday.day, tzinfo=ZoneInfo(zone))
    return start.timestamp() - now


@pytest.mark.parametrize("skews", list(CALENDAR_SKEWS.values()), ids=list(CALENDAR_SKEWS))
def test_calendar_windows_hold_the_limit_when_app_clocks_are_days_apart(
    pool: Pool, skews: tuple[float, float], figures: Figures
) -> None:
    prefix = "trel" + uuid.uuid4().hex[:10]
    identity = "cal-skew:" + uuid.uuid4().hex
    away_from_midnight("Asia/Shanghai", "America/New_York", "Europe/Paris")
    start_at = time.time() + 1.0
    results = pool.starmap(
        skewed_hammer,
        [(SHARED_REDIS_URL, prefix, identity, skew, start_at, ATTEMPTS, True)
         for skew in skews],
    )
    for skew, result in zip(skews, results, strict=True):
        assert abs(result["clock_offset"] - skew) < 1
    admitted = {name: [r["admitted"][name] for r in results] for name in calendar_policies()}
    for name, counts in admitted.items():
        assert sum(counts) == SKEW_LIMIT, (name, counts)
    # The window ends come from Redis's clock: local midnight (Monday's for the week).
    expected = {"shanghai-day": seconds_to_midnight("Asia/Shanghai"),
                "new-york-day": seconds_to_midnight("America/New_York"),
                "paris-week": _seconds_to_monday("Europe/Paris")}
    for name, left in expected.items():
        ends = [r["reset_after"][name] for r in results if name in r["reset_after"]]
        assert ends and max(ends) - min(ends) < 5, (name, ends)
        assert abs(ends[0] - left) < 10, (name, ends, left)
    skew_id = "_".join(f"{s / 3600:+.0f}h" for s in skews)
    figures.record(f"clock_skew.calendar.{skew_id}.admitted_per_process", admitted)
