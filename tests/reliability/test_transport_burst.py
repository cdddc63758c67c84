"""A burst at the library's defaults is decided request by request, on every transport.

uvicorn workers (4 where the machine has the cores, else 2) serve an app built with nothing
but ``AsyncRedisBackend.from_url(url)`` and the middleware's defaults
(``on_backend_error="allow"``, 100 ms deadline), for each transport: TCP, TLS (a certificate
this run makes), a unix socket, the primary that real sentinels name, and the 3-node
cluster; then Valkey 8 as a single node, under Sentinel and as a 3-node cluster. One client
sends 200 requests at once against 100/minute: exactly 100 must be admitted, each with a
Decision — a request the failure policy lets through unchecked would
show as an admission without one. Cold: fresh workers whose only preparation is the
documented start-up check in their lifespan (on the cluster, with the script flushed from
every node first). Warm: the same workers again. Busy: the burst again while 12 requests
each hold a worker's event loop for 150 ms, past the middleware's deadline: a worker whose
loop was busy must not take that for a failing Redis.

Measured on the code before the one connection design (uvicorn, 1 worker): TLS admitted
400 of 100 in every burst, Sentinel 104-249 and 400 with a busy loop, unix 400 with a busy
loop; redis-py's cluster client 200 cold and 132 warm.
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
from transports import TRANSPORTS, transport_url

from reliability._served_defaults import LIMIT
from reliability._support import AppServer, Figures, free_port

pytestmark = pytest.mark.slow

BURST = 200
WORKERS = 4 if (os.cpu_count() or 1) >= 4 else 2


def primaries(url: str) -> list[int]:
    # redis-py reads the node's address from a redis:// URL (valkey+cluster:// too).
    probe = redis.Redis.from_url("redis://" + url.partition("+cluster://")[2])
    try:
        return sorted(int(address.rsplit(":", 1)[1])
                      for address, node in probe.cluster("NODES").items()
                      if "master" in node["flags"])
    finally:
        probe.close()


@pytest.fixture(scope="module", params=TRANSPORTS)
def served(request: pytest.FixtureRequest) -> Iterator[tuple[str, AppServer]]:
    """uvicorn on each transport (on the cluster, cold: the script flushed from every
    primary; the shared Redis's script cache is left alone)."""
    url = transport_url(request, request.param)
    if request.param.endswith("cluster"):
        for port in primaries(url):  # cold: the first calls meet NOSCRIPT
            node = redis.Redis(port=port)
            node.script_flush()
            node.close()
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


async def burst(base_url: str, blocking: int = 0) -> list[httpx.Response]:
    """BURST requests from one client identity, all in flight at once, and `blocking`
    requests to /block (another identity) sent among them."""
    identity, blocker = uuid.uuid4().hex, uuid.uuid4().hex
    size = BURST + blocking
    limits = httpx.Limits(max_connections=size, max_keepalive_connections=size)
    async with httpx.AsyncClient(base_url=base_url, timeout=30, limits=limits) as client:
        blocks = [client.get("/block", headers={"x-client": blocker}) for _ in range(blocking)]
        requests = [client.get("/burst", headers={"x-client": identity}) for _ in range(BURST)]
        # The blocking requests spread through the burst, so that they stall the workers
        # while its calls are in flight.
        step = BURST // max(blocking, 1)
        mixed = [*requests]
        for i, block in enumerate(blocks):
            mixed.insert(i * (step + 1), block)
        responses = await asyncio.gather(*mixed)
    assert all(r.status_code == 200 for r in responses if r.url.path == "/block")
    return [r for r in responses if r.url.path == "/burst"]


async def test_a_burst_at_library_defaults_admits_exactly_the_limit_cold_warm_and_busy(
    served: tuple[str, AppServer], figures: Figures,
) -> None:
    store, server = served
    outcomes = {}
    # warm: the same workers, now connected; busy: with 12 requests holding their loops
    for phase, blocking in (("cold", 0), ("warm", 0), ("busy", 12)):
        responses = await burst(server.base_url, blocking)
        admitted = [json.loads(r.content) for r in responses if r.status_code == 200]
        figures.record(f"defaults_burst.{store}.{phase}.admitted_of_limit",
                       f"{len(admitted)}/{LIMIT} (workers: {WORKERS})")
        outcomes[phase] = (Counter(r.status_code for r in responses),
                           sum(not body["decided"] for body in admitted))
    expected = (Counter({200: LIMIT, 429: BURST - LIMIT}), 0)  # 0: none let through unchecked
    if outcomes != {"cold": expected, "warm": expected, "busy": expected}:
        # The workers' log says why the breaker opened (a deadline missed, or which error).
        pytest.fail(f"{outcomes}; the workers' log:\n{server.stop()[-4000:]}")
