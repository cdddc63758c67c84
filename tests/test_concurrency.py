"""Exactness under contention on the real Redis: N clients, one identity, exactly `limit` pass.

Several processes (spawned once for the module) and many asyncio tasks hit one identity at
the same moment; the one-script design must admit exactly the limit, never one more, for
every algorithm and for multi-tier policies. No fake clock: the periods are long (hours and
days) and the test steps over a window boundary if one is near, so nothing rolls meanwhile.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
import uuid
from collections.abc import Iterator
from multiprocessing.pool import Pool

import pytest
import redis.asyncio

import ratelimit_mw as rl

pytestmark = pytest.mark.slow

REDIS_URL = os.environ.get("RATELIMIT_REDIS_URL", "redis://127.0.0.1:6379/0")
ALGORITHMS = sorted(rl.ALGORITHMS)
PROCESSES = 4
DAY_S = 86_400


def hammer(url: str, prefix: str, rates: str, algorithm: str, identity: str, attempts: int,
           cost: int, start_at: float) -> int:
    """One process: wait for the common start, hit `attempts` times, count admitted units."""
    backend = rl.RedisBackend.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    limiter = rl.Limiter(backend, prefix=prefix, deny_cache=0)
    policy = rl.Policy(rates, algorithm=algorithm)
    limiter.peek(policy, identity)  # connect before the start line
    time.sleep(max(0.0, start_at - time.time()))
    admitted = sum(cost for _ in range(attempts) if limiter.hit(policy, identity, cost).allowed)
    backend.close()
    return admitted


def away_from_day_boundary() -> None:
    """Fixed and sliding windows here are days: never start a run just before midnight UTC."""
    left = DAY_S - time.time() % DAY_S
    if left < 20:
        time.sleep(left + 0.5)


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    context = multiprocessing.get_context("spawn")
    with context.Pool(PROCESSES) as workers:
        workers.map(abs, range(PROCESSES))  # start every worker before the first race
        yield workers


SCENARIOS = [
    *[(algorithm, "40/day", 1, 40) for algorithm in ALGORITHMS],
    *[(algorithm, "25/hour;40/day", 1, 25) for algorithm in ALGORITHMS],
    ("sliding-log", "30/day", 3, 30),
    ("gcra", "30/day", 2, 30),
]


@pytest.mark.parametrize(("algorithm", "rates", "cost", "expected"), SCENARIOS)
def test_processes_racing_on_one_identity_admit_exactly_the_limit(
    pool: Pool, redis_client: object, algorithm: str, rates: str, cost: int, expected: int
) -> None:
    away_from_day_boundary()
    prefix = "c" + uuid.uuid4().hex[:12]
    attempts = 2 * expected // cost // PROCESSES + 4
    start_at = time.time() + 0.3
    jobs = [(REDIS_URL, prefix, rates, algorithm, "shared", attempts, cost, start_at)
            for _ in range(PROCESSES)]
    admitted = pool.starmap(hammer, jobs, chunksize=1)
    assert sum(admitted) == expected, admitted
    peek = rl.Limiter(rl.RedisBackend(redis_client), prefix=prefix).peek(
        rl.Policy(rates, algorithm=algorithm), "shared")
    assert peek.remaining == 0 and not peek.allowed


@pytest.mark.parametrize("algorithm", ALGORITHMS)
async def test_asyncio_tasks_racing_on_one_identity_admit_exactly_the_limit(
    algorithm: str,
) -> None:
    away_from_day_boundary()
    client = redis.asyncio.Redis.from_url(REDIS_URL, max_connections=64)
    limiter = rl.AsyncLimiter(rl.AsyncRedisBackend(client), prefix="c" + uuid.uuid4().hex[:12],
                              deny_cache=0)
    policy = rl.Policy("60/hour;90/day", algorithm=algorithm)
    start = asyncio.Event()

    async def task() -> int:
        await start.wait()
        return sum([(await limiter.hit(policy, "shared")).allowed for _ in range(4)])

    tasks = [asyncio.create_task(task()) for _ in range(40)]
    await asyncio.sleep(0)
    start.set()
    try:
        assert sum(await asyncio.gather(*tasks)) == 60
        assert (await limiter.peek(policy, "shared")).remaining == 0
    finally:
        await client.aclose()


async def test_asyncio_multi_policy_checks_stay_all_or_nothing_under_contention() -> None:
    """Two policies per check: whatever the interleaving, neither ever counts a refused check."""
    client = redis.asyncio.Redis.from_url(REDIS_URL, max_connections=64)
    limiter = rl.AsyncLimiter(rl.AsyncRedisBackend(client), prefix="c" + uuid.uuid4().hex[:12],
                              deny_cache=0)
    per_user = rl.Policy("10/day", algorithm="gcra", name="user")
    global_ = rl.Policy("25/day", name="global")

    async def task(user: str) -> int:
        checks = [rl.Check(per_user, user), rl.Check(global_, "all")]
        return sum([(await limiter.check(checks)).allowed for _ in range(8)])

    try:
        admitted = await asyncio.gather(*(task(f"u{i % 4}") for i in range(20)))
        assert sum(admitted) == 25
        assert (await limiter.peek(global_, "all")).remaining == 0
        used = [10 - (await limiter.peek(per_user, f"u{i}")).remaining for i in range(4)]
        assert sum(used) == 25
    finally:
        await client.aclose()
