"""CPU instructions per admitted request, counted: a figure a noisy host does not move.

    python benchmarks/instructions.py                  # this checkout
    python benchmarks/instructions.py --tree /path/old # another checkout's ratelimit_mw

Each case runs in a child process under ``valgrind --tool=cachegrind --cache-sim=no`` twice,
with a short and a long loop of admitted requests (after the same warm-up); the difference
of the two instruction totals over the difference of the loops is the cost of one request,
start-up and warm-up cancelled out. Wall-clock ratios on a shared 2-vCPU VM move by 10-30 %
between rounds; these counts repeat to about 0.3 % (a fixed hash seed). They count
work, not cache misses or stalls: compare them between checkouts, and read the harness for
throughput.

Cases (in process, no server, memory backend, ``1000000/minute`` or larger, all admitted):
Starlette bare, behind the least a limiter does (``starlette-floor``: a dict counter and the
RateLimit fields, benchmarks/profiling.py), and behind ``RateLimitMiddleware`` (fixed-window;
``starlette-inflight``: with an in-flight limit beside it, one request at a time), Flask bare,
behind the same floor as an extension (``flask-floor``) and with the ``RateLimit`` extension,
and ``Limiter.hit`` for each algorithm, 1000 returning identities, of one rate (``hit-``) and of
three (``hit3-``: the store's multi-tier path); an in-flight slot taken and
given back (``slot-alone``), and the same while 1000 other slots of the tier are held
(``slot-among-1000``: a store's work per slot should not grow with the slots held).

Asked by name only (``--only``), as they talk to the Redis at 127.0.0.1:6379 and count this
process's side alone: ``starlette-redis`` and ``starlette-redis-inflight`` (its give-back a
second call; one request at a time, none shares a loop turn's, unless ``--together N``
runs N at a time, as a loaded server does).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
CASES = ["starlette-bare", "starlette-floor", "starlette-memory", "starlette-inflight",
         "flask-bare", "flask-floor", "flask-memory",
         "hit-fixed-window", "hit-sliding-log", "hit-sliding-window", "hit-gcra",
         "hit3-fixed-window", "hit3-sliding-log", "hit3-sliding-window", "hit3-gcra",
         "slot-alone", "slot-among-1000"]
SHORT, LONG = 500, 2500


def _child(case: str, n: int, together: int = 1) -> None:
    """Run `case` for a warm-up and then `n` requests (in the valgrind child); an ASGI case
    `together` requests at a time (one `asyncio.gather`)."""
    sys.path.insert(0, str(BENCH_DIR))
    import profiling

    if case.startswith("slot-"):
        from ratelimit_mw import Limiter, MemoryBackend, Policy
        from ratelimit_mw.core.codec import Check

        limiter = Limiter(MemoryBackend(), deny_cache=0)
        slots = Policy.in_flight(1_000_000, lease=86_400)  # held past the slowest run
        compiled = limiter.compile([(slots, 1)])
        given = (Check(slots, "user", 1),)
        for i in range(1000 if case == "slot-among-1000" else 0):  # held throughout
            limiter.hit_compiled(compiled, ("user",), token=f"held{i}")
        for k in range(n + 200):
            limiter.hit_compiled(compiled, ("user",), token=f"t{k}")
            limiter.give_back_all([(given, f"t{k}", 0)])
        return
    if case.startswith("hit"):
        from ratelimit_mw import Limiter, MemoryBackend, Policy

        shape, algorithm = case.split("-", 1)
        rates = ("100000/second;1000000/minute;10000000/hour" if shape == "hit3"
                 else "1000000/minute")
        policy = Policy(rates, algorithm=algorithm)  # type: ignore[arg-type]
        limiter = Limiter(MemoryBackend(), deny_cache=0)
        identities = [f"user:{i}" for i in range(1000)]
        for identity in identities:
            limiter.hit(policy, identity)
        for k in range(n):
            limiter.hit(policy, identities[k % 1000])
        return
    stack, config = case.split("-", 1)
    if stack == "starlette":
        import asyncio

        apps = profiling._asgi_apps("redis://127.0.0.1:6379/0")
        one = profiling._asgi_runner(apps[config])

        async def run(count: int) -> None:
            if together == 1:  # no gather's task and future around each request
                await one(count)
                return
            full, rest = divmod(count, together)
            for size in [together] * full + [rest] * bool(rest):
                await asyncio.gather(*(one(1) for _ in range(size)))

        loop = asyncio.new_event_loop()
        loop.run_until_complete(run(200))
        loop.run_until_complete(run(n))
        return
    apps = profiling._wsgi_apps("redis://127.0.0.1:6379/0")
    wsgi_run = profiling._wsgi_runner(apps[config])
    wsgi_run(200)
    wsgi_run(n)


def _instructions(tree: Path, case: str, n: int, together: int = 1) -> int:
    # A fixed hash seed: str hashes, and so dict and set layouts, are the same in every run,
    # and the counts repeat to about 0.3 % (a random seed moves them by about 1 %).
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               PYTHONHASHSEED="0")
    done = subprocess.run(
        ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
         sys.executable, __file__, "--child", case, str(n), "--together", str(together)],
        env=env, capture_output=True, text=True, check=True, timeout=600)
    found = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
    if found is None:
        raise RuntimeError(f"no instruction count from valgrind for {case}:\n{done.stderr}")
    return int(found.group(1).replace(",", ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", type=Path, default=BENCH_DIR.parent,
                        help="the checkout whose ratelimit_mw is measured")
    parser.add_argument("--only", default="", help="comma-separated cases")
    parser.add_argument("--together", type=int, default=1,
                        help="ASGI cases: requests run at a time (one gather; a loop turn's "
                             "give-backs then share a call)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.together < 1:
        parser.error("--together takes 1 or more")
    if args.child:
        _child(args.child[0], int(args.child[1]), args.together)
        return 0
    if shutil.which("valgrind") is None:
        print("valgrind is not installed: apt-get install -y valgrind", file=sys.stderr)
        return 2
    cases = [c for c in args.only.split(",") if c] or CASES
    print(f"instructions per request, {args.tree}")
    for case in cases:
        short = _instructions(args.tree, case, SHORT, args.together)
        long = _instructions(args.tree, case, LONG, args.together)
        print(f"{case:22s} {(long - short) / (LONG - SHORT):10,.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
