"""The local deny cache: what a flood from one refused client costs.

    python benchmarks/deny_cache.py [--redis redis://127.0.0.1:6379/0]

For each algorithm, one client already refused sends 1000 more hits: the backend calls they
cost with the cache on and off, and the time per hit of a refusal answered by the cache (and,
for comparison, by the store). Real clock, as in production (the cache counts the store's
answer down with a monotonic clock). The memory store is reached here through a wrapper the
limiter calls (as it calls Redis); last, the same flood on a plain ``Limiter(MemoryBackend())``,
where the store's typed hit decides every refusal itself and no cache stands before it.
"""

from __future__ import annotations

import argparse
import timeit
import uuid
from typing import Any

import redis

from ratelimit_mw import ALGORITHMS, Limiter, MemoryBackend, Policy, RedisBackend

FLOOD = 1000


class Counting:
    """Counts the calls that reach the backend."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.is_cluster = False
        self.calls = 0

    def run(self, call: Any, deadline: float | None = None) -> list[int]:
        self.calls += 1
        return self.inner.run(call, deadline)  # type: ignore[no-any-return]


def flood(backend: Any, algorithm: str, deny_cache: int) -> tuple[int, float]:
    """Backend calls for FLOOD hits of a refused client, and µs per hit (best of 5 runs)."""
    counting = Counting(backend)
    limiter = Limiter(counting, prefix="b" + uuid.uuid4().hex[:8],  # type: ignore[arg-type]
                      deny_cache=deny_cache)
    policy = Policy("5/hour", algorithm=algorithm)
    for _ in range(6):
        limiter.hit(policy, "flooder")
    counting.calls = 0
    for _ in range(FLOOD):
        assert not limiter.hit(policy, "flooder").allowed
    calls = counting.calls
    runs = timeit.repeat(lambda: limiter.hit(policy, "flooder"), number=FLOOD, repeat=5)
    return calls, min(runs) / FLOOD * 1e6


def in_process(algorithm: str, clients: int) -> float:
    """µs per refused hit (best of 5 runs) where the memory store decides it in process,
    the refused `clients` taking turns."""
    limiter = Limiter(MemoryBackend())  # the library's defaults: the deny cache stands aside
    policy = Policy("5/hour", algorithm=algorithm)
    names = [f"flooder{i}" for i in range(clients)]
    for name in names:
        for _ in range(6):
            limiter.hit(policy, name)
    turn = iter(range(1 << 62))

    def refused() -> None:
        if limiter.hit(policy, names[next(turn) % clients]).allowed:
            raise AssertionError("a flooder was admitted")

    runs = timeit.repeat(refused, number=FLOOD, repeat=5)
    return min(runs) / FLOOD * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args()
    client = redis.Redis.from_url(args.redis)
    backends = {"memory": MemoryBackend(), "redis": RedisBackend(client)}
    print(f"| backend | algorithm | calls per {FLOOD} refused hits, cache on / off "
          "| µs per refused hit, cache on / off |")
    print("|---|---|---|---|")
    for name, backend in backends.items():
        for algorithm in sorted(ALGORITHMS):
            on_calls, on_us = flood(backend, algorithm, 10_000)
            off_calls, off_us = flood(backend, algorithm, 0)
            print(f"| {name} | {algorithm} | {on_calls} / {off_calls} "
                  f"| {on_us:.2f} / {off_us:.2f} |")
    print("\n| algorithm | µs per refused hit, `Limiter(MemoryBackend())` (in process): "
          "1 / 1000 refused clients |")
    print("|---|---|")
    for algorithm in sorted(ALGORITHMS):
        print(f"| {algorithm} | {in_process(algorithm, 1):.2f} / "
              f"{in_process(algorithm, 1000):.2f} |")
    for key in client.scan_iter(match="b*:{flooder}:*", count=1000):
        client.delete(key)


if __name__ == "__main__":
    main()
