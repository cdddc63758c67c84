"""The examples under a real uvicorn server, on the real Redis, driven over HTTP by httpx."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support import REDIS_URL, free_port

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def start_server(module: str, prefix: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "RATELIMIT_REDIS_URL": REDIS_URL, "RATELIMIT_PREFIX": prefix,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                       os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", f"{module}:app", "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1", "--log-level", "warning"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    return process, f"http://127.0.0.1:{port}"


def wait_until_up(process: subprocess.Popen[bytes], base: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            output = process.stdout.read().decode() if process.stdout else ""
            pytest.fail(f"uvicorn exited with {process.returncode}:\n{output}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    pytest.fail("uvicorn did not answer within 30 s")


@pytest.fixture(params=["examples.fastapi_app", "examples.starlette_app"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    prefix = "srv" + uuid.uuid4().hex[:12]
    process, base = start_server(request.param, prefix)
    try:
        wait_until_up(process, base)
        yield base, prefix
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout:
            process.stdout.close()


def test_a_real_server_admits_exactly_the_limit_then_refuses(server, redis_client):
    base, prefix = server
    with httpx.Client(base_url=base, timeout=5) as client:
        admitted = [client.get("/search", params={"q": "x"}) for _ in range(5)]
        refused = [client.get("/search") for _ in range(2)]
        health = [client.get("/health").status_code for _ in range(8)]

    assert [r.status_code for r in admitted] == [200] * 5
    assert [r.headers["ratelimit"].split(";r=")[1].split(";")[0] for r in admitted] == \
        ["4", "3", "2", "1", "0"]
    assert all(r.headers["ratelimit-policy"] == '"minute";q=5;w=60' for r in admitted)
    for response in refused:
        assert response.status_code == 429
        assert 1 <= int(response.headers["retry-after"]) <= 60
        assert response.headers["cache-control"] == "no-store"
        assert response.json()["retry_after"] == int(response.headers["retry-after"])
    assert health == [200] * 8  # exempt
    keys = list(redis_client.scan_iter(match=f"{prefix}:*"))
    assert keys, "the counters live in the real Redis under the test's prefix"
    assert all(0 < redis_client.pttl(key) <= 60_000 for key in keys)
