"""A holder paused past its lease, through the WSGI middleware (issue 43, item 6): the body's
renewal takes a still-free slot again, or reports a slot another request took (the
``lease_lost`` metric, a log line) and applies ``on_lease_lost``; on memory and the real
Redis, on the test clock (the pause is the clock jumping past the 3 s lease)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from test_wsgi_in_flight import served, whole

import ratelimit_mw as rl
from ratelimit_mw.http.slots import LeaseLost
from ratelimit_mw.wsgi import RateLimitMiddleware


@pytest.fixture(autouse=True)
def _swept(prefix: str, redis_client: Any) -> Iterator[None]:
    yield
    for key in redis_client.scan_iter(f"{prefix}:*"):
        redis_client.delete(key)


class Events:
    def __init__(self) -> None:
        self.seen: Counter[str] = Counter()

    def observe(self, event: str, policy: str, seconds: float) -> None:
        self.seen[event] += 1


def _app(environ: dict[str, Any], start_response: Any) -> Any:
    start_response("200 OK", [("Content-Type", "text/plain")])
    return iter([b"a", b"b", b"c"])


def _limited(backend: Any, prefix: str, clock: Any, **options: Any
             ) -> tuple[RateLimitMiddleware, Events]:
    events = Events()
    limiter = rl.Limiter(backend, prefix=prefix, clock=clock, sleep=clock.sleep,
                         metrics=events)
    return RateLimitMiddleware(_app, limiter, concurrency=rl.Policy.in_flight(1, lease=3),
                               **options), events


def test_a_renewal_after_a_pause_takes_the_still_free_slot_again(
        backend: Any, prefix: str, clock: Any) -> None:
    wrapped, events = _limited(backend, prefix, clock)
    _, body = served(wrapped)
    chunks = iter(body)
    assert next(chunks) == b"a"
    clock.advance(4)  # paused past the lease; nobody came
    assert next(chunks) == b"b"  # renewed first: the slot was free, taken again
    assert whole(wrapped) == "429"
    assert next(chunks) == b"c"
    body.close()
    assert events.seen["lease_lost"] == 0
    assert whole(wrapped) == "200"


@pytest.mark.parametrize("choice", ["continue", "end"])
def test_a_slot_taken_while_paused_is_reported_and_on_lease_lost_applies(
        backend: Any, prefix: str, clock: Any, caplog: Any, choice: str) -> None:
    wrapped, events = _limited(backend, prefix, clock, on_lease_lost=choice)
    _, body = served(wrapped)
    chunks = iter(body)
    assert next(chunks) == b"a"
    clock.advance(4)  # paused past the lease ...
    taker_start, taker = served(wrapped)  # ... and another request took the slot
    assert taker_start.status.startswith("200")
    with caplog.at_level(logging.WARNING, logger="ratelimit_mw"):
        if choice == "end":
            with pytest.raises(LeaseLost):
                next(chunks)
        else:
            assert next(chunks) == b"b"
    assert events.seen["lease_lost"] == 1
    assert f"on_lease_lost={choice!r}" in caplog.text
    body.close()  # the lost holder's end gives back nothing of the taker's
    assert whole(wrapped) == "429"
    taker.close()
    assert whole(wrapped) == "200"
