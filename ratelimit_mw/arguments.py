"""A limiter's arguments, checked where they are given: a mistake is a ConfigurationError
saying what to write instead. Pure: no I/O, no state but the parsed policies' cache."""

from __future__ import annotations

import datetime as _dt
import functools
import re
from typing import Any

from ratelimit_mw.core import codec
from ratelimit_mw.core.codec import Check
from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.core.policy import Policy, as_policy
from ratelimit_mw.metrics import MetricsHook

_PREFIX_RE = re.compile(r"[A-Za-z0-9_.:\-]{1,32}")


def validate_prefix(prefix: object) -> str:
    """The keys' prefix, checked: ConfigurationError says what to write."""
    if not isinstance(prefix, str) or not _PREFIX_RE.fullmatch(prefix):
        raise ConfigurationError(
            f"prefix must be 1-32 characters of letters, digits, '_', '.', ':' or '-', "
            f"got {prefix!r}; e.g. prefix=\"rl\""
        )
    return prefix


def at_ms(at: _dt.datetime) -> int:
    """A reservation's time, an aware datetime, in ms since the epoch."""
    if not isinstance(at, _dt.datetime) or at.tzinfo is None or at.utcoffset() is None:
        raise ConfigurationError(
            f"reserve(at=...) needs an aware datetime, got {at!r}; e.g. "
            "datetime(2026, 5, 1, 9, 30, tzinfo=ZoneInfo('Europe/Paris'))"
        )
    return int(at.timestamp() * 1000)


def metrics_hook(metrics: Any) -> MetricsHook | None:
    """The metrics hook (anything with ``observe``), or None."""
    if metrics is not None and not callable(getattr(metrics, "observe", None)):
        raise ConfigurationError(
            f"metrics must have a method observe(event, policy, seconds), got {metrics!r}; "
            "e.g. metrics=ratelimit_mw.metrics adapters, or any object with such a method"
        )
    return metrics  # type: ignore[no-any-return]


def checked(policy: Policy | str, identity: str, cost: int) -> Check:
    """One check's arguments (a policy or its text, an identity, a cost), checked."""
    if not isinstance(identity, str):
        raise ConfigurationError(
            f"identity must be a string, got {type(identity).__name__}; e.g. \"user:42\""
        )
    codec.validate_cost(cost)
    # Text is parsed once per text; anything else, as_policy explains.
    parsed = (policy if isinstance(policy, Policy) else policy_from_text(policy)
              if isinstance(policy, str) else as_policy(policy))
    codec.validate_cost(cost, parsed)
    return Check(parsed, identity, cost)


@functools.lru_cache(maxsize=256)
def policy_from_text(text: str) -> Policy:
    # limiter.hit("10/minute", ...) with a string: one Policy per text, not one per call, so
    # parsing stays off the hot path and the deny cache recognises the policy.
    return as_policy(text)
