"""The circuit breaker in front of the backend: one probe per cool-down while it is down.

Closed (the normal state), every request calls the backend. The first failure opens it for
``cooldown`` seconds, during which each request takes the failure policy at once. Then exactly
ONE request is let through as a probe and the cool-down starts again, so however many
requests are in flight, the backend sees one call per cool-down until a probe succeeds and
closes the breaker. A probe that never reports back (its request was cancelled) costs one
cool-down, never a stuck breaker. Its log lines: docs/operations.md#logging.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ratelimit_mw.log import ThrottledLog, logger


class Breaker:
    __slots__ = ("_clock", "_lock", "_opened_at", "_still", "cooldown", "open_until", "policy")

    def __init__(self, cooldown: float, policy: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cooldown = cooldown
        self.policy = policy  # what the log says is applied meanwhile
        self.open_until = 0.0  # 0.0: closed
        self._opened_at = 0.0
        self._clock = clock
        self._lock = threading.Lock()
        self._still = ThrottledLog()

    @property
    def is_open(self) -> bool:
        return self.open_until != 0.0

    def may_call(self) -> bool:
        """Whether this request may call the backend (closed, or the cool-down's one probe)."""
        if self.open_until == 0.0:
            return True
        with self._lock:
            if self.open_until == 0.0:
                return True
            now = self._clock()
            if now < self.open_until:
                return False
            self.open_until = now + self.cooldown  # this request is the probe
            return True

    def succeeded(self) -> bool:
        """The backend answered; True when that closed the breaker (it was down)."""
        if self.open_until == 0.0:
            return False
        with self._lock:
            closing = self.open_until != 0.0  # another thread may have closed it meanwhile
            self.open_until = 0.0
            down = self._clock() - self._opened_at
        if closing:
            logger.warning("ratelimit_mw: rate-limit backend answers again after %.1f s; "
                           "limiting resumed", down)
        return closing

    def failed(self, reason: str) -> None:
        with self._lock:
            now = self._clock()
            opening = self.open_until == 0.0
            self.open_until = now + self.cooldown
            if opening:
                self._opened_at = now
        if opening:
            self._still.hold()
            logger.warning("ratelimit_mw: rate-limit backend failed (%s); applying "
                           "on_backend_error=%s, probing it once every %g s", reason,
                           self.policy, self.cooldown)
        else:
            self._still(f"ratelimit_mw: rate-limit backend still failing ({reason})")

    def retry_after(self) -> int:
        """The Retry-After of a 503 while it is open: the cool-down in whole seconds."""
        return max(1, int(self.cooldown + 0.999))
