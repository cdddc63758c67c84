"""A/B of the in-process path: `Limiter.hit` on `MemoryBackend`, this tree against a revision.

Every algorithm × 1 and 3 tiers, the harness's `memory, returning` shape (core_latency.py):
a pool of identities each hit once before timing, far-off limits, ``deny_cache=0``. Each side
runs in a process of its own, importing its own tree (the base from a temporary
``git worktree``); the sides alternate, so a drift in machine load reaches both. A round
reports each configuration's best of several batches; the table gives, per configuration,
both sides' best and median over the rounds, and the median of the per-round ratios.

On a shared 2-vCPU VM batches vary by ±20 %: read the ratios, not single figures.

    python benchmarks/memory_ab.py [--base HEAD] [--rounds 6]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALGORITHMS = ("fixed-window", "sliding-log", "sliding-window", "gcra")
TIERS = {1: "1000000/minute", 3: "100000/second;1000000/minute;10000000/hour"}
POOL = 1_000
BATCHES = 15  # per configuration per round; a round keeps the best


def measure() -> dict[str, float]:
    """One round on the tree this process imports: µs per hit, best of BATCHES."""
    from ratelimit_mw import Limiter, MemoryBackend, Policy

    limiter = Limiter(MemoryBackend(), prefix="ab", deny_cache=0)
    ids = [f"user:{i}" for i in range(POOL)]
    out: dict[str, float] = {}
    for algorithm in ALGORITHMS:
        for tiers, rates in TIERS.items():
            policy = Policy(rates, algorithm=algorithm, name=f"{algorithm}-{tiers}")
            hit = limiter.hit
            for identity in ids:  # every identity returning
                hit(policy, identity)

            def batch(hit=hit, policy=policy) -> None:  # type: ignore[no-untyped-def]
                for identity in ids:
                    hit(policy, identity)

            best = min(timeit.repeat(batch, number=2, repeat=BATCHES))
            out[f"{algorithm} ×{tiers}"] = best / (2 * POOL) * 1e6
    return out


def run_side(tree: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, __file__, "--worker"], env=env, check=True,
                          capture_output=True, text=True, cwd=tempfile.gettempdir())
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", default="HEAD", help="git revision of the A side")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure()))
        return
    with tempfile.TemporaryDirectory() as scratch:
        base = Path(scratch) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.base], cwd=ROOT,
                       check=True, capture_output=True)
        try:
            sides: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
            for r in range(args.rounds):
                order = (("A", base), ("B", ROOT)) if r % 2 == 0 else (("B", ROOT), ("A", base))
                for name, tree in order:
                    sides[name].append(run_side(tree))
                print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT,
                           check=False, capture_output=True)
    print(f"A = {args.base}, B = this tree; µs per hit: best, median over {args.rounds} rounds")
    print("| check | A best | B best | A median | B median | B/A (median of rounds) |")
    print("|---|---:|---:|---:|---:|---:|")
    for label in sides["A"][0]:
        a = [side[label] for side in sides["A"]]
        b = [side[label] for side in sides["B"]]
        ratio = statistics.median(y / x for x, y in zip(a, b, strict=True))
        print(f"| {label} | {min(a):.2f} | {min(b):.2f} | {statistics.median(a):.2f} | "
              f"{statistics.median(b):.2f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
