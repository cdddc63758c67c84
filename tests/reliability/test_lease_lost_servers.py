"""A uvicorn worker paused past its lease, then resumed (issue 43, item 6), on the real Redis.

Two single-process uvicorn servers serve `reliability._in_flight_served` (N = 3, a 1.5 s
lease, ``on_lease_lost="end"``), whose endpoints count in Redis how many of their calls run
at once. Server A streams 3 long responses to one client; A is SIGSTOPped past the lease;
server B then admits 3 streams of the same client (the store freed A's slots): 6 run, 3 of
them without a slot. When A resumes (SIGCONT), its streams' next renewal finds their slots
taken and ends them: the count is back to N within a second, and A's clients see their
responses cut off. At efbcb84 A's streams ran on to their end (6 at once for seconds,
unreported).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
import redis
from support import free_port

from reliability._in_flight_served import probe_keys
from reliability._support import SHARED_REDIS_URL, AppServer, Figures

pytestmark = pytest.mark.slow

SLOTS, LEASE = 3, 1.5
CLIENT = {"x-client": "exporter"}
STREAM = "/stream?chunks=400&ms=20"  # about 8 s: runs through the pause and after it


def _uvicorn(env: dict[str, str]) -> AppServer:
    port = free_port()
    return AppServer([sys.executable, "-m", "uvicorn",
                      "reliability._in_flight_served:make_asgi_app", "--factory", "--host",
                      "127.0.0.1", "--port", str(port), "--log-level", "critical",
                      "--no-access-log"], env, port)


class Streams:
    """`count` streams read to their end in threads: how each ended ("whole" or "cut")."""

    def __init__(self, base_url: str, count: int) -> None:
        self.ended: list[str] = []
        self.threads = [threading.Thread(target=self._read, args=(base_url,), daemon=True)
                        for _ in range(count)]
        for thread in self.threads:
            thread.start()

    def _read(self, base_url: str) -> None:
        try:
            with httpx.stream("GET", base_url + STREAM, headers=CLIENT, timeout=30) as reply:
                assert reply.status_code == 200
                size = sum(len(chunk) for chunk in reply.iter_bytes())
            self.ended.append("whole" if size == 400 * 1024 else "cut")
        except httpx.HTTPError:
            self.ended.append("cut")

    def join(self, within: float) -> None:
        for thread in self.threads:
            thread.join(timeout=within)


@pytest.fixture
def fleet() -> Iterator[tuple[AppServer, AppServer, redis.Redis, str]]:
    prefix = "tlost" + uuid.uuid4().hex[:10]
    env = {"RL_REDIS_URL": SHARED_REDIS_URL, "RL_PREFIX": prefix, "RL_SLOTS": str(SLOTS),
           "RL_LEASE": str(LEASE), "RL_ON_LEASE_LOST": "end"}
    probe = redis.Redis.from_url(SHARED_REDIS_URL)
    first = _uvicorn(env)
    try:
        second = _uvicorn(env)
    except BaseException:
        first.stop()
        raise
    try:
        yield first, second, probe, prefix
    finally:
        os.kill(first.proc.pid, signal.SIGCONT)
        first.stop()
        second.stop()
        for key in probe.scan_iter(f"{prefix}:*"):
            probe.delete(key)
        probe.close()


def _until(condition: object, within: float) -> float:
    started = time.monotonic()
    while not condition():  # type: ignore[operator]
        assert time.monotonic() - started < within, "not within the bound"
        time.sleep(0.01)
    return time.monotonic() - started


def test_a_worker_paused_past_its_lease_ends_its_lost_streams_when_it_resumes(
    fleet: tuple[AppServer, AppServer, redis.Redis, str], figures: Figures,
) -> None:
    paused, other, probe, prefix = fleet
    running_key = probe_keys(prefix)[0]

    def running() -> int:
        return int(probe.get(running_key) or 0)

    held = Streams(paused.base_url, SLOTS)
    _until(lambda: running() == SLOTS, 10)
    os.kill(paused.proc.pid, signal.SIGSTOP)
    time.sleep(LEASE + 0.3)  # the store frees the paused holders' slots
    takers = Streams(other.base_url, SLOTS)
    _until(lambda: running() == 2 * SLOTS, 10)  # 3 without a slot (paused), 3 with
    os.kill(paused.proc.pid, signal.SIGCONT)
    back_to_n = _until(lambda: running() <= SLOTS, 2.0)
    held.join(10)
    assert held.ended == ["cut"] * SLOTS
    takers.join(15)
    assert takers.ended == ["whole"] * SLOTS
    figures.record("in_flight.uvicorn.paused_past_lease", {
        "slots": SLOTS, "lease_s": LEASE, "at_once_during_pause": 2 * SLOTS,
        "seconds_after_resume_until_n": round(back_to_n, 3)})
