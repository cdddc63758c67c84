"""Event-loop CPU per check on the async Redis backends: single node and cluster.

In process, no HTTP: an ``AsyncLimiter`` on ``AsyncRedisBackend.from_url`` runs admitted
checks two ways — one after another (the latency a lone request pays) and 1000 at once
(``asyncio.gather``, what a burst of concurrent requests on one worker does, where
pipelining and write coalescing pay off). Figures are µs per check, wall-clock and this
process's CPU (``time.process_time``: the event loop's cost, which the Redis server's own
work and the neighbours' load leave out), each the best of several rounds (the machine is
shared; the minimum is the least disturbed round). A private
redis-server and a private 3-master cluster are started on free loopback ports and stopped
at the end.

    python benchmarks/async_backends.py [--rounds 5] [--checks 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import uuid
from pathlib import Path

from _util import BENCH_DIR, log, private_redis

import ratelimit_mw as rl
from ratelimit_mw.core import codec

sys.path.insert(0, str(BENCH_DIR.parent / "tests"))
from cluster import LocalCluster  # tests/cluster.py: the tests' own cluster

# Far above anything a round sends: every check is admitted, keys expire within a minute.
POLICY = rl.Policy("100000000/minute", algorithm="fixed-window", name="bench")
IDENTITIES = [f"user:{i}" for i in range(64)]


async def measure(url: str, rounds: int, checks: int, burst: int) -> dict[str, float]:
    backend = rl.AsyncRedisBackend.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    limiter = rl.AsyncLimiter(backend, prefix="b" + uuid.uuid4().hex[:10], deny_cache=0)
    for identity in IDENTITIES:  # connected, script loaded, slot map known
        await limiter.hit(POLICY, identity)
    sequential, concurrent, failed = [], [], 0
    sequential_cpu, concurrent_cpu, backend_cpu = [], [], []
    calls = [codec.build(codec.HIT, [rl.Check(POLICY, identity)], limiter.prefix)
             for identity in IDENTITIES]
    batches = max(1, checks // burst)
    for _ in range(rounds):
        start, cpu = time.perf_counter(), time.process_time()
        for i in range(checks):
            await limiter.hit(POLICY, IDENTITIES[i & 63])
        sequential.append((time.perf_counter() - start) / checks * 1e6)
        sequential_cpu.append((time.process_time() - cpu) / checks * 1e6)
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(batches):
            decisions = await asyncio.gather(*(limiter.hit(POLICY, IDENTITIES[i & 63])
                                               for i in range(burst)), return_exceptions=True)
            failed += sum(isinstance(d, rl.BackendError) for d in decisions)
            if not all(d for d in decisions if not isinstance(d, rl.BackendError)):
                raise RuntimeError("a check was refused: the benchmark's limit is too low")
        concurrent.append((time.perf_counter() - start) / (batches * burst) * 1e6)
        concurrent_cpu.append((time.process_time() - cpu) / (batches * burst) * 1e6)
        # The backend alone: prebuilt calls straight to arun, no limiter around them.
        cpu = time.process_time()
        for _ in range(batches):
            await asyncio.gather(*(backend.arun(calls[i & 63]) for i in range(burst)),
                                 return_exceptions=True)
        backend_cpu.append((time.process_time() - cpu) / (batches * burst) * 1e6)
    await backend.aclose()
    return {"sequential": min(sequential), "concurrent": min(concurrent),
            "sequential_cpu": min(sequential_cpu), "concurrent_cpu": min(concurrent_cpu),
            "backend_cpu": min(backend_cpu), "failed": failed / rounds / (batches * burst)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--checks", type=int, default=2000)
    parser.add_argument("--burst", type=int, default=1000)
    options = parser.parse_args()
    results: dict[str, dict[str, float]] = {}
    with private_redis() as url:
        log(f"single node at {url}")
        results["single node"] = asyncio.run(measure(url, options.rounds, options.checks,
                                                     options.burst))
    with tempfile.TemporaryDirectory() as folder:
        cluster = LocalCluster(Path(folder) / "cluster")
        try:
            cluster.start()
            log(f"cluster at {cluster.url}")
            results["cluster (3 primaries)"] = asyncio.run(measure(
                cluster.url, options.rounds, options.checks, options.burst))
        finally:
            cluster.stop()
    print(f"| async backend | sequential µs/check wall (CPU) | {options.burst} concurrent "
          "µs/check wall (CPU) | backend.arun alone, concurrent, CPU µs/call "
          "| concurrent checks failed |")
    print("|---|---|---|---|---|")
    for name, f in results.items():
        print(f"| {name} | {f['sequential']:.1f} ({f['sequential_cpu']:.1f}) "
              f"| {f['concurrent']:.1f} ({f['concurrent_cpu']:.1f}) | {f['backend_cpu']:.1f} "
              f"| {f['failed']:.1%} |")


if __name__ == "__main__":
    main()
