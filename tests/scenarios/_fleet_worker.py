"""One member of the fleet in test_fleet.py, run as its own process.

    python _fleet_worker.py <redis url> <prefix> <sync|async> <seconds>

It prints "ready", waits for a line on stdin (so every worker starts together), calls
`acquire` until its time is up (three asyncio tasks in async mode), and prints one JSON list of
[before, after] wall-clock spans, one per admitted call.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import ratelimit_mw as rl

RATE = 20
# The hour tier never binds (a run admits ~30 calls); it keeps the whole run in the log.
POLICY = rl.Policy(f"{RATE}/second;100000/hour", name="provider")


def run_sync(url: str, prefix: str, seconds: float) -> list[tuple[float, float]]:
    limiter = rl.Limiter(rl.RedisBackend.from_url(url), prefix=prefix)
    stop = time.time() + seconds
    spans = []
    while True:
        before = time.time()
        try:
            limiter.acquire(POLICY, "payments", timeout=max(0.0, stop - before))
        except rl.RateLimitExceeded:
            return spans
        spans.append((before, time.time()))


async def run_async(url: str, prefix: str, seconds: float) -> list[tuple[float, float]]:
    backend = rl.AsyncRedisBackend.from_url(url)
    limiter = rl.AsyncLimiter(backend, prefix=prefix)
    stop = time.time() + seconds
    spans: list[tuple[float, float]] = []

    async def task() -> None:
        while True:
            before = time.time()
            try:
                await limiter.acquire(POLICY, "payments", timeout=max(0.0, stop - before))
            except rl.RateLimitExceeded:
                return
            spans.append((before, time.time()))

    await asyncio.gather(task(), task(), task())
    await backend.aclose()
    return spans


def main() -> None:
    url, prefix, mode, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    print("ready", flush=True)
    sys.stdin.readline()
    if mode == "async":
        spans = asyncio.run(run_async(url, prefix, seconds))
    else:
        spans = run_sync(url, prefix, seconds)
    print(json.dumps(spans), flush=True)


if __name__ == "__main__":
    main()
