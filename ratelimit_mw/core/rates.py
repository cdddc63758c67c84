"""Rates: "10/minute", "10 per minute", "5/30 seconds", "1/minute;5/hour;10/day".

Parsing happens once, at configuration time; a `Rate` is a small immutable value whose
period is held in integer milliseconds because that is the unit every algorithm computes in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ratelimit_mw.core.errors import ConfigurationError

# (milliseconds, word, tier-name abbreviation, other spellings), longest first.
_UNITS = ((7 * 86_400_000, "week", "w", ()), (86_400_000, "day", "d", ()),
          (3_600_000, "hour", "h", ("hr",)), (60_000, "minute", "min", ("m",)),
          (1_000, "second", "s", ("sec",)), (1, "millisecond", "ms", ()))
_MS_PER_UNIT = {spelling: ms for ms, word, abbreviation, others in _UNITS
                for spelling in (word, abbreviation, *others)}

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
# The largest cost, estimate or settle of a hit: counts stay exact sums of two such values, and
# what a window holds saturates at COUNT_CAP (a window that deep in debt refuses until it
# ends). GCRA adds cost x emission interval (µs) to its TAT: at most GCRA_SPAN_US (71 years)
# apiece, and how far a TAT runs ahead saturates at 2 x GCRA_SPAN_US, so the TAT (now + that,
# in µs) stays below 2**53 until the year 2112. docs/guarantees.md lists them.
MAX_COST = 2**52
COUNT_CAP = 2**53 - 1
GCRA_SPAN_US = 2**51
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
        for value, what in ((self.limit, "limit must be a whole number >= 1"),
                            (self.period_ms, "period must be a whole number of milliseconds >= 1")):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"a rate's {what}, got {value!r}; {_EXAMPLE}")
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

    def _unit(self) -> tuple[int, str, str]:
        """(multiple, word, abbreviation) of the longest unit the period is a multiple of."""
        return next((self.period_ms // ms, word, abbreviation)
                    for ms, word, abbreviation, _ in _UNITS if self.period_ms % ms == 0)

    def __str__(self) -> str:
        multiple, word, _ = self._unit()
        return f"{self.limit}/{word}" if multiple == 1 else f"{self.limit}/{multiple} {word}s"

    @property
    def name(self) -> str:
        """A short tier name for headers: "minute", "30s", "day"."""
        multiple, word, abbreviation = self._unit()
        return word if multiple == 1 else f"{multiple}{abbreviation}"


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
    multiple = int(match["multiple"] or 1)
    if limit < 1:
        raise ConfigurationError(
            f"the limit in {part.strip()!r} must be at least 1 (to block everything, "
            f"refuse the route instead); {_EXAMPLE}"
        )
    if multiple < 1:
        raise ConfigurationError(f"the period in {part.strip()!r} must be at least 1 unit; "
                                 f"{_EXAMPLE}")
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


def emission_us(rate: Rate) -> int:
    """GCRA's emission interval of `rate` in µs, as lua/gcra.lua computes it (rounded up)."""
    return -(-rate.period_ms * 1000 // rate.limit)
