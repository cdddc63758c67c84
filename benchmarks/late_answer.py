"""What a late or hung Redis costs at middleware defaults: who is admitted, and how.

    python benchmarks/late_answer.py [--tree /path/old] [--runs N]

A private redis-server (SIGSTOPped on cue; the shared 6379 is never touched) and the ASGI
middleware in this process at its defaults (``on_backend_error="allow"``, 100 ms deadline,
1 s cool-down), ``100/minute`` for one client. A request arrives every 2.5 ms for 1 s (400
in all); two faults:

- ``stall``: Redis is stopped for 150 ms at 0.2 s (longer than the deadline, once), then
  runs again: the calls out during the stall come back late;
- ``hung``: Redis is stopped at 0.2 s and stays stopped to the end.

Reported per fault: admitted (by the store, with RateLimit fields, and by the failure
policy), of those admitted by the policy how many had their own call time out (the
limiter's ``backend_error`` event) and how many an open breaker skipped
(``breaker_open``), 429s and the slowest request. ``--tree`` runs another checkout's
``ratelimit_mw`` (e.g. ``git worktree add /tmp/old efbcb84``) for the before figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from typing import Any

REQUESTS, EVERY, LIMIT, FAULT_AT, STALL = 400, 0.0025, 100, 0.2, 0.15


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _Events:
    def __init__(self) -> None:
        self.seen: Counter[str] = Counter()

    def observe(self, event: str, policy: str, seconds: float) -> None:
        self.seen[event] += 1


async def _burst(url: str, pid: int, fault: str) -> dict[str, Any]:
    import httpx
    from starlette.responses import PlainTextResponse

    import ratelimit_mw as rl
    from ratelimit_mw import asgi, keys

    events = _Events()
    prefix = "bench" + uuid.uuid4().hex[:8]
    backend = rl.AsyncRedisBackend.from_url(url)
    limiter = rl.AsyncLimiter(backend, prefix=prefix, metrics=events)
    app = asgi.RateLimitMiddleware(PlainTextResponse("ok"), limiter, default=f"{LIMIT}/minute",
                                   key=keys.header("x-client"))
    transport = httpx.ASGITransport(app=app)
    outcomes: Counter[str] = Counter()
    slowest = 0.0
    async with httpx.AsyncClient(transport=transport, base_url="http://b") as client:
        await limiter.ping()  # connected before the first request
        warm = await client.get("/", headers={"x-client": "warm-" + prefix})
        assert warm.status_code == 200

        async def one() -> None:
            nonlocal slowest
            started = time.perf_counter()
            reply = await client.get("/", headers={"x-client": "one"})
            slowest = max(slowest, time.perf_counter() - started)
            if reply.status_code == 429:
                outcomes["refused"] += 1
            elif "RateLimit" in reply.headers:
                outcomes["admitted_by_store"] += 1
            else:
                outcomes["admitted_by_policy"] += 1

        async def faults() -> None:
            await asyncio.sleep(FAULT_AT)
            os.kill(pid, signal.SIGSTOP)
            if fault == "stall":
                await asyncio.sleep(STALL)
                os.kill(pid, signal.SIGCONT)

        before = Counter(events.seen)
        start = time.perf_counter()
        tasks = [asyncio.ensure_future(faults())]
        for i in range(REQUESTS):
            delay = start + i * EVERY - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one()))
        await asyncio.gather(*tasks)
        os.kill(pid, signal.SIGCONT)
        seen = events.seen - before
    await backend.aclose()
    admitted = outcomes["admitted_by_store"] + outcomes["admitted_by_policy"]
    return {"admitted": admitted, **outcomes, "own_call_failed": seen["backend_error"],
            "skipped_by_open_breaker": seen["breaker_open"],
            "slowest_ms": round(slowest * 1000)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", help="another checkout whose ratelimit_mw to measure")
    parser.add_argument("--runs", type=int, default=3)
    options = parser.parse_args()
    if options.tree:
        sys.path.insert(0, options.tree)
    import ratelimit_mw

    port = _free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--logfile", ""],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results: dict[str, list[dict[str, Any]]] = {"stall": [], "hung": []}
    try:
        time.sleep(0.3)
        for _ in range(options.runs):
            for fault in results:
                results[fault].append(asyncio.run(_burst(f"redis://127.0.0.1:{port}/0",
                                                         server.pid, fault)))
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.kill()
        server.wait()
    print(json.dumps({"tree": os.path.dirname(os.path.dirname(ratelimit_mw.__file__)),
                      "requests": REQUESTS, "limit": LIMIT, "results": results}, indent=1))


if __name__ == "__main__":
    main()
