"""One worker of test_deny_cache_fleet.py, run as its own process.

    python -m tests._deny_cache_worker <redis url> <prefix> <max age seconds>

It hits a banned identity until its deny cache holds the ban (a refusal answered without a
backend call), prints "ready", keeps hitting every 2 ms, and when a hit is admitted (the ban
was lifted elsewhere) prints one JSON object: when it was admitted (wall clock), and how many
hits and backend calls it made between "ready" and then.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import ratelimit_mw as rl

POLICY = rl.Policy("10/hour", algorithm="fixed-window", penalty="1 hour", name="login")


class Counting:
    """A Redis backend that counts the calls reaching it (capabilities are the wrapped one's)."""


    def __init__(self, inner: rl.RedisBackend) -> None:
        self.inner = inner
        self.is_cluster = inner.is_cluster
        self.calls = 0

    def run(self, call: Any, deadline: float | None = None) -> list[int]:
        self.calls += 1
        return self.inner.run(call)


def main(url: str, prefix: str, max_age: float) -> None:
    backend = Counting(rl.RedisBackend.from_url(url))
    limiter = rl.Limiter(backend, prefix=prefix, deny_cache_max_age=max_age)  # type: ignore[arg-type]
    while True:
        before = backend.calls
        decision = limiter.hit(POLICY, "victim")
        if decision.allowed:
            raise SystemExit("the identity was not banned")
        if decision.banned and backend.calls == before:
            break
        time.sleep(0.002)
    print("ready", flush=True)
    calls, hits = backend.calls, 0
    while True:
        hits += 1
        if limiter.hit(POLICY, "victim").allowed:
            admitted = time.time()
            break
        time.sleep(0.002)
    print(json.dumps({"admitted_at": admitted, "hits": hits,
                      "calls": backend.calls - calls}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
