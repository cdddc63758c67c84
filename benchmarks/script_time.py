"""Time inside Redis per check, per algorithm and tier count (INFO commandstats).

Starts a private redis-server on a free loopback port (nothing else counts in its
commandstats), runs admitted hits over a pool of identities through `Limiter` (the
production path: Redis's own TIME, EVALSHA), and reports Redis's usec_per_call of EVALSHA
for each configuration: the median of several rounds, in rotated order.

    python benchmarks/script_time.py [--n 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import redis
from _util import private_redis, rotated

import ratelimit_mw as rl

ALGORITHMS = ("fixed-window", "sliding-log", "sliding-window", "gcra")
TIERS = {1: "1000000/minute", 3: "100000/second;1000000/minute;10000000/hour"}


def _evalsha_usec(client: redis.Redis) -> float:
    stats = client.info("commandstats").get("cmdstat_evalsha")
    return float(stats["usec"]) if stats else 0.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--identities", type=int, default=10_000)
    args = parser.parse_args()
    ids = [f"user{i}" for i in range(args.identities)]
    with private_redis() as url:
        client = redis.Redis.from_url(url)
        limiter = rl.Limiter(rl.RedisBackend(client), prefix="bench", deny_cache=0)
        configs = [(algo, tiers, rl.Policy(TIERS[tiers], algorithm=algo, name=f"{algo}{tiers}"))
                   for algo in ALGORITHMS for tiers in TIERS]
        results: dict[tuple[str, int], list[float]] = {(a, t): [] for a, t, _ in configs}
        for _, _, policy in configs:  # warm up: scripts loaded, keys exist
            for identity in ids:
                limiter.hit(policy, identity)
        for r in range(args.rounds):
            for algo, tiers, policy in rotated(configs, r):
                before = _evalsha_usec(client)
                for k in range(args.n):
                    limiter.hit(policy, ids[k % len(ids)])
                results[(algo, tiers)].append((_evalsha_usec(client) - before) / args.n)
            time.sleep(0.05)
        print(f"{'algorithm':<16}{'tiers':>6}{'us/check (median)':>20}{'min':>8}{'max':>8}")
        for (algo, tiers), values in results.items():
            print(f"{algo:<16}{tiers:>6}{statistics.median(values):>20.2f}"
                  f"{min(values):>8.2f}{max(values):>8.2f}")
        client.close()


if __name__ == "__main__":
    main()
