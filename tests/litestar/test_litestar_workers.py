"""Litestar under uvicorn with 4 worker processes on one Redis: a burst of 200 at once admits
exactly the limit through ratelimit_mw, and a per-handler limit holds across the workers.
Litestar's own ``RateLimitConfig`` on a Redis store shared by the same workers serves the same
burst in the same run: it reads the history and writes it back under a per-process lock, so
the workers race (litestar #4700); what it admits is reported, not asserted."""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from reliability._support import SHARED_REDIS_URL, AppServer
from support import free_port

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
BURST = 200
CLIENTS = 8  # httpx clients sharing a burst, each with its own connection pool
WORKERS = 4


def litestar_server(prefix: str, which: str) -> AppServer:
    port = free_port()
    return AppServer(
        [sys.executable, "-m", "uvicorn", "_litestar_served:make_app", "--factory",
         "--app-dir", str(HERE), "--host", "127.0.0.1", "--port", str(port),
         "--workers", str(WORKERS), "--log-level", "warning", "--no-access-log"],
        {"RL_REDIS_URL": SHARED_REDIS_URL, "RL_PREFIX": prefix, "RL_LIMITER": which}, port)


@pytest.fixture
def served(prefix: str, redis_client: redis.Redis) -> Iterator[dict[str, AppServer]]:
    """Both servers at once, each with its own prefix on the one Redis."""
    servers = {which: litestar_server(f"{prefix}-{which}", which)
               for which in ("ratelimit_mw", "litestar")}
    try:
        yield servers
    finally:
        for server in servers.values():
            server.stop()
        for key in redis_client.scan_iter(f"{prefix}*"):
            redis_client.delete(key)


async def burst(base_url: str, path: str, count: int) -> list[httpx.Response]:
    clients = [httpx.AsyncClient(base_url=base_url, timeout=30) for _ in range(CLIENTS)]
    try:
        # Every connection opened first: the burst then arrives at once, over all workers.
        await asyncio.gather(*(client.get("/healthz") for client in clients for _ in range(4)))
        return await asyncio.gather(*(clients[i % CLIENTS].get(path) for i in range(count)))
    finally:
        await asyncio.gather(*(client.aclose() for client in clients))


async def test_a_burst_over_four_workers_admits_exactly_the_limit(
        served: dict[str, AppServer], record_property: pytest.RecordProperty) -> None:
    from _litestar_served import BURST_LIMIT, HANDLER_LIMIT

    ours = await burst(served["ratelimit_mw"].base_url, "/burst", BURST)
    theirs = await burst(served["litestar"].base_url, "/burst", BURST)
    handler = await burst(served["ratelimit_mw"].base_url, "/handler", BURST)

    admitted = Counter(r.status_code for r in ours)
    their_admitted = Counter(r.status_code for r in theirs)[200]
    record_property("litestar_own_admitted", their_admitted)
    print(f"\nburst of {BURST} at {BURST_LIMIT}/minute over {WORKERS} uvicorn workers: "
          f"ratelimit_mw admitted {admitted[200]}, Litestar's RateLimitConfig admitted "
          f"{their_admitted}")
    assert admitted == {200: BURST_LIMIT, 429: BURST - BURST_LIMIT}
    pids = {json.loads(r.content)["pid"] for r in ours if r.status_code == 200}
    assert len(pids) > 1, "the burst reached one worker only"
    assert Counter(r.status_code for r in handler) == {200: HANDLER_LIMIT,
                                                       429: BURST - HANDLER_LIMIT}
    assert {r.status_code for r in theirs} <= {200, 429}
