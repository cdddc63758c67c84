"""Proof of in-flight limits across a fleet: 4 uvicorn workers and 4 gunicorn workers (gthread,
so that a worker runs many requests at once and the limit, not the server, is what binds) on
the real Redis, serving `reliability._in_flight_served`, whose endpoints record how many of
their own calls run at once.

- a burst of 10 x N requests at one client: never more than N at once, and every slot free
  again once the responses have ended;
- clients that leave streams half way and requests that raise: every slot free again within a
  second, long before a lease could have ended;
- a worker SIGKILLed while it holds slots: they come back when their lease ends, not before.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
import redis
from support import free_port

from reliability._in_flight_served import probe_keys
from reliability._support import SHARED_REDIS_URL, AppServer, Figures

pytestmark = pytest.mark.slow

SLOTS = 3
LEASE = 3.0  # seconds: short, so that a killed worker's slots come back within the test
CLIENT = {"x-client": "exporter"}


class Fleet:
    def __init__(self, name: str, server: AppServer, prefix: str) -> None:
        self.name = name
        self.server = server
        self.prefix = prefix
        self.redis = redis.Redis.from_url(SHARED_REDIS_URL)

    def most_at_once(self) -> int:
        return int(self.redis.get(probe_keys(self.prefix)[1]) or 0)

    def reset_probe(self) -> None:
        self.redis.delete(*probe_keys(self.prefix))

    def slots_held(self) -> int:
        """Live members of the client's in-flight key (the store's own view of its slots)."""
        now_ms = int(time.time() * 1000)  # the store's clock (same host)
        return sum(int(self.redis.zcount(key, f"({now_ms}", "+inf"))
                   for key in self.redis.scan_iter(f"{self.prefix}:*")
                   if key.endswith(b".cc"))


def _server(stack: str, env: dict[str, str]) -> AppServer:
    port = free_port()
    if stack == "uvicorn":
        argv = [sys.executable, "-m", "uvicorn", "reliability._in_flight_served:make_asgi_app",
                "--factory", "--host", "127.0.0.1", "--port", str(port), "--workers", "4",
                "--log-level", "critical", "--no-access-log"]
    else:
        argv = [sys.executable, "-m", "gunicorn", "reliability._in_flight_served:make_wsgi_app()",
                "--bind", f"127.0.0.1:{port}", "--workers", "4", "--worker-class", "gthread",
                "--threads", "16", "--log-level", "critical"]
    return AppServer(argv, env, port)


@pytest.fixture(scope="module", params=["uvicorn", "gunicorn"])
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    prefix = "tinf" + uuid.uuid4().hex[:10]
    env = {"RL_REDIS_URL": SHARED_REDIS_URL, "RL_PREFIX": prefix, "RL_SLOTS": str(SLOTS),
           "RL_LEASE": str(LEASE)}
    made = Fleet(str(request.param), _server(str(request.param), env), prefix)
    try:
        yield made
    finally:
        made.server.stop()
        for key in made.redis.scan_iter(f"{prefix}:*"):
            made.redis.delete(key)
        made.redis.close()


async def _burst(base_url: str, path: str, count: int) -> list[int]:
    async with httpx.AsyncClient(base_url=base_url, timeout=30,
                                 limits=httpx.Limits(max_connections=count)) as client:
        replies = await asyncio.gather(*(client.get(path, headers=CLIENT) for _ in range(count)))
    return [reply.status_code for reply in replies]


def _wait_until_free(fleet: Fleet, within: float) -> float:
    """Seconds until the store holds no slot of the client (polled); fails after `within`."""
    started = time.monotonic()
    while fleet.slots_held():
        assert time.monotonic() - started < within, f"{fleet.slots_held()} slots still held"
        time.sleep(0.02)
    return time.monotonic() - started


def test_a_burst_of_ten_times_n_never_runs_more_than_n_at_once(fleet: Fleet,
                                                               figures: Figures) -> None:
    fleet.reset_probe()
    statuses = Counter(asyncio.run(_burst(fleet.server.base_url, "/work?ms=300",
                                          10 * SLOTS)))
    assert set(statuses) <= {200, 429}
    most = fleet.most_at_once()
    assert 1 <= most <= SLOTS
    assert _wait_until_free(fleet, 1.0) < 1.0
    # Every slot free: N at once are all admitted again.
    again = asyncio.run(_burst(fleet.server.base_url, "/work?ms=300", SLOTS))
    assert again == [200] * SLOTS
    figures.record(f"in_flight.{fleet.name}.burst", {
        "slots": SLOTS, "burst": 10 * SLOTS, "admitted": statuses[200],
        "refused": statuses[429], "most_at_once": most})


def test_streams_left_half_way_and_errors_give_their_slots_back(fleet: Fleet,
                                                                figures: Figures) -> None:
    async def leave_half_way() -> None:
        async with httpx.AsyncClient(base_url=fleet.server.base_url, timeout=30) as client, \
                client.stream("GET", "/stream?chunks=2000&ms=5", headers=CLIENT) as reply:
            assert reply.status_code == 200
            async for _ in reply.aiter_bytes():
                break  # read one chunk, then go away

    async def leave() -> None:
        await asyncio.gather(*(leave_half_way() for _ in range(SLOTS)))

    fleet.reset_probe()
    left = time.monotonic()
    asyncio.run(leave())
    # Given back as the server sees each client go: long before a lease would end.
    after_leaving = _wait_until_free(fleet, LEASE / 3) + time.monotonic() - left
    assert asyncio.run(_burst(fleet.server.base_url, "/boom", SLOTS)) == [500] * SLOTS
    after_errors = _wait_until_free(fleet, LEASE / 3)
    assert fleet.most_at_once() <= SLOTS
    assert asyncio.run(_burst(fleet.server.base_url, "/work?ms=300", SLOTS)) == [200] * SLOTS
    figures.record(f"in_flight.{fleet.name}.slots_free_s", {
        "after_clients_left_streams": round(after_leaving, 3),
        "after_errors": round(after_errors, 3)})


def test_a_killed_workers_slots_come_back_after_the_lease_not_before(
        fleet: Fleet, figures: Figures) -> None:
    pids_key = probe_keys(fleet.prefix)[2]
    fleet.redis.delete(pids_key)

    def poll() -> int:
        return httpx.get(fleet.server.base_url + "/work?ms=1", headers=CLIENT,
                         timeout=10).status_code

    holders = subprocess.Popen([sys.executable, "-c", _HOLDERS, fleet.server.base_url,
                                str(SLOTS)])
    try:
        deadline = time.monotonic() + 10
        while fleet.redis.llen(pids_key) < SLOTS:
            assert time.monotonic() < deadline, "the holders never started"
            time.sleep(0.01)
        pids = {int(pid) for pid in fleet.redis.lrange(pids_key, 0, -1)}
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        assert poll() == 429
        first_admitted = None
        while first_admitted is None:
            if poll() == 200:
                first_admitted = time.monotonic() - killed
            else:
                assert time.monotonic() - killed < LEASE + 2, "the slots never came back"
                time.sleep(0.05)
    finally:
        holders.kill()
        holders.wait()
    # Held until their lease ran out (renewed up to the kill under asyncio): not before a
    # third of it had passed, and within the lease plus the polling.
    assert LEASE / 3 <= first_admitted <= LEASE + 1.5
    figures.record(f"in_flight.{fleet.name}.killed_worker", {
        "workers_killed": len(pids), "lease_s": LEASE,
        "slots_back_after_s": round(first_admitted, 3)})
    _wait_until_free(fleet, LEASE + 1)


# The holders run apart: a test process that waited on them would be the one to time out.
_HOLDERS = """
import sys, httpx, threading
url, count = sys.argv[1], int(sys.argv[2])
def hold():
    try:
        httpx.get(url + "/hang", headers={"x-client": "exporter"}, timeout=70)
    except httpx.HTTPError:
        pass
threads = [threading.Thread(target=hold) for _ in range(count)]
for t in threads: t.start()
for t in threads: t.join()
"""
