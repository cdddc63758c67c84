"""A/B of the Lua script: time inside Redis per check, one version of lua/ against another.

Both versions are loaded into one private redis-server; for every algorithm × 1 and 3 tiers
the same admitted hits (the production call shape: Redis's own TIME, one identity of a pool
per call) run in alternating batches through each version, under its own key prefix, and the
``usec`` of ``cmdstat_evalsha`` is read around every batch. Alternating batches on one server
see the same machine noise, so the ratio of the medians is what the change is worth.
Reference rows show the floors: an EVALSHA of a script that only returns, with the same
KEYS/ARGV, and one that also reads TIME.

    python benchmarks/lua_ab.py [--base HEAD] [--n 2000] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import redis
from _util import private_redis, rotated

from ratelimit_mw import Policy
from ratelimit_mw.core import codec, scripts

ALGORITHMS = ("fixed-window", "sliding-log", "sliding-window", "gcra")
TIERS = {1: "1000000/minute", 3: "100000/second;1000000/minute;10000000/hour"}
IDENTITIES = 5_000
FLOORS = {
    "empty": "return {1}",
    "TIME": "local t = redis.call('TIME') return {1}",
}


def source_at(rev: str) -> str:
    """The joined script as it was at git revision `rev` (joined as scripts.source() does)."""
    root = Path(__file__).resolve().parent.parent
    texts = {
        name: subprocess.run(["git", "show", f"{rev}:lua/{name}"], cwd=root, check=True,
                             capture_output=True, text=True).stdout
        for name in (*scripts.ALGORITHM_FILES, scripts.ENTRY_FILE)
    }
    entry = texts.pop(scripts.ENTRY_FILE)
    # main.lua's --@inline lines are written out from the algorithm files (a no-op before).
    entry = scripts.inline(entry, {name.removesuffix(".lua"): text
                                   for name, text in texts.items()})
    return "\n".join([*texts.values(), entry])


def evalsha_usec(client: redis.Redis) -> int:
    stats = client.info("commandstats").get("cmdstat_evalsha")
    return int(stats["usec"]) if stats else 0


PIPELINE = 1  # calls per round trip: 1 as in production and redis_time (caches go cold
#              between calls, which is most of a script's cost); more is faster to run


def batch(client: redis.Redis, sha: str, calls: list[codec.ScriptCall], start: int,
          n: int) -> float:
    """n calls, PIPELINE per round trip; Redis's usec of EVALSHA per call."""
    before = evalsha_usec(client)
    k = len(calls)
    for first in range(start, start + n, PIPELINE):
        pipe = client.pipeline(transaction=False)
        for i in range(first, min(first + PIPELINE, start + n)):
            call = calls[i % k]
            pipe.evalsha(sha, len(call.keys), *call.keys, *call.args)
        for reply in pipe.execute():
            if reply[0] != 1:
                raise RuntimeError(f"an admitted-path check was refused: {reply}")
    return (evalsha_usec(client) - before) / n


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", default="HEAD", help="git revision of the A side")
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--only", default="", help="comma-separated algorithms")
    parser.add_argument("--pipeline", type=int, default=1, help="calls per round trip")
    args = parser.parse_args()
    global PIPELINE
    PIPELINE = args.pipeline
    variants = {"A": source_at(args.base), "B": scripts.source(), **FLOORS}
    algorithms = [a for a in ALGORITHMS if not args.only or a in args.only.split(",")]
    with private_redis() as url:
        client = redis.Redis.from_url(url)
        shas = {name: client.script_load(text) for name, text in variants.items()}
        rows = []
        for algorithm in algorithms:
            for tiers, rates in TIERS.items():
                policy = Policy(rates, algorithm=algorithm, name=f"{algorithm}-{tiers}")
                calls = {
                    name: [codec.build("H", [codec.Check(policy, f"u{i}")], f"ab{name}")
                           for i in range(IDENTITIES)]
                    for name in variants
                }
                for name in variants:
                    batch(client, shas[name], calls[name], 0, 200)  # warm-up
                usec: dict[str, list[float]] = {name: [] for name in variants}
                cursor = 200
                for r in range(args.rounds):
                    for name in rotated(list(variants), r):
                        usec[name].append(batch(client, shas[name], calls[name], cursor,
                                                args.n))
                    cursor += args.n
                med = {name: statistics.median(v) for name, v in usec.items()}
                ratios = [b / a for a, b in zip(usec["A"], usec["B"], strict=True)]
                rows.append((algorithm, tiers, med, statistics.median(ratios)))
                print(f"{algorithm:15} {tiers}  A {med['A']:6.2f}  B {med['B']:6.2f}  "
                      f"B/A {statistics.median(ratios):.3f}  (A {min(usec['A']):.2f}-"
                      f"{max(usec['A']):.2f}, B {min(usec['B']):.2f}-{max(usec['B']):.2f})  "
                      f"empty {med['empty']:.2f}  TIME {med['TIME']:.2f}", flush=True)
        client.close()


if __name__ == "__main__":
    main()
