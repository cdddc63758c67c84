"""On a Redis Cluster the deny cache keeps only refusals one store call decided.

A request limited under identities in two slots takes two calls; when the second refuses, the
first is given back (compensation). Neither that refusal nor one another worker saw while a
compensation was in flight may be replayed to other requests.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

import ratelimit_mw as rl
from ratelimit_mw.core.codec import Check
from tests._deny_cache_worker import Counting
from tests.conftest import StepClock

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture
def cluster(redis_cluster_url: str) -> Iterator[rl.RedisBackend]:
    backend = rl.RedisBackend.from_url(redis_cluster_url)
    yield backend
    backend.close()


@pytest.fixture
def prefix() -> str:
    return "k" + uuid.uuid4().hex[:12]


WIDE = rl.Policy("20/minute", algorithm="fixed-window", name="wide")
NARROW = rl.Policy("1/minute", algorithm="gcra", name="narrow")


def test_a_compensated_refusal_is_not_replayed(
    cluster: rl.RedisBackend, prefix: str, step_clock: StepClock
) -> None:
    counting = Counting(cluster)
    limiter = rl.Limiter(counting, prefix=prefix, clock=step_clock)  # type: ignore[arg-type]
    checks = [Check(WIDE, "all"), Check(NARROW, "u1")]
    assert limiter.check(checks).allowed
    calls = counting.calls
    first = limiter.check(checks)  # wide admits in its slot, narrow refuses, wide given back
    assert not first.allowed and counting.calls == calls + 3
    again = limiter.check(checks)
    assert counting.calls == calls + 6  # asked the store again: nothing was cached
    assert again == first
    assert limiter.peek(WIDE, "all").remaining == 19


def test_a_refusal_seen_during_compensation_elsewhere_is_not_served_to_fresh_identities(
    cluster: rl.RedisBackend, prefix: str, step_clock: StepClock
) -> None:
    worker = rl.Limiter(cluster, prefix=prefix, clock=step_clock)
    elsewhere = rl.Limiter(cluster, prefix=prefix, clock=step_clock, deny_cache=0)
    for _ in range(20):
        assert elsewhere.hit(WIDE, "all").allowed
    # The twentieth came from a request that another slot is about to refuse.
    refused = worker.check([Check(WIDE, "all"), Check(NARROW, "fresh:0")])
    assert not refused.allowed and refused.policy is WIDE
    elsewhere.refund(WIDE, "all")  # its compensation: Redis holds 19 of 20
    admitted = worker.check([Check(WIDE, "all"), Check(NARROW, "fresh:1")])
    assert admitted.allowed and admitted.remaining == 0


def test_a_single_slot_refusal_is_still_cached_on_a_cluster(
    cluster: rl.RedisBackend, prefix: str, step_clock: StepClock
) -> None:
    counting = Counting(cluster)
    limiter = rl.Limiter(counting, prefix=prefix, clock=step_clock)  # type: ignore[arg-type]
    decisions = [limiter.hit(NARROW, "u") for _ in range(100)]
    assert [d.allowed for d in decisions[:2]] == [True, False]
    assert counting.calls == 2
    plain = rl.Limiter(cluster, prefix=prefix, clock=step_clock, deny_cache=0)
    assert plain.hit(NARROW, "u") == decisions[-1]
