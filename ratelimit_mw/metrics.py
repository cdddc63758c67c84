"""Metrics: one small hook the limiter and the middleware call, and nothing when none is set.

A hook is any object with ``observe(event, policy, seconds)`` (docs/operations.md#metrics):
``event`` is one of `EVENTS`, ``policy`` the policy's name (from configuration, never from
requests), ``seconds`` the latency of the check behind the event (0.0 when no backend call
was made). Two ready hooks: `PrometheusMetrics` (the ``[prometheus]`` extra) and
`OpenTelemetryMetrics` (``[otel]``); their libraries are imported only when one is built.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Final, Literal, Protocol, get_args

from ratelimit_mw.core.errors import ConfigurationError

Event = Literal["admitted", "refused", "shadow_refused", "backend_error", "breaker_open",
                "fallback", "lease_lost"]
EVENTS: Final[tuple[Event, ...]] = get_args(Event)
ADMITTED, REFUSED, SHADOW_REFUSED, BACKEND_ERROR, BREAKER_OPEN, FALLBACK, LEASE_LOST = EVENTS


class MetricsHook(Protocol):
    """What the limiter and the middleware call; see the module docstring."""

    def observe(self, event: Event, policy: str, seconds: float) -> None: ...


# The ready adapters keep their label sets bounded: `event` is one of EVENTS, and `policy`
# takes at most `max_policies` distinct names (a dynamic limit can mint one per distinct rate
# text); the rest are counted under OTHER_POLICY.
OTHER_POLICY: Final = "other"
DEFAULT_MAX_POLICIES: Final = 1000
# Seconds: from a healthy local Redis's round trip up to the 100 ms socket timeout.
LATENCY_BUCKETS: Final = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                          0.1, 0.25, 1.0)

_log = logging.getLogger("ratelimit_mw")


class PolicyLabels:
    """Policy names as label values: the first `limit` distinct names, any later one as
    OTHER_POLICY (logged once), so a time series count can never run away."""

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
            if policy in self._known or len(self._known) < self.limit:
                return self._known.setdefault(policy, policy)
            if not self._warned:
                self._warned = True
                _log.warning(
                    "metrics: more than %d policy names; further ones (first: %r) are "
                    "counted as %r", self.limit, policy, OTHER_POLICY)
        return OTHER_POLICY


class _Hook:
    """The adapters' observe: the counter's increment and the histogram's record bound once
    per (event, policy label), since binding costs more than the increment."""

    def __init__(self, max_policies: int) -> None:
        self.labels = PolicyLabels(max_policies)
        self._bound: dict[tuple[str, str], tuple[Callable[[], Any], Callable[[float], Any]]] = {}

    def _bind(self, event: str, label: str) -> tuple[Callable[[], Any], Callable[[float], Any]]:
        raise NotImplementedError

    def observe(self, event: Event, policy: str, seconds: float) -> None:
        label = self.labels(policy)
        bound = self._bound.get((event, label))
        if bound is None:
            if event not in EVENTS:
                raise ConfigurationError(
                    f"unknown metrics event {event!r}; the events are " + ", ".join(EVENTS))
            bound = self._bound[(event, label)] = self._bind(event, label)
        bound[0]()
        if seconds > 0:
            bound[1](seconds)


class PrometheusMetrics(_Hook):
    """A MetricsHook for ``prometheus_client``: ``<namespace>_events_total{event, policy}``
    and ``<namespace>_check_duration_seconds{policy}`` (the checks that reached the store), on
    ``registry`` (default: prometheus_client's global REGISTRY)."""

    def __init__(self, registry: Any = None, *, namespace: str = "ratelimit",
                 max_policies: int = DEFAULT_MAX_POLICIES,
                 buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        try:
            import prometheus_client
        except ImportError as exc:
            raise ConfigurationError(
                "PrometheusMetrics needs prometheus_client: pip install 'ratelimit_mw[prometheus]'"
            ) from exc
        super().__init__(max_policies)
        registry = prometheus_client.REGISTRY if registry is None else registry
        self.events = prometheus_client.Counter(
            "events", "Rate-limit decisions and failures, by event and policy",
            ["event", "policy"], namespace=namespace, registry=registry)
        self.latency = prometheus_client.Histogram(
            "check_duration_seconds", "Time of the rate-limit checks that reached the store",
            ["policy"], namespace=namespace, registry=registry, buckets=tuple(buckets))

    def _bind(self, event: str, label: str) -> tuple[Callable[[], Any], Callable[[float], Any]]:
        return self.events.labels(event, label).inc, self.latency.labels(label).observe


class OpenTelemetryMetrics(_Hook):
    """A MetricsHook for OpenTelemetry: ``ratelimit.events`` (attributes ``event``, ``policy``)
    and ``ratelimit.check.duration`` (seconds, attribute ``policy``) on ``meter``, by default
    the meter ``ratelimit_mw`` of ``meter_provider`` (the global provider when None)."""

    def __init__(self, meter: Any = None, *, meter_provider: Any = None,
                 max_policies: int = DEFAULT_MAX_POLICIES) -> None:
        try:
            from opentelemetry import metrics as otel_metrics
        except ImportError as exc:
            raise ConfigurationError(
                "OpenTelemetryMetrics needs opentelemetry-api: pip install 'ratelimit_mw[otel]'"
            ) from exc
        super().__init__(max_policies)
        if meter is None:
            meter = otel_metrics.get_meter("ratelimit_mw", meter_provider=meter_provider)
        self.events = meter.create_counter(
            "ratelimit.events", unit="{event}",
            description="Rate-limit decisions and failures, by event and policy")
        self.latency = meter.create_histogram(
            "ratelimit.check.duration", unit="s",
            description="Time of the rate-limit checks that reached the store",
            explicit_bucket_boundaries_advisory=list(LATENCY_BUCKETS))

    def _bind(self, event: str, label: str) -> tuple[Callable[[], Any], Callable[[float], Any]]:
        events, latency = {"event": event, "policy": label}, {"policy": label}
        return (lambda: self.events.add(1, events)), (lambda s: self.latency.record(s, latency))
