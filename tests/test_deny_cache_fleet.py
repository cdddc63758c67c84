"""An unban reaches every worker of a fleet within the deny cache's age bound.

Real processes, the real Redis, real time (kept short: a 0.2 s bound). Each worker holds the
ban of an identity in its deny cache (answering its hits without a backend call); an operator
resets the identity (the unban of a one-hour penalty); every worker must admit the identity
within the bound, not when the hour is over.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

import ratelimit_mw as rl
from tests._deny_cache_worker import POLICY
from tests.conftest import REDIS_URL, keys_under

pytestmark = pytest.mark.slow

WORKERS = 4
MAX_AGE = 0.2
# Polling every 2 ms and a shared 2-core machine: scheduling may add this much on top.
SLACK = 0.3


def test_an_unban_is_honoured_by_every_worker_within_the_age_bound(
    redis_client: redis.Redis, prefix: str
) -> None:
    operator = rl.Limiter(rl.RedisBackend.from_url(REDIS_URL), prefix=prefix, deny_cache=0)
    for _ in range(10):
        assert operator.hit(POLICY, "victim").allowed
    assert operator.hit(POLICY, "victim").banned
    root = Path(__file__).resolve().parent.parent
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "tests._deny_cache_worker", REDIS_URL, prefix, str(MAX_AGE)],
            cwd=root, stdout=subprocess.PIPE, text=True,
        )
        for _ in range(WORKERS)
    ]
    try:
        for worker in workers:
            assert worker.stdout is not None
            assert worker.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # the ban is held in every cache, refreshed from the store twice
        unbanned_at = time.time()
        operator.reset(POLICY, "victim")
        reports = []
        for worker in workers:
            assert worker.stdout is not None
            reports.append(json.loads(worker.stdout.readline()))
            assert worker.wait(timeout=10) == 0
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
        keys = keys_under(redis_client, prefix)
        if keys:
            redis_client.delete(*keys)
    delays = [report["admitted_at"] - unbanned_at for report in reports]
    assert all(delay <= MAX_AGE + SLACK for delay in delays), delays
    # While banned, the caches answered: a backend call per age bound, not one per hit.
    for report in reports:
        assert report["hits"] > 3 * report["calls"], report
