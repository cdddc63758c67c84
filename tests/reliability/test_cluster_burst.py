"""A burst on the cluster at the library's defaults is decided request by request.

uvicorn workers (4 where the machine has the cores, else 2) serve an app built with nothing
but ``AsyncRedisBackend.from_url("redis+cluster://...")`` and the middleware's defaults
(``on_backend_error="allow"``, 100 ms deadline). One client sends 200 requests at once
against 100/minute: exactly 100 must be admitted, each with a Decision — a request the
failure policy lets through unchecked would show as an admission without one. Cold: fresh
workers (the script flushed from every node before they start) whose only preparation is
the documented start-up check in their lifespan. Warm: the same workers again. The same
test runs on the single Redis for comparison. (redis-py's cluster client admitted 200 cold
and 132 warm here: its pool of 100 connections per node raised MaxConnectionsError or
queued past the deadline.)

One deadline missed opens the middleware's breaker for its cool-down, and every request of
the burst after it is admitted unchecked: on a machine starved of CPU by other work, the
100 ms deadline itself can be missed (single node and cluster alike).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
import redis

from reliability._served_defaults import LIMIT
from reliability._support import SHARED_REDIS_URL, AppServer, Figures, free_port

pytestmark = pytest.mark.slow

BURST = 200
WORKERS = 4 if (os.cpu_count() or 1) >= 4 else 2


def primaries(url: str) -> list[int]:
    probe = redis.Redis.from_url(url.replace("+cluster://", "://", 1))
    try:
        return sorted(int(address.rsplit(":", 1)[1])
                      for address, node in probe.cluster("NODES").items()
                      if "master" in node["flags"])
    finally:
        probe.close()


@pytest.fixture(scope="module", params=["cluster", "redis"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[str, AppServer]]:
    """uvicorn on the cluster (cold: the script flushed from every primary) and, for
    comparison, on the single shared Redis (whose script cache is left alone)."""
    if request.param == "cluster":
        url = request.getfixturevalue("redis_cluster_url")
        for port in primaries(url):  # cold: the first calls meet NOSCRIPT
            node = redis.Redis(port=port)
            node.script_flush()
            node.close()
    else:
        url = SHARED_REDIS_URL
    port = free_port()
    app = AppServer(
        [sys.executable, "-m", "uvicorn", "reliability._served_defaults:make_asgi_app",
         "--factory", "--host", "127.0.0.1", "--port", str(port), "--workers", str(WORKERS),
         "--log-level", "warning", "--no-access-log"],
        {"RL_REDIS_URL": url, "RL_PREFIX": "tcb" + uuid.uuid4().hex[:10]},
        port,
    )
    try:
        yield request.param, app
    finally:
        app.stop()


async def burst(base_url: str) -> list[httpx.Response]:
    """BURST requests from one client identity, all in flight at once."""
    identity = uuid.uuid4().hex
    limits = httpx.Limits(max_connections=BURST, max_keepalive_connections=BURST)
    async with httpx.AsyncClient(base_url=base_url, timeout=30, limits=limits) as client:
        return await asyncio.gather(*(client.get("/burst", headers={"x-client": identity})
                                      for _ in range(BURST)))


async def test_a_burst_at_library_defaults_admits_exactly_the_limit_cold_and_warm(
    served: tuple[str, AppServer], figures: Figures,
) -> None:
    store, server = served
    outcomes = {}
    for phase in ("cold", "warm"):  # warm: the same workers, now connected
        responses = await burst(server.base_url)
        admitted = [json.loads(r.content) for r in responses if r.status_code == 200]
        figures.record(f"defaults_burst.{store}.{phase}.admitted_of_limit",
                       f"{len(admitted)}/{LIMIT} (workers: {WORKERS})")
        outcomes[phase] = (Counter(r.status_code for r in responses),
                           sum(not body["decided"] for body in admitted))
    expected = (Counter({200: LIMIT, 429: BURST - LIMIT}), 0)  # 0: none let through unchecked
    if outcomes != {"cold": expected, "warm": expected}:
        # The workers' log says why the breaker opened (a deadline missed, or which error).
        pytest.fail(f"{outcomes}; the workers' log:\n{server.stop()[-4000:]}")
