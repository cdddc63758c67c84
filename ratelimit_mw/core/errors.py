"""The three exceptions users catch."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ratelimit_mw.core.decision import Decision


class ConfigurationError(ValueError):
    """A configuration mistake, raised at start-up; the message says what to write instead."""


class BackendError(Exception):
    """The store could not answer (Redis unreachable, timed out, out of memory, ...).

    `Limiter` and `AsyncLimiter` raise it for every backend failure; the middleware turns it
    into its `on_backend_error` policy and never into a 500.
    """


class RateLimitExceeded(Exception):
    """Raised by `acquire` (and `charge`, the transports) when the quota will not be granted
    in time; carries the Decision, and its ``retry_after``: how many seconds from the refusal
    until a retry may be admitted (``inf``: never), to sleep before trying again."""

    def __init__(self, decision: Decision) -> None:
        super().__init__(
            f"rate limit exceeded for {decision.policy!r}: retry after {decision.retry_after:.3f}s"
        )
        self.decision = decision
        self.retry_after: float = decision.retry_after
