"""Rates: "10/minute", "10 per minute", "5/30 seconds", "1/minute;5/hour;10/day".

Parsing happens once, at configuration time; a `Rate` is a small immutable value whose
period is held in integer milliseconds because that is the unit every algorithm computes in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ratelimit_mw.core.errors import ConfigurationError

_MS_PER_UNIT = {
    "millisecond": 1,
    "ms": 1,
    "second": 1_000,
    "sec": 1_000,
    "s": 1_000,
    "minute": 60_000,
    "min": 60_000,
    "m": 60_000,
    "hour": 3_600_000,
    "hr": 3_600_000,
    "h": 3_600_000,
    "day": 86_400_000,
    "d": 86_400_000,
    "week": 7 * 86_400_000,
    "w": 7 * 86_400_000,
}

_UNIT_WORDS = {1: "millisecond", 1_000: "second", 60_000: "minute", 3_600_000: "hour",
               86_400_000: "day", 7 * 86_400_000: "week"}

_UNIT_ABBREVIATIONS = {1: "ms", 1_000: "s", 60_000: "min", 3_600_000: "h",
                       86_400_000: "d", 7 * 86_400_000: "w"}

# "<limit> (/|per) [<multiple>] <unit>[s]" — the notation of `limits` and slowapi.
_RATE_RE = re.compile(
    r"^\s*(?P<limit>[+-]?\d+)\s*(?:/|\s+per\s+)\s*(?P<multiple>[+-]?\d+)?\s*(?P<unit>[a-z]+)\s*$",
    re.IGNORECASE,
)


def unit_ms(word: str) -> int | None:
    """Milliseconds in a unit word, singular or plural ("ms" is a unit, not "m" + "s")."""
    word = word.lower()
    found = _MS_PER_UNIT.get(word)
    if found is None and word.endswith("s"):
        found = _MS_PER_UNIT.get(word[:-1])
    return found


_EXAMPLE = (
    'write it like "10/minute", "10 per minute", "5/30 seconds" or "1/minute;5/hour;10/day" '
    '(tiers joined by ";", "," or "|")'
)

# Lua numbers are doubles: integers above 2**53 stop being exact, and the scripts multiply
# limits by periods, so we refuse rates whose product could leave the exact range.
_MAX_EXACT = 2**53
# The RateLimit headers carry the limit as an RFC 9651 integer: at most 15 digits.
MAX_LIMIT = 999_999_999_999_999
# Tiers are joined by ";" (ours), "," or "|" (the spellings of `limits` and Flask-Limiter).
_TIER_SEPARATORS = re.compile(r"[;,|]")


@dataclass(frozen=True, slots=True)
class Rate:
    """`limit` hits per `period_ms` milliseconds."""

    limit: int
    period_ms: int

    def __post_init__(self) -> None:
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1:
            raise ConfigurationError(
                f"a rate's limit must be a whole number >= 1, got {self.limit!r}; {_EXAMPLE}"
            )
        if (
            isinstance(self.period_ms, bool)
            or not isinstance(self.period_ms, int)
            or self.period_ms < 1
        ):
            raise ConfigurationError(
                f"a rate's period must be a whole number of milliseconds >= 1, "
                f"got {self.period_ms!r}; {_EXAMPLE}"
            )
        if self.limit > MAX_LIMIT:
            raise ConfigurationError(
                f"a rate's limit must be at most {MAX_LIMIT:,} (15 digits: the RateLimit "
                f"headers cannot carry more), got {self.limit:,}; use a longer period, e.g. "
                f'"1000000000/second" rather than "1000000000000000/millisecond"'
            )
        if self.limit * self.period_ms >= _MAX_EXACT:
            raise ConfigurationError(
                f"{self.limit} per {self.period_ms} ms is too large to count exactly; "
                "use a smaller limit or a shorter period (limit x period in ms must stay "
                "below 2**53)"
            )

    @property
    def period(self) -> float:
        """The period in seconds."""
        return self.period_ms / 1000

    @property
    def period_seconds_ceil(self) -> int:
        """The period in whole seconds, rounded up (the `w` of the RateLimit-Policy header)."""
        return -(-self.period_ms // 1000)

    @classmethod
    def parse(cls, text: str) -> Rate:
        """Parse one rate such as "10/minute"; see `parse_rates` for several tiers."""
        rates = parse_rates(text)
        if len(rates) != 1:
            raise ConfigurationError(
                f"{text!r} holds {len(rates)} rates; Rate.parse takes one, e.g. \"10/minute\" "
                "(give several to Policy, e.g. Policy(\"1/minute;5/hour\"))"
            )
        return rates[0]

    def __str__(self) -> str:
        for unit_ms in sorted(_UNIT_WORDS, reverse=True):
            if self.period_ms % unit_ms == 0:
                multiple = self.period_ms // unit_ms
                word = _UNIT_WORDS[unit_ms]
                if multiple == 1:
                    return f"{self.limit}/{word}"
                return f"{self.limit}/{multiple} {word}s"
        return f"{self.limit}/{self.period_ms} milliseconds"  # pragma: no cover - ms divides all

    @property
    def name(self) -> str:
        """A short tier name for headers: "minute", "30s", "day"."""
        for unit_ms in sorted(_UNIT_WORDS, reverse=True):
            if self.period_ms % unit_ms == 0:
                multiple = self.period_ms // unit_ms
                if multiple == 1:
                    return _UNIT_WORDS[unit_ms]
                return f"{multiple}{_UNIT_ABBREVIATIONS[unit_ms]}"
        return f"{self.period_ms}ms"  # pragma: no cover


def _parse_one(part: str, whole: str) -> Rate:
    match = _RATE_RE.match(part)
    if match is None:
        raise ConfigurationError(f"cannot read the rate {part.strip()!r} in {whole!r}; {_EXAMPLE}")
    period_unit = unit_ms(match["unit"])
    if period_unit is None:
        raise ConfigurationError(
            f"unknown time unit {match['unit']!r} in {whole!r}; use second, minute, hour, day "
            f"or week; {_EXAMPLE}"
        )
    limit = int(match["limit"])
    multiple = int(match["multiple"]) if match["multiple"] is not None else 1
    if limit < 1:
        raise ConfigurationError(
            f"the limit in {part.strip()!r} must be at least 1 (to block everything, "
            f"refuse the route instead); {_EXAMPLE}"
        )
    if multiple < 1:
        raise ConfigurationError(
            f"the period in {part.strip()!r} must be at least 1 unit; {_EXAMPLE}"
        )
    return Rate(limit, multiple * period_unit)


def parse_rates(text: str) -> tuple[Rate, ...]:
    """Parse tiers joined by ";", "," or "|" ("1/minute;5/hour", "10/minute, 100/hour") into
    rates, in the order given."""
    if not isinstance(text, str):
        raise ConfigurationError(f"a rate must be a string, got {type(text).__name__}; {_EXAMPLE}")
    parts = [part for part in _TIER_SEPARATORS.split(text) if part.strip()]
    if not parts:
        raise ConfigurationError(f"empty rate {text!r}; {_EXAMPLE}")
    return tuple(_parse_one(part, text) for part in parts)
