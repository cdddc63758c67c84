"""The benchmark harness: one command, tables on stdout, JSON + chart + docs block written.

    python benchmarks/run.py                       # everything (~6-8 minutes)
    python benchmarks/run.py --quick               # a short, noisy smoke run (< 1 minute)
    python benchmarks/run.py --only core,memory    # some sections; merged into the JSON
    python benchmarks/run.py --profile asgi        # where the ASGI admitted path spends time

Sections: ``core`` (per-check latency beside PING and the limits library), ``asgi``
(Starlette/FastAPI under uvicorn beside slowapi and a one-EVALSHA floor), ``wsgi`` (Flask
under gunicorn beside Flask-Limiter and the floor), ``memory`` (Redis bytes per identity).
docs/performance.md says what each figure means and the targets.

Everything runs against a private redis-server started on a free loopback port and stopped
at the end (``--redis-url`` uses a running server instead; the memory section always needs a
private one, as it flushes). Servers are subprocesses on free ports, always stopped. Nothing
is installed by the harness: it reports what is missing and how to install it.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import report
from _util import BENCH_DIR, REPO, environment, importable, log, private_redis, wrk_version
from loadgen import LoadGenerator

# module -> (distribution, what goes without it)
OPTIONAL = {
    "limits": ("limits", "the limits rows of the core table"),
    "slowapi": ("slowapi", "the slowapi rows"),
    "flask_limiter": ("Flask-Limiter", "the Flask-Limiter rows"),
    "matplotlib": ("matplotlib", "the chart"),
    "pyinstrument": ("pyinstrument", "--profile falls back to cProfile"),
    "uvloop": ("uvloop", "uvicorn runs on asyncio's loop (recorded in the table)"),
    "httptools": ("httptools", "uvicorn parses HTTP with h11 (recorded in the table)"),
}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/run.py",
        description="ratelimit_mw benchmarks: per-check latency, middleware throughput, "
                    "Redis memory, side by side with the floor and the peers.",
    )
    parser.add_argument("--quick", action="store_true",
                        help="short runs (under a minute), to check the harness; noisy")
    parser.add_argument("--only", action="append", default=None, metavar="SECTIONS",
                        help="comma-separated subset of: " + ",".join(report.SECTIONS))
    parser.add_argument("--out", type=Path, default=None,
                        help="where benchmarks.json and performance.png go (default docs/; "
                             "with --quick benchmarks/results-quick/). If OUT holds "
                             "performance.md, its results block is rewritten.")
    parser.add_argument("--redis-url", default=None,
                        help="use this Redis instead of a private redis-server (flood call "
                             "counts then include any other traffic on it)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds per section (default 7 core, 5 HTTP; --quick 2 and 1)")
    parser.add_argument("--checks", type=int, default=None,
                        help="checks per configuration per round (default 2000; quick 200)")
    parser.add_argument("--duration", type=float, default=None,
                        help="seconds per HTTP load run (default 2; quick 1)")
    parser.add_argument("--connections", type=int, default=16,
                        help="concurrent connections of the load generator (default 16)")
    parser.add_argument("--gunicorn-workers", type=int, default=1,
                        help="gunicorn sync workers (default 1: one core for the app, one "
                             "for wrk and Redis on a 2-core machine)")
    parser.add_argument("--identities", type=int, default=None,
                        help="identities for the used_memory figure (default 10000; quick "
                             "2000)")
    parser.add_argument("--builtin-load", action="store_true",
                        help="use the built-in load generator even when wrk is installed")
    parser.add_argument("--profile", choices=("asgi", "wsgi", "core"), default=None,
                        help="profile the admitted path in process instead of benchmarking")
    parser.add_argument("--profile-backend", choices=("redis", "memory"), default="redis")
    parser.add_argument("--profile-requests", type=int, default=None,
                        help="requests profiled (default 5000; quick 1000)")
    args = parser.parse_args(argv)
    sections: list[str] = []
    for chunk in args.only or [",".join(report.SECTIONS)]:
        for name in chunk.split(","):
            name = name.strip()
            if name not in report.SECTIONS:
                parser.error(f"--only takes {', '.join(report.SECTIONS)}; got {name!r}")
            if name not in sections:
                sections.append(name)
    args.sections = sections
    quick = args.quick
    args.rounds_core = args.rounds or (2 if quick else 7)
    args.rounds_http = args.rounds or (1 if quick else 5)
    args.checks = args.checks or (200 if quick else 2000)
    args.duration = args.duration or (1.0 if quick else 2.0)
    args.warmup = 0.3 if quick else 1.0
    args.identities = args.identities or (2000 if quick else 10_000)
    args.profile_requests = args.profile_requests or (1000 if quick else 5000)
    if args.out is None:
        args.out = BENCH_DIR / "results-quick" if quick else REPO / "docs"
    return args


def _check_tools(args: argparse.Namespace) -> None:
    missing = [(dist, effect) for module, (dist, effect) in OPTIONAL.items()
               if importable(module) is not None]
    for dist, effect in missing:
        log(f"not installed: {dist} — {effect}")
    if missing:
        log("install them with: pip install -r benchmarks/requirements.txt")
    if any(s in args.sections for s in ("asgi", "wsgi")) and not args.builtin_load:
        if wrk_version() is None:
            log("wrk not found: using the built-in Python load generator, which caps the bare "
                "app and pulls every ratio towards 1. Install wrk: apt-get install -y wrk")
        else:
            log(f"load generator: {wrk_version()}")


@contextlib.contextmanager
def _redis(url: str | None) -> Iterator[tuple[str, bool]]:
    if url:
        yield url, False
        return
    with private_redis() as private:
        yield private, True


def _stamp(section: dict[str, Any], quick: bool, started: float) -> dict[str, Any]:
    seconds = time.monotonic() - started
    section["run"] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "quick": quick,
                      "seconds": round(seconds, 1)}
    log(f"  ({seconds:.0f} s)")
    return section


def _profile(args: argparse.Namespace) -> int:
    import profiling

    with _redis(args.redis_url) as (url, _private):
        print(profiling.profile(args.profile, redis_url=url, requests=args.profile_requests,
                                backend=args.profile_backend))
    return 0


def _exit_on_signal(signum: int, _frame: Any) -> None:
    # SystemExit unwinds through every finally: servers and the private Redis are stopped.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    if importable("ratelimit_mw") is not None:
        log(f"ratelimit_mw is not importable: {importable('ratelimit_mw')} "
            f"(pip install -e . from {REPO})")
        return 2
    if args.profile:
        return _profile(args)
    _check_tools(args)
    started = time.monotonic()
    json_path = args.out / "benchmarks.json"
    results = report.load(json_path)
    load = LoadGenerator(args.connections, args.duration, force_builtin=args.builtin_load)
    with _redis(args.redis_url) as (url, private):
        results["environment"] = environment(url)
        if "core" in args.sections:
            import core_latency

            log("core: per-check latency")
            t0 = time.monotonic()
            results["core"] = _stamp(core_latency.run(
                url, rounds=args.rounds_core, n=args.checks, shared_server=not private),
                args.quick, t0)
        for stack in ("asgi", "wsgi"):
            if stack in args.sections:
                import http_bench

                log(f"{stack}: throughput and latency under load")
                t0 = time.monotonic()
                results[stack] = _stamp(http_bench.run(
                    stack, redis_url=url, load=load, rounds=args.rounds_http,
                    warmup=args.warmup, gunicorn_workers=args.gunicorn_workers,
                    private_redis=private), args.quick, t0)
    if "memory" in args.sections:
        import memory_usage

        if shutil.which("redis-server") is None:
            log("memory: skipped, it needs a private redis-server (apt-get install -y "
                "redis-server)")
        else:
            log("memory: bytes per identity")
            t0 = time.monotonic()
            with private_redis(*memory_usage.SERVER_ARGS) as private_url:
                results["memory"] = _stamp(memory_usage.run(
                    private_url, identities=args.identities), args.quick, t0)
    markdown = report.render(results)
    print(markdown)
    report.save(json_path, results)
    log(f"wrote {json_path}")
    why = report.chart(results, args.out / "performance.png")
    log(f"wrote {args.out / 'performance.png'}" if why is None else f"no chart: {why}")
    doc = args.out / "performance.md"
    if why is None:
        markdown += "\n![throughput ratios and per-check latency](performance.png)\n"
    if report.update_doc(doc, markdown):
        log(f"updated the results block of {doc}")
    log(f"done in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
