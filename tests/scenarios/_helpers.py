"""Time helpers shared by the scenario suites (the fake clock counts seconds as a float)."""

from __future__ import annotations

import datetime as dt
from typing import Any
from zoneinfo import ZoneInfo

UTC = dt.timezone.utc


def at(clock: Any, seconds: float = 0.0) -> dt.datetime:
    """The aware datetime `seconds` after the fake clock's now."""
    return dt.datetime.fromtimestamp(clock.now, UTC) + dt.timedelta(seconds=seconds)


def now_ms(clock: Any) -> int:
    return round(clock.now * 1000)


def set_ms(clock: Any, ms: int) -> None:
    """Put the fake clock on an exact millisecond (what the scripts will read as `now`)."""
    clock.now = ms / 1000
    if int(clock() * 1_000_000) // 1000 != ms:  # the limiter's own conversion
        raise AssertionError(f"the fake clock cannot stand exactly on {ms} ms")


def set_time(clock: Any, when: dt.datetime) -> None:
    """Put the fake clock on an aware datetime (whole milliseconds)."""
    if when.tzinfo is None:
        raise ValueError("give the fake clock an aware datetime")
    set_ms(clock, round(when.timestamp() * 1000))


def local(zone: str, *args: int) -> dt.datetime:
    """A wall-clock time in an IANA zone, e.g. local("Asia/Shanghai", 2026, 5, 1, 23)."""
    return dt.datetime(*args, tzinfo=ZoneInfo(zone))  # type: ignore[misc]


def ms(seconds: float) -> int:
    """Seconds as whole milliseconds (decisions carry milliseconds as float seconds)."""
    return round(seconds * 1000)


def keys_under(client: Any, prefix: str) -> list[bytes]:
    """Every Redis key a test wrote under its prefix (tests only: SCAN is never on a hot path)."""
    return sorted(client.scan_iter(match=f"{prefix}:*", count=1000))
