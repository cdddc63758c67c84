"""The benchmark harness: one command, tables on stdout, JSON + chart + docs block written.

    python benchmarks/run.py --setup               # install the peers, uvloop, httptools, wrk
    python benchmarks/run.py --out DIR             # everything (~8 minutes on 2 cores)
    python benchmarks/run.py --quick               # a short, noisy smoke run (about a minute)
    python benchmarks/run.py --quick --only core,redis_time   # a few seconds
    python benchmarks/run.py --only core,memory    # some sections; merged into the JSON
    python benchmarks/run.py --profile asgi        # where the ASGI admitted path spends time

Sections: ``core`` (per-check latency beside PING and the limits library), ``redis_time``
(time inside Redis per check, beside limits), ``capacity`` (fleet capacity per Redis core:
checks/s one Redis sustains under N client processes), ``asgi`` (Starlette/FastAPI under
uvicorn on uvloop + httptools beside slowapi and a one-EVALSHA floor), ``wsgi`` (Flask under
gunicorn beside Flask-Limiter and the floor), ``memory`` (Redis bytes per identity).
docs/performance.md says what each figure means and the targets.

Everything runs against a private redis-server started on a free loopback port and stopped
at the end (``--redis-url`` uses a running server instead for core and the HTTP sections;
redis_time, capacity and memory always start a private one: they read its counters, load
it to saturation or flush it). Servers are subprocesses on free ports, always stopped. The
harness installs nothing unless ``--setup`` is given: it reports what is missing and how to
install it, and records what ran.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import report
from _util import (
    BENCH_DIR,
    REPO,
    environment,
    importable,
    load_average,
    log,
    private_redis,
    wrk_source,
)
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
    parser.add_argument("--setup", action="store_true",
                        help="first install what the harness uses: pip install -r "
                             "benchmarks/requirements.txt (peers, uvloop, httptools, "
                             "gunicorn, matplotlib) into this interpreter, and wrk and "
                             "redis-server with apt-get when they are missing and apt-get "
                             "is there")
    parser.add_argument("--quick", action="store_true",
                        help="short runs (about a minute for every section, a few seconds "
                             "for core,redis_time), to check the harness; noisy")
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
                        help="interleaved rounds per section (default 4 core, redis_time and "
                             "HTTP, 3 capacity; --quick 1)")
    parser.add_argument("--checks", type=int, default=None,
                        help="checks per configuration per round of core and redis_time "
                             "(default 2000 and 1000; quick 200)")
    parser.add_argument("--processes", type=int, default=None,
                        help="capacity: client processes (default: one per CPU, here "
                             f"{capacity_default_processes()})")
    parser.add_argument("--in-flight", type=int, default=32,
                        help="capacity: checks in flight per client process (default 32)")
    parser.add_argument("--capacity-duration", type=float, default=None,
                        help="capacity: seconds measured per configuration and round "
                             "(default 1; quick 0.5)")
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
    args.rounds_core = args.rounds or (1 if quick else 4)
    args.rounds_http = args.rounds or (1 if quick else 4)
    args.rounds_capacity = args.rounds or (1 if quick else 3)
    args.checks_redis_time = args.checks or (200 if quick else 1000)
    args.checks = args.checks or (200 if quick else 2000)
    args.processes = args.processes or capacity_default_processes()
    args.capacity_duration = args.capacity_duration or (0.5 if quick else 1.0)
    args.duration = args.duration or (1.0 if quick else 2.0)
    args.warmup = 0.3 if quick else 1.0
    args.identities = args.identities or (2000 if quick else 10_000)
    args.profile_requests = args.profile_requests or (1000 if quick else 5000)
    if args.out is None:
        args.out = BENCH_DIR / "results-quick" if quick else REPO / "docs"
    return args


def capacity_default_processes() -> int:
    import capacity

    return capacity.default_processes()


def _setup() -> int:
    """Install what the harness uses into this interpreter (and wrk, redis-server)."""
    requirements = BENCH_DIR / "requirements.txt"
    argv = [sys.executable, "-m", "pip", "install", "-r", str(requirements)]
    log("setup: " + " ".join(argv))
    status = subprocess.run(argv, check=False).returncode
    if status != 0:
        return status
    missing = [tool for tool in ("wrk", "redis-server") if shutil.which(tool) is None]
    if missing:
        if shutil.which("apt-get") is None:
            log(f"setup: {', '.join(missing)} missing and no apt-get: install them with "
                f"your package manager")
        else:
            log(f"setup: apt-get install -y {' '.join(missing)}")
            status = subprocess.run(["apt-get", "install", "-y", *missing],
                                    check=False).returncode
            if status != 0:
                log("setup: apt-get failed (run `apt-get update` first, or as root)")
    log(f"setup: wrk: {wrk_source()}")
    return 0


def _check_tools(args: argparse.Namespace) -> None:
    missing = [(dist, effect) for module, (dist, effect) in OPTIONAL.items()
               if importable(module) is not None]
    for dist, effect in missing:
        log(f"not installed: {dist} — {effect}")
    if missing:
        log("install them with: pip install -r benchmarks/requirements.txt")
    if any(s in args.sections for s in ("asgi", "wsgi")):
        if args.builtin_load:
            log("load generator: the built-in Python one (--builtin-load)")
        elif shutil.which("wrk") is None:
            log("load generator: wrk " + wrk_source() + "; it caps the bare app and pulls "
                "every ratio towards 1")
        else:
            log(f"load generator: wrk at {wrk_source()}")


@contextlib.contextmanager
def _redis(url: str | None) -> Iterator[tuple[str, bool]]:
    if url:
        yield url, False
        return
    with private_redis() as private:
        yield private, True


def _stamp(section: dict[str, Any], quick: bool, started: float,
           load_before: list[float] | None) -> dict[str, Any]:
    seconds = time.monotonic() - started
    section["run"] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "quick": quick,
                      "seconds": round(seconds, 1), "load_average_before": load_before,
                      "load_average_after": load_average()}
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


def _private_sections(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """The sections that need a redis-server of their own, each on a new one."""
    wanted = [name for name in ("redis_time", "capacity", "memory") if name in args.sections]
    if not wanted:
        return
    if shutil.which("redis-server") is None:
        log(f"{', '.join(wanted)}: skipped, they need a private redis-server (apt-get "
            f"install -y redis-server)")
        return
    if "redis_time" in wanted:
        import redis_time

        log("redis_time: time inside Redis per check (INFO commandstats)")
        t0, before = time.monotonic(), load_average()
        with private_redis() as url:
            results["redis_time"] = _stamp(redis_time.run(
                url, rounds=args.rounds_core, n=args.checks_redis_time), args.quick, t0,
                before)
    if "capacity" in wanted:
        import capacity

        log("capacity: checks/s one Redis sustains, per Redis core")
        t0, before = time.monotonic(), load_average()
        with private_redis() as url:
            results["capacity"] = _stamp(capacity.run(
                url, processes=args.processes, concurrency=args.in_flight,
                rounds=args.rounds_capacity, duration=args.capacity_duration,
                warmup=args.warmup / 2), args.quick, t0, before)
    if "memory" in wanted:
        import memory_usage

        log("memory: bytes per identity")
        t0, before = time.monotonic(), load_average()
        with private_redis(*memory_usage.SERVER_ARGS) as url:
            results["memory"] = _stamp(memory_usage.run(url, identities=args.identities),
                                       args.quick, t0, before)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    if args.setup:
        status = _setup()
        if status != 0:
            return status
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
            t0, before = time.monotonic(), load_average()
            results["core"] = _stamp(core_latency.run(
                url, rounds=args.rounds_core, n=args.checks, shared_server=not private),
                args.quick, t0, before)
        for stack in ("asgi", "wsgi"):
            if stack in args.sections:
                import http_bench

                log(f"{stack}: throughput and latency under load")
                t0, before = time.monotonic(), load_average()
                results[stack] = _stamp(http_bench.run(
                    stack, redis_url=url, load=load, rounds=args.rounds_http,
                    warmup=args.warmup, gunicorn_workers=args.gunicorn_workers,
                    private_redis=private), args.quick, t0, before)
    _private_sections(args, results)
    results["environment"]["load_average_at_end"] = load_average()
    markdown = report.render(results)
    print(markdown)
    report.save(json_path, results)
    log(f"wrote {json_path}")
    for name, why in report.charts(results, args.out).items():
        log(f"wrote {args.out / name}" if why is None else f"no {name}: {why}")
        if why is None:
            markdown += f"\n![{report.CHART_TITLES[name]}]({name})\n"
    doc = args.out / "performance.md"
    if report.update_doc(doc, markdown):
        log(f"updated the results block of {doc}")
    log(f"done in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
