"""What operators rely on: metrics= reporting, ping(), acquire riding out a backend outage,
and the rate spellings of other libraries."""

from __future__ import annotations

import random
from typing import Any

import pytest

import ratelimit_mw as rl
from ratelimit_mw.core import codec
from ratelimit_mw.core.rates import parse_rates
from tests.conftest import StepClock


class Recorder:
    """A metrics hook that keeps every event."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, float]] = []

    def observe(self, event: str, policy: str, seconds: float) -> None:
        self.events.append((event, policy, seconds))


class Flaky:
    """A MemoryBackend that fails (BackendError) while `down`, counting the calls made."""

    is_cluster = False

    def __init__(self, down: int = 0) -> None:
        self.inner = rl.MemoryBackend()
        self.down = down
        self.calls = 0

    def run(self, call: codec.ScriptCall, deadline: float | None = None) -> list[int]:
        self.calls += 1
        if self.down:
            self.down -= 1
            raise rl.BackendError("Redis call failed: ConnectionError: refused")
        return self.inner.run(call)

    async def arun(self, call: codec.ScriptCall, deadline: float | None = None) -> list[int]:
        return self.run(call)


# -- metrics ------------------------------------------------------------------------------
def test_no_hook_by_default() -> None:
    assert rl.Limiter().metrics is None
    assert rl.AsyncLimiter().metrics is None


@pytest.mark.parametrize("bad", [object(), "prometheus", print])
def test_a_hook_without_observe_is_a_configuration_error(bad: object) -> None:
    with pytest.raises(rl.ConfigurationError, match="observe"):
        rl.Limiter(metrics=bad)  # type: ignore[arg-type]
    with pytest.raises(rl.ConfigurationError, match="observe"):
        rl.AsyncLimiter(metrics=bad)  # type: ignore[arg-type]


def test_admitted_and_refused_once_per_policy_with_the_calls_latency(
    step_clock: StepClock,
) -> None:
    hook = Recorder()
    limiter = rl.Limiter(clock=step_clock, metrics=hook)
    assert limiter.metrics is hook
    a = rl.Policy("1/minute", name="a")
    b = rl.Policy("5/minute", name="b")
    checks = [codec.Check(a, "u"), codec.Check(b, "u"), codec.Check(b, "v")]
    limiter.check(checks)
    limiter.check(checks)  # refused by a: the store decides
    limiter.check(checks)  # refused again: the deny cache answers
    assert [(e, p) for e, p, _ in hook.events] == [
        ("admitted", "a"), ("admitted", "b"),
        ("refused", "a"), ("refused", "b"),
        ("refused", "a"), ("refused", "b"),
    ]
    assert all(s > 0 for _, _, s in hook.events[:4])
    assert [s for _, _, s in hook.events[4:]] == [0.0, 0.0]


def test_a_backend_error_is_reported_and_raised() -> None:
    hook = Recorder()
    limiter = rl.Limiter(Flaky(down=1), metrics=hook)  # type: ignore[arg-type]
    with pytest.raises(rl.BackendError):
        limiter.hit("1/minute", "u")
    assert [(e, p) for e, p, _ in hook.events] == [("backend_error", "1/minute")]


async def test_the_async_limiter_reports_the_same_events(step_clock: StepClock) -> None:
    hook = Recorder()
    limiter = rl.AsyncLimiter(clock=step_clock, metrics=hook)
    policy = rl.Policy("1/minute", name="login")
    await limiter.hit(policy, "u")
    await limiter.hit(policy, "u")
    await limiter.hit(policy, "u")
    assert [e for e, _, _ in hook.events] == ["admitted", "refused", "refused"]
    # The memory store decides every hit itself (no deny cache before it): each one timed.
    assert all(seconds > 0 for _, _, seconds in hook.events)
    failing = rl.AsyncLimiter(Flaky(down=1), metrics=hook)  # type: ignore[arg-type]
    with pytest.raises(rl.BackendError):
        await failing.hit(policy, "u")
    assert hook.events[-1][:2] == ("backend_error", "login")


def test_acquire_reports_each_try(step_clock: StepClock) -> None:
    hook = Recorder()
    limiter = rl.Limiter(clock=step_clock, sleep=step_clock.sleep, metrics=hook)
    policy = rl.Policy("1/second", algorithm="gcra", name="api")
    limiter.hit(policy, "u")
    limiter.acquire(policy, "u", timeout=5)
    assert [e for e, _, _ in hook.events] == ["admitted", "refused", "admitted"]


# -- ping -----------------------------------------------------------------------------------
class Pinging:
    is_cluster = False

    def __init__(self, answer: Any) -> None:
        self.answer = answer

    def run(self, call: codec.ScriptCall, deadline: float | None = None) -> list[int]:
        raise AssertionError("ping runs no script call")

    async def arun(self, call: codec.ScriptCall, deadline: float | None = None) -> list[int]:
        raise AssertionError("ping runs no script call")

    def _answer(self) -> dict[str, Any]:
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer  # type: ignore[no-any-return]

    def ping(self) -> dict[str, Any]:
        return self._answer()

    async def aping(self) -> dict[str, Any]:
        return self._answer()


REPORT = {"backend": "redis", "version": "7.0.15", "cluster": False, "rtt_ms": 0.2}


def test_ping_returns_the_backends_report() -> None:
    assert rl.Limiter(Pinging(REPORT)).ping() == REPORT  # type: ignore[arg-type]


async def test_async_ping_returns_the_backends_report() -> None:
    assert await rl.AsyncLimiter(Pinging(REPORT)).ping() == REPORT  # type: ignore[arg-type]


@pytest.mark.parametrize("error", [ConnectionError("refused"), TimeoutError(), OSError(111, "x"),
                                   rl.BackendError("down")])
async def test_ping_wraps_store_errors_in_backend_error(error: BaseException) -> None:
    with pytest.raises(rl.BackendError):
        rl.Limiter(Pinging(error)).ping()  # type: ignore[arg-type]
    with pytest.raises(rl.BackendError):
        await rl.AsyncLimiter(Pinging(error)).ping()  # type: ignore[arg-type]


def test_ping_on_a_backend_without_it_says_so() -> None:
    with pytest.raises(rl.ConfigurationError, match="ping"):
        rl.Limiter(Flaky()).ping()  # type: ignore[arg-type]


# -- acquire through an outage --------------------------------------------------------------
def test_acquire_retries_backend_errors_until_admitted(step_clock: StepClock) -> None:
    backend = Flaky(down=4)
    limiter = rl.Limiter(backend, clock=step_clock, sleep=step_clock.sleep)  # type: ignore[arg-type]
    started = step_clock()
    assert limiter.acquire("1/minute", "u", timeout=5).allowed
    assert backend.calls == 5
    waited = step_clock() - started
    # 10, 20, 40, 80 ms, each drawn from its upper half
    assert 0.075 <= waited <= 0.15


def test_acquire_raises_backend_error_once_the_timeout_is_spent(step_clock: StepClock) -> None:
    backend = Flaky(down=10**9)
    limiter = rl.Limiter(backend, clock=step_clock, sleep=step_clock.sleep)  # type: ignore[arg-type]
    started = step_clock()
    with pytest.raises(rl.BackendError):
        limiter.acquire("1/minute", "u", timeout=5)
    assert step_clock() - started == pytest.approx(5.0, abs=1e-6)  # never past the deadline
    # Backoff capped at 1 s: ~10 tries in 5 s, not thousands, not one.
    assert 8 <= backend.calls <= 16


def test_acquire_without_a_timeout_raises_backend_error_at_once(step_clock: StepClock) -> None:
    backend = Flaky(down=1)
    limiter = rl.Limiter(backend, clock=step_clock, sleep=step_clock.sleep)  # type: ignore[arg-type]
    with pytest.raises(rl.BackendError):
        limiter.acquire("1/minute", "u")
    assert backend.calls == 1


async def test_async_acquire_retries_backend_errors_too(step_clock: StepClock) -> None:
    backend = Flaky(down=3)
    limiter = rl.AsyncLimiter(backend, clock=step_clock, sleep=step_clock.asleep)  # type: ignore[arg-type]
    assert (await limiter.acquire("1/minute", "u", timeout=1)).allowed
    assert backend.calls == 4
    down = rl.AsyncLimiter(Flaky(down=10**9), clock=step_clock, sleep=step_clock.asleep)  # type: ignore[arg-type]
    with pytest.raises(rl.BackendError):
        await down.acquire("1/minute", "u", timeout=0.5)


def test_backoff_grows_is_jittered_capped_and_stops_at_the_deadline() -> None:
    rng = random.Random(7)
    waits = [codec.backoff_wait(n, 100.0, rng) for n in range(1, 12)]
    assert all(w is not None for w in waits)
    firsts = [codec.BACKOFF_FIRST * 2 ** (n - 1) for n in range(1, 12)]
    for w, full in zip(waits, firsts, strict=True):
        top = min(full, codec.BACKOFF_CAP)
        assert w is not None and top / 2 <= w <= top
    assert len({round(w, 9) for w in waits if w is not None}) == len(waits)  # jittered
    assert codec.backoff_wait(20, 0.003, rng) == 0.003
    assert codec.backoff_wait(1, 0.0, rng) is None
    assert codec.backoff_wait(1, None, rng) is None


# -- rate spellings and bounds ----------------------------------------------------------------
@pytest.mark.parametrize("text", ["10/minute, 100/hour", "10/minute|100/hour",
                                  "10/minute ; 100/hour", "10 per minute,100 per hour"])
def test_tier_separators_of_other_libraries(text: str) -> None:
    assert parse_rates(text) == (rl.Rate(10, 60_000), rl.Rate(100, 3_600_000))
    assert rl.Policy(text).rates == parse_rates("10/minute;100/hour")


def test_a_limit_of_16_digits_is_refused() -> None:
    with pytest.raises(rl.ConfigurationError, match="15 digits"):
        rl.Policy("1000000000000000/millisecond")
    with pytest.raises(rl.ConfigurationError, match="15 digits"):
        rl.Rate(10**15, 1)
    assert rl.Rate(999_999_999_999_999, 1).limit == 999_999_999_999_999
