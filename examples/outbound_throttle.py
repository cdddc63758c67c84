"""Outbound throttling: "every worker together stays under a payment provider's 100 calls/second".

Each worker sends its calls through ``RateLimitTransport``, which waits on
``limiter.acquire`` (with a little jitter) before each request. Limiters that share one Redis
share the quota, so the whole fleet — threads, processes, machines — stays under the
provider's limit. ``key="payments"`` puts every call under one identity; leave it out to
throttle per host. ``AsyncRateLimitTransport`` does the same for ``httpx.AsyncClient``.

    pip install 'ratelimit_mw[httpx]'
    python examples/outbound_throttle.py                # threads of one process, in memory
    RATELIMIT_REDIS_URL=redis://localhost:6379/0 python examples/outbound_throttle.py  # twice

The "provider" here is an ``httpx.MockTransport`` that records when each call arrives.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import httpx

import ratelimit_mw as rl
from ratelimit_mw.httpx import RateLimitTransport

PROVIDER_LIMIT = rl.Policy("100/second", name="payments-api")


class Provider:
    """A stand-in for the payment provider: it answers 200 and notes each call's time."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.calls: list[float] = []
        self._lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        with self._lock:
            self.calls.append(self.clock())
        return httpx.Response(200, json={"status": "charged"})

    def busiest_second(self) -> int:
        """The most calls that arrived within any one second."""
        times = sorted(self.calls)
        best, lo = 0, 0
        for hi, t in enumerate(times):
            while times[lo] <= t - 1.0:
                lo += 1
            best = max(best, hi - lo + 1)
        return best


def make_client(limiter: rl.Limiter, provider: httpx.BaseTransport,
                policy: rl.Policy = PROVIDER_LIMIT) -> httpx.Client:
    transport = RateLimitTransport(limiter, policy, key="payments", timeout=30,
                                   wrapped=provider)
    return httpx.Client(transport=transport, base_url="https://api.payments.example")


def worker(client: httpx.Client, charges: int) -> None:
    for n in range(charges):
        response = client.post("/v1/charges", json={"amount": 100 + n})
        response.raise_for_status()


def make_limiter() -> rl.Limiter:
    url = os.environ.get("RATELIMIT_REDIS_URL")
    return rl.Limiter(rl.RedisBackend.from_url(url)) if url else rl.Limiter()


def main(workers: int = 4, charges: int = 60) -> None:
    limiter = make_limiter()
    provider = Provider()
    with make_client(limiter, httpx.MockTransport(provider)) as client:
        threads = [threading.Thread(target=worker, args=(client, charges))
                   for _ in range(workers)]
        started = time.time()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    print(f"{len(provider.calls)} calls in {time.time() - started:.2f} s; "
          f"the provider's busiest second saw {provider.busiest_second()} (limit 100)")


if __name__ == "__main__":
    main()
