"""The metrics adapters, through the real libraries: prometheus_client's registry text and
the OpenTelemetry SDK's in-memory reader."""

from __future__ import annotations

import logging
import sys
import threading
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import ratelimit_mw as rl
from ratelimit_mw.metrics import (
    EVENTS,
    LATENCY_BUCKETS,
    OTHER_POLICY,
    MetricsHook,
    OpenTelemetryMetrics,
    PrometheusMetrics,
)


# -- reading the libraries' output -----------------------------------------------------------
def prometheus_samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[Any, ...]], float]:
    """Every sample of the registry's text exposition, by (name, sorted labels)."""
    text = generate_latest(registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def prom_events(registry: CollectorRegistry) -> Counter[tuple[str, str]]:
    return Counter({
        (dict(labels)["event"], dict(labels)["policy"]): int(value)
        for (name, labels), value in prometheus_samples(registry).items()
        if name == "ratelimit_events_total"
    })


def prom_latency(registry: CollectorRegistry) -> dict[str, tuple[int, float]]:
    samples = prometheus_samples(registry)
    counts = {dict(labels)["policy"]: int(v) for (n, labels), v in samples.items()
              if n == "ratelimit_check_duration_seconds_count"}
    sums = {dict(labels)["policy"]: v for (n, labels), v in samples.items()
            if n == "ratelimit_check_duration_seconds_sum"}
    return {policy: (count, sums[policy]) for policy, count in counts.items() if count}


class Otel:
    def __init__(self, **options: Any) -> None:
        self.reader = InMemoryMetricReader()
        self.provider = MeterProvider(metric_readers=[self.reader])
        self.hook = OpenTelemetryMetrics(meter_provider=self.provider, **options)

    def metrics(self) -> dict[str, Any]:
        data = self.reader.get_metrics_data()
        if data is None:  # nothing recorded yet
            return {}
        return {metric.name: metric for resource in data.resource_metrics
                for scope in resource.scope_metrics for metric in scope.metrics}

    def events(self) -> Counter[tuple[str, str]]:
        metric = self.metrics().get("ratelimit.events")
        if metric is None:
            return Counter()
        return Counter({(p.attributes["event"], p.attributes["policy"]): int(p.value)
                        for p in metric.data.data_points})

    def latency(self) -> dict[str, tuple[int, float]]:
        metric = self.metrics().get("ratelimit.check.duration")
        if metric is None:
            return {}
        return {p.attributes["policy"]: (p.count, p.sum) for p in metric.data.data_points}


# -- Prometheus --------------------------------------------------------------------------------
def test_prometheus_counts_events_by_event_and_policy_and_times_store_checks() -> None:
    registry = CollectorRegistry()
    hook: MetricsHook = PrometheusMetrics(registry)
    hook.observe("admitted", "login", 0.0004)
    hook.observe("admitted", "login", 0.0006)
    hook.observe("refused", "login", 0.0)  # answered by the deny cache: counted, not timed
    hook.observe("backend_error", "api", 0.1)
    assert prom_events(registry) == {("admitted", "login"): 2, ("refused", "login"): 1,
                                     ("backend_error", "api"): 1}
    latency = prom_latency(registry)
    assert latency["login"][0] == 2 and latency["login"][1] == pytest.approx(0.001)
    assert latency["api"] == (1, pytest.approx(0.1))
    text = generate_latest(registry).decode()
    assert 'ratelimit_check_duration_seconds_bucket{le="0.0005",policy="login"} 1.0' in text
    assert "# TYPE ratelimit_events_total counter" in text


def test_prometheus_caps_policy_labels_and_folds_the_rest_into_other(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = CollectorRegistry()
    hook = PrometheusMetrics(registry, max_policies=3)
    with caplog.at_level(logging.WARNING, logger="ratelimit_mw"):
        for name in ["a", "b", "c", "d", "e", "a", "e"]:
            hook.observe("admitted", name, 0.001)
    assert prom_events(registry) == {("admitted", "a"): 2, ("admitted", "b"): 1,
                                     ("admitted", "c"): 1, ("admitted", OTHER_POLICY): 3}
    assert set(prom_latency(registry)) == {"a", "b", "c", OTHER_POLICY}
    warnings = [r for r in caplog.records if r.name == "ratelimit_mw"]
    assert len(warnings) == 1 and "more than 3 policy names" in warnings[0].getMessage()


def test_prometheus_uses_the_namespace_so_two_hooks_share_a_registry() -> None:
    registry = CollectorRegistry()
    PrometheusMetrics(registry).observe("admitted", "p", 0.001)
    PrometheusMetrics(registry, namespace="edge").observe("refused", "p", 0.001)
    text = generate_latest(registry).decode()
    assert 'ratelimit_events_total{event="admitted",policy="p"} 1.0' in text
    assert 'edge_events_total{event="refused",policy="p"} 1.0' in text


def test_prometheus_counts_every_event_from_many_threads() -> None:
    registry = CollectorRegistry()
    hook = PrometheusMetrics(registry, max_policies=5)

    def work(worker: int) -> None:
        for i in range(500):
            hook.observe(EVENTS[i % len(EVENTS)], f"p{(worker * 7 + i) % 9}", 0.001)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    events = prom_events(registry)
    assert sum(events.values()) == 8 * 500
    assert len({policy for _, policy in events}) == 6  # five names and "other"


# -- OpenTelemetry -----------------------------------------------------------------------------
def test_opentelemetry_records_events_and_latency_in_the_sdk() -> None:
    otel = Otel()
    hook: MetricsHook = otel.hook
    hook.observe("admitted", "login", 0.0004)
    hook.observe("shadow_refused", "login", 0.0006)
    hook.observe("breaker_open", "login", 0.0)
    assert otel.events() == {("admitted", "login"): 1, ("shadow_refused", "login"): 1,
                             ("breaker_open", "login"): 1}
    assert otel.latency() == {"login": (2, pytest.approx(0.001))}
    metrics = otel.metrics()
    assert metrics["ratelimit.check.duration"].unit == "s"
    (point,) = metrics["ratelimit.check.duration"].data.data_points
    assert tuple(point.explicit_bounds) == LATENCY_BUCKETS  # the advised buckets, in seconds
    assert metrics["ratelimit.events"].data.is_monotonic


def test_opentelemetry_caps_policy_attributes() -> None:
    otel = Otel(max_policies=2)
    for name in ["a", "b", "c", "d"]:
        otel.hook.observe("refused", name, 0.002)
    assert otel.events() == {("refused", "a"): 1, ("refused", "b"): 1,
                             ("refused", OTHER_POLICY): 2}


# -- the cached label paths against a plain oracle -------------------------------------------
observations = st.lists(
    st.tuples(st.sampled_from(EVENTS), st.sampled_from([f"p{i}" for i in range(6)]),
              st.sampled_from([0.0, 0.0003, 0.002, 0.04])),
    max_size=60,
)


def oracle(sequence: list[tuple[str, str, float]], cap: int) -> tuple[Counter[tuple[str, str]],
                                                                      dict[str, tuple[int, float]]]:
    """What the hooks must report, computed plainly: the first `cap` names kept."""
    kept: list[str] = []
    events: Counter[tuple[str, str]] = Counter()
    timed: dict[str, tuple[int, float]] = {}
    for event, policy, seconds in sequence:
        if policy not in kept and len(kept) < cap:
            kept.append(policy)
        label = policy if policy in kept else OTHER_POLICY
        events[(event, label)] += 1
        if seconds > 0:
            count, total = timed.get(label, (0, 0.0))
            timed[label] = (count + 1, total + seconds)
    return events, timed


@settings(max_examples=60, deadline=None)
@given(sequence=observations, cap=st.integers(1, 7))
def test_both_adapters_report_what_a_plain_count_gives(
    sequence: list[tuple[str, str, float]], cap: int,
) -> None:
    registry = CollectorRegistry()
    prom = PrometheusMetrics(registry, max_policies=cap)
    otel = Otel(max_policies=cap)
    for event, policy, seconds in sequence:
        prom.observe(event, policy, seconds)  # type: ignore[arg-type]
        otel.hook.observe(event, policy, seconds)  # type: ignore[arg-type]
    events, timed = oracle(sequence, cap)
    assert prom_events(registry) == events
    assert otel.events() == events
    for latency in (prom_latency(registry), otel.latency()):
        assert {p: c for p, (c, _) in latency.items()} == {p: c for p, (c, _) in timed.items()}
        for policy, (_, total) in timed.items():
            assert latency[policy][1] == pytest.approx(total)


# -- configuration mistakes --------------------------------------------------------------------
def test_an_unknown_event_or_a_bad_cap_is_a_configuration_error() -> None:
    with pytest.raises(rl.ConfigurationError, match="unknown metrics event 'blocked'"):
        PrometheusMetrics(CollectorRegistry()).observe("blocked", "p", 0.0)  # type: ignore[arg-type]
    with pytest.raises(rl.ConfigurationError, match="unknown metrics event"):
        Otel().hook.observe("blocked", "p", 0.0)  # type: ignore[arg-type]
    with pytest.raises(rl.ConfigurationError, match="max_policies=1000"):
        PrometheusMetrics(CollectorRegistry(), max_policies=0)
    with pytest.raises(rl.ConfigurationError, match="max_policies"):
        Otel(max_policies=True)


@pytest.mark.parametrize(("module", "build", "extra"), [
    ("prometheus_client", lambda: PrometheusMetrics(CollectorRegistry()), "[prometheus]"),
    ("opentelemetry", lambda: OpenTelemetryMetrics(), "[otel]"),
])
def test_a_missing_library_names_the_extra_to_install(
    monkeypatch: pytest.MonkeyPatch, module: str, build: Any, extra: str,
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    with pytest.raises(rl.ConfigurationError) as raised:
        build()
    assert f"pip install 'ratelimit_mw{extra}'" in str(raised.value)
