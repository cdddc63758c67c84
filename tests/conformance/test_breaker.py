"""The breaker: one probe per cool-down whatever the concurrency, and one family of log lines.

A backend that fails (hangs past the deadline under ASGI, fails after 20 ms under WSGI) is
hit by rounds of N concurrent requests, N = 1, 8, 32. A failure that is not a timeout opens
the breaker at once: the first round finds it closed (every request calls, every call
fails). Timeouts open it only in a row (breaker.TIMEOUTS rounds, each a deadline or more
after the last): until then every request calls. Open, in each later round, one cool-down
later, exactly one request probes the backend and the others take the failure policy at
once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from support import CountingBackend, MonotonicClock, Recorder, failing_backend

import ratelimit_mw as rl
from ratelimit_mw.http.breaker import TIMEOUTS, Breaker
from ratelimit_mw.http.config import Config

ROUNDS = 3
CONFIG = Config(default="100/minute", backend_timeout=0.05, backend_cooldown=1.0)


def _install_clock(middleware: Any) -> MonotonicClock:
    clock = MonotonicClock()
    old = middleware.guard.breaker
    middleware.guard.breaker = Breaker(old.cooldown, old.policy, clock)
    return clock


async def _ok(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _wsgi_ok(environ: Any, start_response: Any) -> list[bytes]:
    start_response("200 OK", [])
    return [b"ok"]


def _asgi_rounds(backend: CountingBackend, concurrency: int,
                 recorder: Recorder | None = None, heal_at: int = -1,
                 rounds: int = ROUNDS + 1) -> list[int]:
    from ratelimit_mw.asgi import RateLimitMiddleware

    limiter = rl.AsyncLimiter(backend)
    if recorder is not None:
        limiter.metrics = recorder  # type: ignore[attr-defined]
    app = RateLimitMiddleware(_ok, limiter, config=CONFIG)
    clock = _install_clock(app)

    async def main() -> list[int]:
        transport = httpx.ASGITransport(app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            calls = []
            for index in range(rounds):
                if index == heal_at:
                    backend.failure = None
                before = backend.calls
                replies = await asyncio.gather(*(client.get("/") for _ in range(concurrency)))
                assert all(reply.status_code == 200 for reply in replies)
                calls.append(backend.calls - before)
                clock.advance(1.0)
            return calls

    return asyncio.run(main())


def _wsgi_rounds(backend: CountingBackend, concurrency: int,
                 recorder: Recorder | None = None, heal_at: int = -1) -> list[int]:
    from werkzeug.test import Client

    from ratelimit_mw.wsgi import RateLimitMiddleware

    app = RateLimitMiddleware(_wsgi_ok, rl.Limiter(backend), config=CONFIG)
    clock = _install_clock(app)
    calls = []
    with ThreadPoolExecutor(concurrency) as pool:
        for index in range(ROUNDS + 1):
            if index == heal_at:
                backend.failure = None
            before = backend.calls
            barrier = threading.Barrier(concurrency)

            def one(_: int, barrier: threading.Barrier = barrier) -> int:
                barrier.wait()
                return Client(app).get("/").status_code

            assert set(pool.map(one, range(concurrency))) == {200}
            calls.append(backend.calls - before)
            clock.advance(1.0)
    return calls


@pytest.mark.parametrize("concurrency", [1, 8, 32])
def test_asgi_sends_one_probe_per_cool_down_whatever_the_concurrency(concurrency: int) -> None:
    calls = _asgi_rounds(failing_backend("hang"), concurrency, rounds=TIMEOUTS + ROUNDS)
    # A hung backend: every request of the first TIMEOUTS rounds costs its deadline (each
    # round's timeouts count once), then one probe per cool-down.
    assert calls == [concurrency] * TIMEOUTS + [1] * ROUNDS


@pytest.mark.parametrize("concurrency", [1, 8, 32])
def test_asgi_opens_at_once_on_a_failure_that_is_not_a_timeout(concurrency: int) -> None:
    calls = _asgi_rounds(failing_backend("down"), concurrency)
    assert 1 <= calls[0] <= concurrency
    assert calls[1:] == [1] * ROUNDS


@pytest.mark.parametrize("concurrency", [1, 8, 32])
def test_wsgi_sends_one_probe_per_cool_down_whatever_the_concurrency(concurrency: int) -> None:
    calls = _wsgi_rounds(failing_backend("down", delay=0.02), concurrency)
    # The first round's requests all started before any failed; a thread that arrives after
    # the first failure is already skipped, so that round sends at most `concurrency`.
    assert 1 <= calls[0] <= concurrency
    assert calls[1:] == [1] * ROUNDS


def test_skipped_requests_report_breaker_open_to_the_limiters_metrics_hook() -> None:
    recorder = Recorder()
    _asgi_rounds(failing_backend("hang"), 4, recorder, rounds=TIMEOUTS + ROUNDS)
    # Each round once it is open: one probe, three skipped.
    assert recorder.names("breaker_open") == ["100/minute"] * (3 * ROUNDS)


def _log_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    lines = [record.getMessage() for record in caplog.records if record.name == "ratelimit_mw"]
    caplog.clear()
    return lines


@pytest.mark.parametrize("adapter", ["asgi", "wsgi"])
def test_an_outage_is_logged_once_with_its_reason_and_once_when_it_ends(
        adapter: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ratelimit_mw")
    if adapter == "asgi":  # hangs: opens at the TIMEOUTS-th round, answers two rounds later
        calls = _asgi_rounds(failing_backend("hang"), 8, heal_at=TIMEOUTS + 1,
                             rounds=TIMEOUTS + 2)
    else:  # down: opens at once, answers two rounds later
        calls = _wsgi_rounds(failing_backend("down"), 8, heal_at=2)
    lines = _log_lines(caplog)
    reason = "timed out after 50 ms" if adapter == "asgi" else "down"
    if adapter == "asgi":
        # The timeouts before the breaker opens: one line, however many (at most every 10 s).
        assert lines.pop(0) == (
            "ratelimit_mw: a rate-limit backend call failed (timed out after 50 ms); "
            "on_backend_error="
            f"'allow' applied to that request (the breaker opens after {TIMEOUTS} timeouts "
            "in a row, or on any failure but a timeout or CLUSTERDOWN)")
    assert lines[0] == (f"ratelimit_mw: rate-limit backend failed ({reason}); applying "
                        "on_backend_error='allow', probing it once every 1 s")
    assert len(lines) == 2
    assert lines[1].startswith("ratelimit_mw: rate-limit backend answers again after 2.0 s")
    assert lines[1].endswith(" s; limiting resumed")
    assert calls[-1] == 8  # closed again: every request is decided
