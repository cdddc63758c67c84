"""The scenario examples in examples/ do what their docstrings say (memory, Redis, fake clock)."""

from __future__ import annotations

import datetime as dt
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

import ratelimit_mw as rl

from ._helpers import UTC, local, set_time

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name: str) -> ModuleType:
    module_name = f"_scenario_example_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def test_penalty_ban_example(limiter: rl.Limiter, clock: Any) -> None:
    example = load("penalty_ban")
    said = [example.like(limiter, "alice") for _ in range(12)]
    assert said[9] == "liked (0 left in this window)"
    assert said[10:] == ["banned: try again in 3600 s"] * 2
    set_time(clock, local("Asia/Shanghai", 2026, 5, 1, 21, 0))
    comments = rl.Policy("3/minute", penalty=example.until_local_midnight("Asia/Shanghai",
                                                                          now=clock))
    said = [example.like(limiter, "bob", comments) for _ in range(4)]
    assert said[3] == "banned: try again in 10800 s"


def test_daily_quota_example(limiter: rl.Limiter, clock: Any) -> None:
    example = load("daily_quota")
    set_time(clock, local("Asia/Shanghai", 2026, 5, 1, 18, 30))
    now = dt.datetime.fromtimestamp(clock.now, UTC)
    said = [example.upload(limiter, "bob", now) for _ in range(101)]
    assert said[99] == "uploaded (0 left today)"
    assert said[100] == "daily quota used up; it resets at 2026-05-02 00:00 CST"


def test_scheduled_push_example(limiter: rl.Limiter, clock: Any) -> None:
    example = load("scheduled_push")
    start = dt.datetime.fromtimestamp(clock.now, UTC) + dt.timedelta(hours=1)
    wanted = [start + dt.timedelta(minutes=m) for m in (0, 0.5, 10, 20, 30, 40)]
    booked = [example.schedule(limiter, "carol", when) for when in wanted]
    times = [(result[0] - start) / dt.timedelta(minutes=1) for result in booked]
    # 1/minute moves the second push to +1 min; 5/hour moves the sixth past the first's hour.
    assert times == [0, 1, 10, 20, 30, 60]
    limiter.cancel(booked[0][1])
    assert limiter.reserve(example.PUSH, "carol", at=start).allowed
    too_many = example.schedule(limiter, "carol", start)
    assert too_many is not None and too_many[0] > start


def test_outbound_throttle_example(limiter: rl.Limiter, clock: Any) -> None:
    example = load("outbound_throttle")
    provider = example.Provider(clock=clock)
    policy = rl.Policy("10/second", name="payments-api")
    with example.make_client(limiter, httpx.MockTransport(provider), policy) as client:
        example.worker(client, 35)
    assert len(provider.calls) == 35
    assert provider.busiest_second() == 10


def test_outbound_throttle_example_runs_threads_in_real_time(
    capsys: pytest.CaptureFixture[str],
) -> None:
    load("outbound_throttle").main(workers=3, charges=10)  # 30 calls under 100/second
    assert "30 calls in" in capsys.readouterr().out


async def test_failed_logins_example_counts_only_failures(
    alimiter: rl.AsyncLimiter, clock: Any
) -> None:
    example = load("failed_logins")
    app = example.build_app(alimiter)
    assert await example.demo(app) == [200, 200, 200, 401, 401, 401, 401, 401, 429, 429]
    clock.advance(15 * 60)  # the five failures (all at one fake instant) have left the window
    good = {"username": "dana", "password": "correct horse battery staple"}
    transport = httpx.ASGITransport(app=app, client=(example.CLIENT, 4242))
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
        for _ in range(10):  # successes never use up the quota
            assert (await http.post("/login", json=good)).status_code == 200
        refused = await http.post("/login", json={"username": "dana", "password": "x"})
    assert refused.status_code == 401
    decision = await alimiter.peek(example.FAILED_LOGINS, f"ip:{example.CLIENT}")
    assert decision.remaining == 4  # ten successes gave their hits back; one failure counts


@pytest.mark.parametrize("name", ["penalty_ban", "daily_quota", "scheduled_push",
                                  "failed_logins"])
def test_each_example_runs_as_a_script(name: str, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RATELIMIT_REDIS_URL", raising=False)
    load(name).main()
    assert capsys.readouterr().out.strip()
