"""A refusal under a ban says when a retry is really admitted: the later of the ban's end and
the refusing window's own wait.

A penalty shorter than the window's wait used to answer Retry-After = the ban left: a client
retrying exactly then was refused again by the window, which started a new ban, and again
("5/minute", penalty 10 s: six refusals, admitted only after 60 s). Spec, for every algorithm
on both backends (memory and the real Redis): the refusal's retry_after is the window's wait;
retrying exactly then is admitted and not banned again; retrying 1 ms before is refused; a hit
during the ban is refused with the window's wait (counting down) and records nothing; with a
penalty longer than the window the retry is the ban left, as before. The reset is the later of
the ban's end and the window's own. A no-penalty twin policy (another name, the same hits)
gives the window's own numbers.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import math
from typing import Any

import pytest

import ratelimit_mw as rl
from ratelimit_mw.core import codec
from ratelimit_mw.core.codec import Check
from tests.conftest import StepClock

RATE = "3/10 seconds"
START_US = 1_800_000_000_000_000 + 123_456  # 123.456 ms into an epoch-aligned 10 s window

# The window's own wait (ms) after three hits at START_US, for the fourth:
WAITS_MS = {
    "fixed-window": 9_877,  # to the window's end
    "sliding-log": 10_000,  # until the oldest hit leaves
    "sliding-window": 13_211,  # into the next window, until the previous one's weight fades
    "gcra": 3_334,  # one emission interval (3,333,334 µs, rounded up)
}
SHORT_PENALTY = 2  # seconds: shorter than every wait above
LONG_PENALTY = 60  # seconds: longer than every wait above


def _setup(backend: Any, prefix: str, algorithm: str, penalty: float
           ) -> tuple[rl.Limiter, StepClock, rl.Policy, rl.Policy]:
    clock = StepClock()
    clock.us = START_US
    limiter = rl.Limiter(backend, prefix=prefix, clock=clock, sleep=clock.sleep, deny_cache=0)
    policy = rl.Policy(RATE, algorithm=algorithm, name="pen", penalty=penalty)
    twin = rl.Policy(RATE, algorithm=algorithm, name="own")  # the window alone
    return limiter, clock, policy, twin


def _fill(limiter: rl.Limiter, policy: rl.Policy, twin: rl.Policy, *who: str) -> None:
    for identity in who:
        for _ in range(3):
            assert limiter.hit(policy, identity).allowed
            assert limiter.hit(twin, identity).allowed


def _hit_both(limiter: rl.Limiter, policy: rl.Policy, twin: rl.Policy, identity: str
              ) -> tuple[rl.Decision, rl.Decision]:
    return limiter.hit(policy, identity), limiter.hit(twin, identity)


@pytest.mark.parametrize("algorithm", sorted(WAITS_MS))
def test_a_short_penalty_answers_the_windows_wait_and_an_obedient_retry_is_admitted(
    backend: Any, prefix: str, algorithm: str
) -> None:
    limiter, clock, policy, twin = _setup(backend, prefix, algorithm, SHORT_PENALTY)
    _fill(limiter, policy, twin, "early", "exact")
    wait_ms = WAITS_MS[algorithm]
    for identity in ("early", "exact"):
        refused, own = _hit_both(limiter, policy, twin, identity)
        assert (refused.allowed, refused.banned, refused.remaining) == (False, True, 0)
        assert refused.retry_after == own.retry_after == wait_ms / 1000
        assert [t.retry_after for t in refused.tiers] == [wait_ms / 1000]
        # The quota is whole again when the window says so, not when the ban ends.
        assert refused.reset_after == max(SHORT_PENALTY, own.reset_after)

    clock.advance_ms(wait_ms - 1)
    # 1 ms early: the ban is over, the window still refuses (peek starts no ban) ...
    seen = limiter.peek(policy, "exact")
    assert (seen.allowed, seen.banned, seen.retry_after) == (False, False, 0.001)
    # ... and a hit then is refused and starts a new ban, the client's own doing.
    early = limiter.hit(policy, "early")
    assert (early.allowed, early.banned, early.retry_after) == (False, True, SHORT_PENALTY)

    clock.advance_ms(1)
    admitted = limiter.hit(policy, "exact")
    assert (admitted.allowed, admitted.banned) == (True, False)
    assert admitted.remaining == limiter.hit(twin, "exact").remaining


@pytest.mark.parametrize("algorithm", sorted(WAITS_MS))
def test_a_hit_during_a_short_ban_gets_the_windows_wait_and_records_nothing(
    backend: Any, prefix: str, algorithm: str
) -> None:
    limiter, clock, policy, twin = _setup(backend, prefix, algorithm, SHORT_PENALTY)
    _fill(limiter, policy, twin, "u")
    wait_ms = WAITS_MS[algorithm]
    assert limiter.hit(policy, "u").retry_after == wait_ms / 1000
    for step_ms in (1, 999, 1_000 - 1):  # 1.999 s in: the ban (2 s) is about to end
        clock.advance_ms(step_ms)
        during = limiter.hit(policy, "u")
        own = limiter.peek(twin, "u")
        left = SHORT_PENALTY - (clock.us - START_US) / 1e6
        assert (during.allowed, during.banned, during.remaining) == (False, True, 0)
        # The window's wait, counting down toward the same instant; not the ban left.
        assert during.retry_after == pytest.approx(wait_ms / 1000 - (clock.us - START_US) / 1e6,
                                                   abs=1e-9)
        assert during.retry_after == own.retry_after
        assert during.reset_after == pytest.approx(max(left, own.reset_after), abs=1e-9)
    clock.us = START_US + wait_ms * 1000
    admitted = limiter.hit(policy, "u")
    assert (admitted.allowed, admitted.banned) == (True, False)
    # The banned hits recorded nothing: the same remaining as the window alone.
    assert admitted.remaining == limiter.hit(twin, "u").remaining


@pytest.mark.parametrize("algorithm", sorted(WAITS_MS))
def test_a_penalty_longer_than_the_window_answers_the_ban_left(
    backend: Any, prefix: str, algorithm: str
) -> None:
    limiter, clock, policy, twin = _setup(backend, prefix, algorithm, LONG_PENALTY)
    _fill(limiter, policy, twin, "u")
    refused = limiter.hit(policy, "u")
    assert (refused.allowed, refused.banned) == (False, True)
    assert (refused.retry_after, refused.reset_after) == (LONG_PENALTY, LONG_PENALTY)
    clock.advance(30)  # the window is long over; the ban is not
    during = limiter.hit(policy, "u")
    assert (during.allowed, during.banned, during.retry_after, during.reset_after) == (
        False, True, 30.0, 30.0)
    clock.us = START_US + (LONG_PENALTY * 1000 - 1) * 1000
    last = limiter.hit(policy, "u")
    assert (last.allowed, last.banned, last.retry_after) == (False, True, 0.001)
    clock.advance_ms(1)
    assert limiter.hit(policy, "u").allowed


@pytest.mark.parametrize("algorithm", sorted(WAITS_MS))
def test_a_cost_above_the_limit_stays_never_under_a_short_ban(
    backend: Any, prefix: str, algorithm: str
) -> None:
    limiter, clock, policy, _ = _setup(backend, prefix, algorithm, SHORT_PENALTY)
    refused = limiter.hit(policy, "u", cost=4)
    assert (refused.banned, refused.retry_after) == (True, math.inf)
    clock.advance(1)
    assert limiter.hit(policy, "u", cost=4).retry_after == math.inf
    assert limiter.hit(policy, "u").retry_after == 1.0  # the ban's end: the window is empty


@pytest.mark.parametrize("algorithm", sorted(WAITS_MS))
def test_every_tier_of_a_banned_policy_waits_for_the_ban_and_its_own_window(
    backend: Any, prefix: str, algorithm: str
) -> None:
    """A tier that would admit reports the ban left; the refusing tier its own longer wait,
    which governs."""
    limiter, clock, _, _ = _setup(backend, prefix, algorithm, SHORT_PENALTY)
    policy = rl.Policy(f"{RATE};100/hour", algorithm=algorithm, penalty=SHORT_PENALTY)
    for _ in range(3):
        assert limiter.hit(policy, "u").allowed
    refused = limiter.hit(policy, "u")
    assert refused.banned and refused.retry_after == WAITS_MS[algorithm] / 1000
    assert [t.retry_after for t in refused.tiers] == [WAITS_MS[algorithm] / 1000,
                                                      SHORT_PENALTY]
    assert [t.banned for t in refused.tiers] == [True, True]
    clock.advance_ms(WAITS_MS[algorithm])
    assert limiter.hit(policy, "u").allowed


@pytest.mark.parametrize("penalty", [SHORT_PENALTY, LONG_PENALTY])
@pytest.mark.parametrize("algorithm", sorted(WAITS_MS))
def test_the_deny_cache_replays_a_banned_refusal_as_the_store_answers_it_later(
    backend: Any, prefix: str, algorithm: str, penalty: float
) -> None:
    """The reply's stability values: a banned refusal replays until the ban ends, its retry
    (the later of the ban's end and the window's wait) and reset counting down exactly as the
    store's own answers at those times; a hit during the ban gets the same."""
    policy = rl.Policy(RATE, algorithm=algorithm, name="pen", penalty=penalty)
    check = [Check(policy, "u")]

    def run(op: str, now_us: int) -> tuple[codec.ScriptCall, list[int]]:
        call = codec.build(op, check, prefix, now_us=now_us)
        return call, list(backend.run(call))

    for _ in range(3):
        assert run(codec.HIT, START_US)[1][0] == 1
    for first_us in (START_US, START_US + 700_123):  # the ban's start, and a hit during it
        call, reply = run(codec.HIT, first_us)
        window = codec.replay_window(reply)
        ban_end_us = (START_US // 1000 + penalty * 1000) * 1000
        # Until the ban ends (then a hit may start a new ban, or be admitted).
        assert window == ban_end_us - first_us
        for elapsed in (0, 1, 999, 1_000, 123_457, window // 2, window - 1):
            replayed, _ = codec.replay(call.layout, reply, elapsed)
            _, later = run(codec.HIT, first_us + elapsed)
            assert replayed == codec.decoded(call, later), elapsed
            assert replayed.tiers == codec.decoded(call, later).tiers


def test_an_obedient_http_client_is_refused_once_and_waits_the_windows_wait() -> None:
    """The report's scenario through the ASGI middleware: "5/minute", penalty 10 s; a client
    that retries exactly at Retry-After."""
    from ratelimit_mw.asgi import RateLimitMiddleware

    async def hello(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def main() -> list[int]:
        clock = StepClock()
        app = RateLimitMiddleware(hello, rl.AsyncLimiter(rl.MemoryBackend(), clock=clock),
                                  default=rl.Policy("5/minute", name="api", penalty="10 seconds"))

        async def get() -> tuple[int, bytes | None]:
            scope = {"type": "http", "method": "GET", "path": "/", "root_path": "",
                     "query_string": b"", "headers": [], "client": ("203.0.113.9", 1)}
            sent: list[Any] = []

            async def receive() -> dict[str, str]:
                return {"type": "http.request"}

            async def send(message: Any) -> None:
                sent.append(message)

            await app(scope, receive, send)
            return sent[0]["status"], dict(sent[0]["headers"]).get(b"retry-after")

        for _ in range(5):
            assert (await get())[0] == 200
        waits: list[int] = []
        status, retry_after = await get()
        while status == 429 and len(waits) < 10:
            assert retry_after is not None
            waits.append(int(retry_after))
            clock.advance(int(retry_after))  # obey Retry-After exactly
            status, retry_after = await get()
        assert status == 200
        return waits

    assert asyncio.run(main()) == [60]


def test_a_banned_sliding_log_with_a_booking_ahead_waits_for_the_first_free_time_after_the_ban(
    backend: Any, prefix: str
) -> None:
    """With a booking ahead a log may refuse again after its own wait: the retry is the first
    time from the ban's end that fits, not merely the later of the two waits."""
    limiter, clock, _, _ = _setup(backend, prefix, "sliding-log", 12)
    policy = rl.Policy("1/10 seconds", algorithm="sliding-log", penalty=12)
    t0 = clock.us
    clock.us = t0 - 9_000_000
    assert limiter.hit(policy, "u").allowed  # fills the window until t0 + 1 s
    booked_at = dt.datetime.fromtimestamp((t0 + 20_000_000) / 1e6, dt.timezone.utc)
    assert limiter.reserve(policy, "u", at=booked_at).allowed  # blocks t0 + 10.001 .. 29.999 s
    clock.us = t0
    refused = limiter.hit(policy, "u")
    # Its own wait is 1 s, the ban 12 s; at 12 s the booking's windows refuse until 30 s.
    assert (refused.banned, refused.retry_after) == (True, 30.0)
    clock.us = t0 + 29_999_000
    assert not limiter.peek(policy, "u").allowed
    clock.us = t0 + 30_000_000
    assert limiter.hit(policy, "u").allowed
