"""The circuit breaker in front of the backend: one probe per cool-down while it is down.

Closed (the normal state), every request calls the backend. It opens on evidence that the
store is down: at once on any failure but a timeout (refused, reset, an error reply but a
cluster's CLUSTERDOWN, which never opens it), and on timeouts only when they come in a row
(`TIMEOUTS`, each at least one deadline after the last one counted, with no answer in time
between): a store that has answered nothing for that long is hung, while one late answer
(a stall, a starved CPU) costs only the calls caught in it. Open, each request takes the
failure policy at once for ``cooldown`` seconds; then exactly ONE request is let through as
a probe and the cool-down starts again, so however many requests are in flight, the
backend sees one call per cool-down until a probe succeeds and closes the breaker. A probe
that never reports back (its request was cancelled) costs one cool-down, never a stuck
breaker. On a cluster there is one breaker per node (`Breakers`): a sick node does not open
the breaker of the others. Its log lines: docs/operations.md#logging.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from ratelimit_mw.log import ThrottledLog, logger

# How many timeouts in a row open the breaker. The first counts at once; each next one only
# when it comes a deadline or more after the last one counted, so the calls that one stall
# catches together count once, and a store that answers late now and then never opens it.
TIMEOUTS = 3
# The deadline a breaker spaces its timeouts by when its guard has none (the WSGI side,
# whose calls the client's timeouts end: 100 ms from a URL).
DEFAULT_DEADLINE = 0.1
# The most breakers kept per guard on a cluster (one per node; addresses change over failovers).
MAX_NODES = 256


TIMEOUT, ANSWER, DOWN = "timeout", "answer", "down"


def kind_of(exc: BaseException | None) -> str:
    """What a failure says of the store: TIMEOUT, a call that got no answer in time (the
    deadline, a socket or connect timeout: redis-py's or valkey-py's TimeoutError, or a
    BackendError from one); ANSWER, a cluster node that answered CLUSTERDOWN (it refuses
    while the cluster reconfigures, e.g. between a primary's failure and its replica's
    promotion: asking it costs a round trip, not a deadline); DOWN, anything else (refused,
    reset, any other error reply)."""
    for _ in range(4):  # the error and what it was raised from
        if exc is None:
            break
        if isinstance(exc, TimeoutError) or any(
                cls.__name__ == "TimeoutError" for cls in type(exc).__mro__):
            return TIMEOUT
        if str(exc).startswith("CLUSTERDOWN"):
            return ANSWER
        exc = exc.__cause__
    return DOWN


class Breaker:
    __slots__ = ("_clock", "_counted_at", "_late", "_lock", "_opened_at", "_still",
                 "cooldown", "deadline", "open_until", "policy", "timeouts")

    def __init__(self, cooldown: float, policy: str,
                 clock: Callable[[], float] = time.monotonic, *,
                 deadline: float | None = None) -> None:
        self.cooldown = cooldown
        self.policy = policy  # what the log says is applied meanwhile
        self.deadline = DEFAULT_DEADLINE if deadline is None else deadline
        self.open_until = 0.0  # 0.0: closed
        self.timeouts = 0  # timeouts counted in a row while closed (see TIMEOUTS)
        self._counted_at = 0.0
        self._opened_at = 0.0
        self._clock = clock
        self._lock = threading.Lock()
        self._still = ThrottledLog()
        self._late = ThrottledLog()

    def like(self) -> Breaker:
        """A new closed breaker with this one's settings and clock (another node's)."""
        return Breaker(self.cooldown, self.policy, self._clock, deadline=self.deadline)

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
        self.timeouts = 0  # an answer in time ends a row of timeouts
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

    def failed(self, reason: str, exc: BaseException | None = None) -> None:
        """A call failed (`exc`, when known: a timeout opens it only in a row, see TIMEOUTS;
        a CLUSTERDOWN answer never does)."""
        kind = DOWN if exc is None else kind_of(exc)
        with self._lock:
            now = self._clock()
            opening = self.open_until == 0.0
            if opening and kind != DOWN:
                if kind == ANSWER:
                    opening = False
                elif self.timeouts and now - self._counted_at < self.deadline:
                    opening = False  # caught in the same stall as the last one counted
                else:
                    self.timeouts += 1
                    self._counted_at = now
                    opening = self.timeouts >= TIMEOUTS
                if not opening:
                    self._late(f"ratelimit_mw: a rate-limit backend call failed ({reason}); "
                               f"on_backend_error={self.policy} applied to that request "
                               f"(the breaker opens after {TIMEOUTS} timeouts in a row, "
                               "or on any failure but a timeout or CLUSTERDOWN)")
                    return
            self.open_until = now + self.cooldown
            if opening:
                self._opened_at = now
                self.timeouts = 0
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


class Breakers:
    """On a cluster, one breaker per node: `of(identities)` is the breaker of the node that
    serves the first identity's hash slot now (`route`: the backend's ``node_of``), or
    `default` while the slot map is not known. A failover moves a slot to a node with a
    breaker of its own, closed, so the slot is decided again as soon as the map says so."""

    __slots__ = ("_nodes", "default", "route")

    def __init__(self, default: Breaker, route: Callable[[str], object]) -> None:
        self.default = default
        self.route = route
        self._nodes: dict[object, Breaker] = {}

    @classmethod
    def per_node(cls, default: Breaker, limiter: object) -> Breakers | None:
        """A breaker per node for a limiter on a cluster backend (one that says which node
        serves an identity, ``node_of``), else None: `default` alone guards the store."""
        backend = getattr(limiter, "backend", None)
        route = getattr(backend, "node_of", None) if getattr(backend, "is_cluster", 0) else None
        return None if route is None else cls(default, route)

    def of(self, identities: Sequence[str]) -> Breaker:
        node = self.route(identities[0]) if identities else None
        if node is None:
            return self.default
        breaker = self._nodes.get(node)
        if breaker is None:
            if len(self._nodes) >= MAX_NODES:  # addresses of long-gone nodes: start afresh
                self._nodes.clear()
            breaker = self._nodes[node] = self.default.like()
        return breaker
