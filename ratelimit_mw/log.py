"""The logger ``ratelimit_mw`` and the one rule it follows: never a line per request.

Recurring failures (a key function raising, a refund that failed) are logged at most once per
interval with how many were suppressed. Backend outages are logged by the breaker
(`ratelimit_mw.http.breaker`): once when the backend fails, at most every ten seconds while
it keeps failing, and once when it answers again.
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger("ratelimit_mw")


def describe(exc: BaseException, timeout: float | None = None) -> str:
    """Why a backend call failed, in words: "timed out after 100 ms", "ConnectionError: ..."."""
    text = str(exc)
    if isinstance(exc, TimeoutError) and not text:
        return f"timed out after {timeout * 1000:.0f} ms" if timeout else "timed out"
    if type(exc).__name__ == "BackendError" and text:
        return text  # already says what failed ("Redis call failed: ConnectionError: ...")
    name = type(exc).__name__
    return f"{name}: {text}" if text else name


class ThrottledLog:
    """Log a recurring failure at most once per interval, with how many were suppressed."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self._next = 0.0
        self._suppressed = 0
        self._lock = threading.Lock()

    def hold(self) -> None:
        """Start an interval now: a related line was just logged."""
        with self._lock:
            self._next = time.monotonic() + self.interval
            self._suppressed = 0

    def __call__(self, message: str, exc: BaseException | None = None) -> None:
        now = time.monotonic()
        with self._lock:
            if now < self._next:
                self._suppressed += 1
                return
            suppressed, self._suppressed = self._suppressed, 0
            self._next = now + self.interval
        extra = f" ({suppressed} more since the last report)" if suppressed else ""
        if exc is None:
            logger.warning("%s%s", message, extra)
        else:
            logger.warning("%s%s: %s", message, extra, describe(exc))
