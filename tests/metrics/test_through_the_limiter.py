"""The adapters fed by a real Limiter/AsyncLimiter (``metrics=``), on memory and on Redis."""

from __future__ import annotations

import socket
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import ratelimit_mw as rl
from ratelimit_mw.metrics import OpenTelemetryMetrics, PrometheusMetrics

LOGIN = rl.Policy("2/minute", name="login")
SEARCH = rl.Policy("100/minute", algorithm="gcra", name="search")


def samples(registry: CollectorRegistry, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    text = generate_latest(registry).decode()
    return {tuple(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


def test_a_limiter_reports_admitted_refused_and_timing_to_prometheus(
    backend: Any, prefix: str, clock: Any,
) -> None:
    registry = CollectorRegistry()
    limiter = rl.Limiter(backend, prefix=prefix, clock=clock,
                         metrics=PrometheusMetrics(registry))
    outcomes = [bool(limiter.hit(LOGIN, "ip:1")) for _ in range(4)]
    assert outcomes == [True, True, False, False]
    limiter.check([rl.Check(LOGIN, "ip:2"), rl.Check(SEARCH, "ip:2")])
    events = samples(registry, "ratelimit_events_total")
    assert events[(("event", "admitted"), ("policy", "login"))] == 3
    assert events[(("event", "refused"), ("policy", "login"))] == 2
    assert events[(("event", "admitted"), ("policy", "search"))] == 1
    timed = samples(registry, "ratelimit_check_duration_seconds_count")
    # On Redis the second refusal was answered by the deny cache, without a store call: not
    # timed. The memory store decides every hit itself (no deny cache before it): all timed.
    assert timed[(("policy", "login"),)] == (5 if limiter.local_store else 4)
    assert timed[(("policy", "search"),)] == 1


async def test_an_async_limiter_reports_to_opentelemetry(prefix: str, clock: Any) -> None:
    reader = InMemoryMetricReader()
    hook = OpenTelemetryMetrics(meter_provider=MeterProvider(metric_readers=[reader]))
    limiter = rl.AsyncLimiter(rl.MemoryBackend(), prefix=prefix, clock=clock, metrics=hook)
    for _ in range(3):
        await limiter.hit(LOGIN, "u")
    data = reader.get_metrics_data()
    assert data is not None
    metrics = {m.name: m for r in data.resource_metrics for s in r.scope_metrics
               for m in s.metrics}
    counted = {(p.attributes["event"], p.attributes["policy"]): p.value
               for p in metrics["ratelimit.events"].data.data_points}
    assert counted == {("admitted", "login"): 2, ("refused", "login"): 1}
    (latency,) = metrics["ratelimit.check.duration"].data.data_points
    assert latency.count == 3 and latency.attributes == {"policy": "login"}


def test_a_store_that_is_down_is_a_backend_error_event() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    registry = CollectorRegistry()
    limiter = rl.Limiter(rl.RedisBackend.from_url(f"redis://127.0.0.1:{port}/0"),
                         metrics=PrometheusMetrics(registry))
    with pytest.raises(rl.BackendError):
        limiter.hit(LOGIN, "u")
    events = samples(registry, "ratelimit_events_total")
    assert events == {(("event", "backend_error"), ("policy", "login")): 1.0}


class _BrokenHook:
    """A metrics hook whose exporter is down: every observe raises."""

    def observe(self, event: str, policy: str, seconds: float) -> None:
        raise RuntimeError("statsd socket closed")


def test_a_metrics_hook_that_raises_changes_no_answer(
    backend: Any, prefix: str, clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # Raised through the limiter, it reached the middleware as a store failure, and
    # on_backend_error="allow" then admitted everyone.
    limiter = rl.Limiter(backend, prefix=prefix, clock=clock, metrics=_BrokenHook())
    answers = [limiter.hit(LOGIN, "u").allowed for _ in range(3)]
    assert answers == [True, True, False]
    assert "metrics hook raised" in caplog.text


async def test_a_metrics_hook_that_raises_changes_no_answer_through_the_middleware(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from ratelimit_mw.asgi import RateLimitMiddleware

    async def home(request: Any) -> PlainTextResponse:
        return PlainTextResponse("ok")

    limiter = rl.AsyncLimiter(rl.MemoryBackend(), metrics=_BrokenHook())
    app = RateLimitMiddleware(Starlette(routes=[Route("/", home)]), limiter,
                              default="2/minute")
    with TestClient(app) as client:
        assert [client.get("/").status_code for _ in range(3)] == [200, 200, 429]
    assert "metrics hook raised" in caplog.text


class _Events:
    def __init__(self) -> None:
        self.seen: list[str] = []

    def observe(self, event: str, policy: str, seconds: float) -> None:
        self.seen.append(event)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["client-pause", "sigstop", "stopped"])
@pytest.mark.parametrize("lane", [True, False], ids=["one-policy", "two-policies"])
async def test_every_request_is_one_event_also_when_the_deadline_cuts_its_call_off(
    prefix: str, lane: bool, fault: str,
) -> None:
    """A paused Redis (CLIENT PAUSE), a frozen one (SIGSTOP) and a stopped one: the request
    whose call fails or outlasts the middleware's deadline yields its event (backend_error),
    and those the breaker then skips yield breaker_open, one each. (Before: a request the
    deadline cut off yielded none, so an alert on backend_error missed a hung Redis.) A
    stopped Redis opens the breaker at once; a hung one after TIMEOUTS timeouts in a row."""
    import asyncio
    import os
    import signal

    import httpx
    from reliability._support import PrivateRedis
    from starlette.responses import PlainTextResponse

    from ratelimit_mw import asgi, keys
    from ratelimit_mw.http.breaker import TIMEOUTS

    server = PrivateRedis().start()
    events = _Events()
    backend = rl.AsyncRedisBackend.from_url(server.url, socket_timeout=5)
    limiter = rl.AsyncLimiter(backend, prefix=prefix, metrics=events)
    options: dict[str, Any] = {"default": "100/minute", "key": keys.header("x-client"),
                               "backend_timeout": 0.05}
    if not lane:
        options["rules"] = [asgi.Rule("/*", "1000/minute")]
    middleware = asgi.RateLimitMiddleware(PlainTextResponse("ok"), limiter, **options)
    transport = httpx.ASGITransport(app=middleware)
    admin = server.client()
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            assert (await client.get("/", headers={"x-client": "a"})).status_code == 200
            admitted = len(events.seen)
            if fault == "client-pause":
                admin.execute_command("CLIENT", "PAUSE", "3000", "ALL")
            elif fault == "sigstop":
                os.kill(server.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
            else:
                server.stop()
            # Sequential: each timeout comes a deadline or more after the one before.
            failing = 1 if fault == "stopped" else TIMEOUTS
            for i in range(failing + 3):
                await client.get("/", headers={"x-client": f"p{i}"})
            await asyncio.sleep(0)
        errors = failing * (1 if lane else 2)  # one event per policy of the request
        after = events.seen[admitted:]
        assert after[:errors] == ["backend_error"] * errors
        assert after[errors:] == ["breaker_open"] * 3 * (1 if lane else 2)
    finally:
        if fault == "sigstop":
            os.kill(server.proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
        elif fault == "client-pause":
            admin.execute_command("CLIENT", "UNPAUSE")
        admin.close()
        await backend.aclose()
        server.kill()
