"""Metrics: one small hook the limiter and the middleware call, and nothing when none is set.

A hook is any object with ``observe(event, policy, seconds)``:

- ``event`` is one of `EVENTS`: ``"admitted"``, ``"refused"`` (by the store or the local deny
  cache), ``"shadow_refused"`` (shadow mode let a refused request through),
  ``"backend_error"`` (the store failed or missed the middleware's deadline; the failure
  policy decided), ``"breaker_open"`` (the backend was skipped during its cool-down) and
  ``"fallback"`` (the same, decided in memory: ``on_backend_error="memory"``).
- ``policy`` is the policy's name (a bounded set: names come from configuration, never from
  requests).
- ``seconds`` is the latency of the check that produced the event (0.0 when no backend call
  was made: deny-cache answers, an open breaker).

Where events come from: `Limiter`/`AsyncLimiter` (``metrics=``) report ``admitted``,
``refused`` and ``backend_error`` once per policy of each call; the middleware reports
``shadow_refused``, ``breaker_open``, ``fallback`` and the ``backend_error`` of a call its
deadline cut off through its limiter's hook: one event per policy of every request. Callers check
``if hook is not None`` before building anything, so a limiter without a hook pays one
attribute test per call.

Two ready hooks: `PrometheusMetrics` (``pip install 'ratelimit_mw[prometheus]'``) and
`OpenTelemetryMetrics` (``pip install 'ratelimit_mw[otel]'``); their libraries are imported
only when one is built.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any, Final, Literal, Protocol

from ratelimit_mw.core.errors import ConfigurationError

Event = Literal["admitted", "refused", "shadow_refused", "backend_error", "breaker_open",
                "fallback"]

ADMITTED: Final = "admitted"
REFUSED: Final = "refused"
SHADOW_REFUSED: Final = "shadow_refused"
BACKEND_ERROR: Final = "backend_error"
BREAKER_OPEN: Final = "breaker_open"
FALLBACK: Final = "fallback"

EVENTS: Final[tuple[Event, ...]] = (ADMITTED, REFUSED, SHADOW_REFUSED, BACKEND_ERROR, BREAKER_OPEN,
                                    FALLBACK)


class MetricsHook(Protocol):
    """What the limiter and the middleware call; see the module docstring."""

    def observe(self, event: Event, policy: str, seconds: float) -> None: ...


# -- ready adapters ----------------------------------------------------------------------------
# Both keep their label sets bounded: `event` is one of EVENTS, and `policy` takes at most
# `max_policies` distinct names (names come from configuration, but a dynamic limit can
# mint one per distinct rate text); the rest are counted under OTHER_POLICY.

OTHER_POLICY: Final = "other"
DEFAULT_MAX_POLICIES: Final = 1000
# Seconds: a check costs ~0.1-1 ms on a healthy local Redis, up to the 100 ms socket timeout.
LATENCY_BUCKETS: Final = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                          0.1, 0.25, 1.0)

_log = logging.getLogger("ratelimit_mw")


class PolicyLabels:
    """Policy names as label values: the first `limit` distinct names as they are, any later
    one as OTHER_POLICY (logged once), so a time series count can never run away."""

    def __init__(self, limit: int = DEFAULT_MAX_POLICIES) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ConfigurationError(
                f"max_policies must be a whole number >= 1, got {limit!r}; e.g. max_policies=1000"
            )
        self.limit = limit
        self._known: dict[str, str] = {}
        self._lock = threading.Lock()
        self._warned = False

    def __call__(self, policy: str) -> str:
        found = self._known.get(policy)
        if found is not None:
            return found
        with self._lock:
            if policy in self._known:
                return self._known[policy]
            if len(self._known) < self.limit:
                self._known[policy] = policy
                return policy
            if not self._warned:
                self._warned = True
                _log.warning(
                    "metrics: more than %d policy names; further ones (first: %r) are "
                    "counted as %r", self.limit, policy, OTHER_POLICY)
        return OTHER_POLICY


def _checked(event: str) -> Event:
    if event not in EVENTS:
        raise ConfigurationError(
            f"unknown metrics event {event!r}; the events are " + ", ".join(EVENTS)
        )
    return event


class PrometheusMetrics:
    """A MetricsHook for ``prometheus_client`` (the ``[prometheus]`` extra).

    Exposes ``<namespace>_events_total{event, policy}`` (a counter) and
    ``<namespace>_check_duration_seconds{policy}`` (a histogram of the checks that reached
    the store; answers made without a store call, reported as 0.0 s, are counted but not
    timed). ``registry`` defaults to prometheus_client's global REGISTRY.
    """

    def __init__(
        self,
        registry: Any = None,
        *,
        namespace: str = "ratelimit",
        max_policies: int = DEFAULT_MAX_POLICIES,
        buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> None:
        try:
            import prometheus_client
        except ImportError as exc:
            raise ConfigurationError(
                "PrometheusMetrics needs prometheus_client: pip install 'ratelimit_mw[prometheus]'"
            ) from exc
        if registry is None:
            registry = prometheus_client.REGISTRY
        self.labels = PolicyLabels(max_policies)
        self.events = prometheus_client.Counter(
            "events", "Rate-limit decisions and failures, by event and policy",
            ["event", "policy"], namespace=namespace, registry=registry)
        self.latency = prometheus_client.Histogram(
            "check_duration_seconds", "Time of the rate-limit checks that reached the store",
            ["policy"], namespace=namespace, registry=registry, buckets=tuple(buckets))
        # Bound label children, at most (max_policies + 1) x len(EVENTS): labels() costs
        # more than the increment itself.
        self._children: dict[tuple[str, str], tuple[Any, Any]] = {}

    def observe(self, event: Event, policy: str, seconds: float) -> None:
        label = self.labels(policy)
        children = self._children.get((event, label))
        if children is None:
            children = (self.events.labels(_checked(event), label), self.latency.labels(label))
            self._children[(event, label)] = children
        children[0].inc()
        if seconds > 0:
            children[1].observe(seconds)


class OpenTelemetryMetrics:
    """A MetricsHook for OpenTelemetry metrics (the ``[otel]`` extra).

    Records ``ratelimit.events`` (a counter with attributes ``event`` and ``policy``) and
    ``ratelimit.check.duration`` (a histogram in seconds, attribute ``policy``, with bucket
    boundaries advised for sub-millisecond checks) on ``meter``, by default the meter
    ``ratelimit_mw`` of ``meter_provider`` (the global provider when None).
    """

    def __init__(
        self,
        meter: Any = None,
        *,
        meter_provider: Any = None,
        max_policies: int = DEFAULT_MAX_POLICIES,
    ) -> None:
        try:
            from opentelemetry import metrics as otel_metrics
        except ImportError as exc:
            raise ConfigurationError(
                "OpenTelemetryMetrics needs opentelemetry-api: pip install 'ratelimit_mw[otel]'"
            ) from exc
        if meter is None:
            meter = otel_metrics.get_meter("ratelimit_mw", meter_provider=meter_provider)
        self.labels = PolicyLabels(max_policies)
        self.events = meter.create_counter(
            "ratelimit.events", unit="{event}",
            description="Rate-limit decisions and failures, by event and policy")
        self.latency = meter.create_histogram(
            "ratelimit.check.duration", unit="s",
            description="Time of the rate-limit checks that reached the store",
            explicit_bucket_boundaries_advisory=list(LATENCY_BUCKETS))
        # Attribute mappings built once per (event, policy label): bounded like the labels.
        self._attributes: dict[tuple[str, str], tuple[dict[str, str], dict[str, str]]] = {}

    def observe(self, event: Event, policy: str, seconds: float) -> None:
        label = self.labels(policy)
        attributes = self._attributes.get((event, label))
        if attributes is None:
            attributes = ({"event": _checked(event), "policy": label}, {"policy": label})
            self._attributes[(event, label)] = attributes
        self.events.add(1, attributes[0])
        if seconds > 0:
            self.latency.record(seconds, attributes[1])
