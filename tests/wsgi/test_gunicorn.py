"""A real server: gunicorn with two sync workers, counting in the real Redis.

The memory backend counts per process; with Redis, two workers share one quota. The server
runs tests/wsgi/gunicorn_app.py on a free loopback port under this test's prefix, and is
always stopped (SIGTERM, then SIGKILL to its process group).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO

import httpx
import pytest
from support import free_port

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
LIMIT = 10
REDIS_URL = os.environ.get("RATELIMIT_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """One server for the module; its counters live under a prefix of their own."""
    prefix = "tg" + uuid.uuid4().hex[:12]
    port = free_port()
    env = dict(os.environ)
    env.update({
        "RATELIMIT_REDIS_URL": REDIS_URL,
        "RATELIMIT_PREFIX": prefix,
        "RATELIMIT_TEST_LIMIT": f"{LIMIT}/minute",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
    })
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "--workers", "2", "--worker-class", "sync",
             "--bind", f"127.0.0.1:{port}", "--chdir", str(HERE), "--graceful-timeout", "2",
             "gunicorn_app:app"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            yield wait_until_serving(proc, f"http://127.0.0.1:{port}", log)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def wait_until_serving(proc: subprocess.Popen[bytes], url: str, log: IO[bytes]) -> str:
    deadline = time.monotonic() + 30
    while True:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"gunicorn exited ({proc.returncode}):\n{log.read().decode()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            log.seek(0)
            pytest.fail(f"gunicorn did not answer in 30 s:\n{log.read().decode()}")
        time.sleep(0.1)


def hammer(url: str, n: int) -> list[httpx.Response]:
    """n requests, six at a time, so that both workers serve some of them."""
    with httpx.Client(timeout=10) as client, ThreadPoolExecutor(6) as pool:
        return list(pool.map(lambda _: client.get(url), range(n)))


@pytest.mark.parametrize("path, guard", [("/", "Flask extension"),
                                         ("/plain", "WSGI middleware")])
def test_two_gunicorn_workers_share_one_quota_in_redis(
    server: str, path: str, guard: str
) -> None:
    responses = hammer(server + path, 3 * LIMIT)
    admitted = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(admitted) == LIMIT
    assert len(refused) == 2 * LIMIT
    assert len({r.headers["X-Worker"] for r in responses}) == 2  # both workers counted
    for response in refused:
        retry_after = int(response.headers["Retry-After"])
        assert 1 <= retry_after <= 60
        assert response.headers["RateLimit"] == f'"minute";r=0;t={retry_after}'
        assert response.headers["RateLimit-Policy"] == f'"minute";q={LIMIT};w=60'
        assert response.headers["Cache-Control"] == "no-store"
        assert json.loads(response.content) == {"detail": "Too Many Requests",
                                                "retry_after": retry_after}
    remaining = sorted(int(r.headers["RateLimit"].split("r=")[1].split(";")[0])
                       for r in admitted)
    assert remaining == list(range(LIMIT))  # every hit counted once, across both workers
