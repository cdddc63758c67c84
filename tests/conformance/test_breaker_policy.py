"""When the breaker opens: on evidence that the store is down, not on one late answer.

Driven with a clock the test moves (no sleeps): a connection error or an error reply opens
it at once; timeouts only TIMEOUTS in a row, each a deadline or more after the last counted
(the calls one stall catches count once), with no answer in time between; CLUSTERDOWN
never. On a cluster each node has its own breaker (`Breakers`).
"""

from __future__ import annotations

import asyncio

import pytest
import redis
from support import MonotonicClock

import ratelimit_mw as rl
from ratelimit_mw.http.breaker import (
    ANSWER,
    DOWN,
    TIMEOUT,
    TIMEOUTS,
    Breaker,
    Breakers,
    kind_of,
)

DEADLINE = 0.1


def _breaker() -> tuple[Breaker, MonotonicClock]:
    clock = MonotonicClock()
    return Breaker(1.0, "'allow'", clock, deadline=DEADLINE), clock


def _wrapped(exc: BaseException) -> rl.BackendError:
    try:
        raise rl.BackendError(f"Redis call failed: {exc}") from exc
    except rl.BackendError as wrapped:
        return wrapped


@pytest.mark.parametrize(("exc", "kind"), [
    (TimeoutError(), TIMEOUT),
    (asyncio.TimeoutError(), TIMEOUT),
    (redis.TimeoutError("Timeout reading from Redis"), TIMEOUT),
    (_wrapped(redis.TimeoutError("Timeout connecting to 127.0.0.1:1")), TIMEOUT),
    (_wrapped(redis.ResponseError("CLUSTERDOWN The cluster is down")), ANSWER),
    (_wrapped(redis.ConnectionError("Connection refused")), DOWN),
    (ConnectionResetError(), DOWN),
    (rl.BackendError("down"), DOWN),
    (_wrapped(redis.ResponseError("OOM command not allowed")), DOWN),
    (RuntimeError("a bug in a custom backend"), DOWN),
], ids=lambda v: v if isinstance(v, str) else type(v).__name__)
def test_what_a_failure_says_of_the_store(exc: BaseException, kind: str) -> None:
    assert kind_of(exc) == kind


def test_a_connection_error_opens_it_at_once() -> None:
    breaker, _ = _breaker()
    breaker.failed("refused", _wrapped(redis.ConnectionError("Connection refused")))
    assert breaker.is_open


def test_the_timeouts_of_one_stall_count_once() -> None:
    breaker, clock = _breaker()
    for _ in range(50):  # a burst caught in one stall: all time out within a deadline
        breaker.failed("timed out", TimeoutError())
        clock.advance(DEADLINE / 100)
    assert (breaker.is_open, breaker.timeouts) == (False, 1)


def test_timeouts_a_deadline_apart_open_it_after_timeouts_in_a_row() -> None:
    breaker, clock = _breaker()
    for count in range(1, TIMEOUTS):
        breaker.failed("timed out", TimeoutError())
        assert (breaker.is_open, breaker.timeouts) == (False, count)
        clock.advance(DEADLINE)
    breaker.failed("timed out", TimeoutError())
    assert breaker.is_open
    # Open: the probe of each cool-down only; then a probe that answers closes it.
    assert not breaker.may_call()
    clock.advance(1.0)
    assert breaker.may_call() and not breaker.may_call()
    assert breaker.succeeded() and not breaker.is_open and breaker.timeouts == 0


def test_an_answer_in_time_ends_a_row_of_timeouts() -> None:
    breaker, clock = _breaker()
    for _ in range(3 * TIMEOUTS):
        for _ in range(TIMEOUTS - 1):
            breaker.failed("timed out", TimeoutError())
            clock.advance(DEADLINE)
        breaker.succeeded()  # the store answered one in time: late, not down
    assert not breaker.is_open and breaker.timeouts == 0


def test_clusterdown_never_opens_it() -> None:
    breaker, clock = _breaker()
    for _ in range(10):
        breaker.failed("CLUSTERDOWN", _wrapped(redis.ResponseError("CLUSTERDOWN down")))
        clock.advance(DEADLINE)
    assert not breaker.is_open and breaker.timeouts == 0


def test_a_failure_of_unknown_kind_opens_it_at_once() -> None:
    breaker, _ = _breaker()
    breaker.failed("could not give back")  # no exception given: as before, at once
    assert breaker.is_open


def test_each_cluster_node_has_its_own_breaker() -> None:
    default, _ = _breaker()
    where = {"a": ("10.0.0.1", 7000), "b": ("10.0.0.2", 7000), "c": ("10.0.0.1", 7000)}
    breakers = Breakers(default, where.get)  # type: ignore[arg-type]
    sick = breakers.of(["a"])
    assert sick is breakers.of(["c"]) and sick is not breakers.of(["b"])
    assert breakers.of(["unknown"]) is default  # the slot map not loaded yet
    sick.failed("refused", ConnectionRefusedError())
    assert sick.is_open and not breakers.of(["b"]).is_open and not default.is_open
    where["a"] = ("10.0.0.3", 7000)  # failed over: the slot's new primary, closed
    assert not breakers.of(["a"]).is_open


def test_a_guard_on_a_cluster_backend_keys_its_breakers_by_node() -> None:
    class Clustered:
        is_cluster = True

        def node_of(self, identity: str) -> str:
            return identity[:1]

        async def arun(self, call: object, deadline: float | None = None) -> list[int]:
            raise AssertionError("not called")

    guard_breakers = Breakers.per_node(Breaker(1.0, "'allow'"),
                                       rl.AsyncLimiter(Clustered()))  # type: ignore[arg-type]
    assert guard_breakers is not None and guard_breakers.of(["x1"]) is guard_breakers.of(["x2"])
    assert Breakers.per_node(Breaker(1.0, "'allow'"), rl.AsyncLimiter()) is None


def test_a_refusal_from_the_deny_cache_does_not_end_a_row_of_timeouts() -> None:
    """The deny cache answers a refused client without the store: that is no evidence the
    store answers, so a hung store still opens the breaker however many such refusals come
    between its timeouts (an admission, always the store's, ends the row)."""
    import httpx
    from starlette.responses import PlainTextResponse
    from support import CountingBackend

    from ratelimit_mw import asgi, keys

    backend = CountingBackend()
    app = asgi.RateLimitMiddleware(PlainTextResponse("ok"), rl.AsyncLimiter(backend),
                                   default="1/minute", key=keys.header("x-client"),
                                   backend_timeout=0.05)
    clock = MonotonicClock()
    breaker = app.guard.breaker = Breaker(1.0, "'allow'", clock, deadline=0.05)

    async def main() -> list[int]:
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            async def get(who: str) -> int:
                return (await client.get("/", headers={"x-client": who})).status_code

            seen = [await get("x"), await get("x")]  # admitted, then refused: cached
            backend.failure = "hang"
            for _ in range(TIMEOUTS):
                calls = backend.calls
                seen.append(await get("x"))  # the deny cache's refusal: no call
                assert backend.calls == calls
                seen.append(await get("y"))  # times out: counted
                clock.advance(1.0)
            return seen

    assert asyncio.run(main()) == [200, 429] + [429, 200] * TIMEOUTS
    assert breaker.is_open
