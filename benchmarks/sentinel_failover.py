"""Counts across a Sentinel failover: how many requests over the limit does it let through?

    python benchmarks/sentinel_failover.py [--tree /path/old] [--out DIR]

A private primary, replica and three sentinels (tests/sentinel.py); uvicorn with 4 workers
(uvloop + httptools) serves apps/burst_app.py on ``redis+sentinel://`` at library defaults
but fail-closed (``on_backend_error="deny"``), ``20/minute`` per ``X-Client``. 150 clients,
one keep-alive connection each, send a request every 400 ms for 12 s; ``SENTINEL FAILOVER``
is asked at 4 s. Within a run shorter than the window at most 150 x 20 = 3,000 may be
admitted. Reported: admitted, over the bound (and per identity at most), 503s, and when the
new primary took its first script call after its promotion (``INFO commandstats`` polled).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(BENCH_DIR.parent / "tests"))

from _util import Child, child_env, free_port, log, port_open  # noqa: E402
from sentinel import LocalSentinel  # noqa: E402

# A request every 0.4 s: each identity is still being admitted when the failover comes (its
# 20th admission falls at about 8 s), so counts written where they are lost show.
CLIENTS, LIMIT, EVERY, DURATION, FAILOVER_AT, WORKERS = 150, 20, 0.4, 12.0, 4.0, 4


async def client(port: int, identity: str, stop: float, tally: Counter[int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = f"GET /f HTTP/1.1\r\nHost: bench\r\nx-client: {identity}\r\n\r\n".encode()
    try:
        while time.monotonic() < stop:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            length = next(int(line.split(":", 1)[1]) for line in lines
                          if line.lower().startswith("content-length:"))
            await reader.readexactly(length)
            tally[int(lines[0].split(" ")[1])] += 1
            await asyncio.sleep(EVERY)
    finally:
        writer.close()


def script_calls(port: int) -> int:
    import redis

    probe = redis.Redis(port=port, socket_timeout=1)
    try:
        stats = probe.info("commandstats")
        return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))
    except redis.RedisError:
        return -1
    finally:
        probe.close()


def role(port: int) -> str:
    import redis

    probe = redis.Redis(port=port, socket_timeout=1)
    try:
        return str(probe.info("replication")["role"])
    except redis.RedisError:
        return "?"
    finally:
        probe.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=BENCH_DIR.parent)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    # A `timeout` or a closed terminal ends the run through its finally blocks: every
    # server it started is stopped.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    sentinel = LocalSentinel(Path(tempfile.mkdtemp(prefix="rl-bench-sentinel-")))
    sentinel.start()
    port = free_port()
    env = child_env(RL_REDIS_URL=sentinel.url, RL_PREFIX="bf" + uuid.uuid4().hex[:8],
                    RL_ON_ERROR="deny", RL_LIMIT=str(LIMIT))
    env["PYTHONPATH"] = f"{args.tree}:{BENCH_DIR / 'apps'}:{env['PYTHONPATH']}"
    app = Child("uvicorn", [sys.executable, "-m", "uvicorn", "burst_app:make_app", "--factory",
                            "--port", str(port), "--workers", str(WORKERS), "--loop", "uvloop",
                            "--http", "httptools", "--no-access-log", "--log-level",
                            "warning"], env=env)
    timeline: dict[str, float] = {}
    try:
        deadline = time.monotonic() + 30
        while not port_open(port):
            if not app.alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start:\n" + app.output())
            time.sleep(0.05)
        time.sleep(1.0)  # every worker through its start-up check
        old = sentinel.primary()
        new = sentinel.replica_port if old == sentinel.primary_port else sentinel.primary_port
        start = time.monotonic()

        def watch() -> None:
            before = script_calls(new)
            time.sleep(FAILOVER_AT)
            threading.Thread(target=sentinel.failover, daemon=True).start()
            while time.monotonic() - start < DURATION + 2:
                now = time.monotonic() - start
                if "promoted" not in timeline and role(new) == "master":
                    timeline["promoted"] = now
                if "promoted" in timeline and "first_call" not in timeline \
                        and script_calls(new) > before:
                    timeline["first_call"] = now
                if "demoted" not in timeline and role(old) == "slave":
                    timeline["demoted"] = now
                time.sleep(0.02)

        watcher = threading.Thread(target=watch)
        watcher.start()
        tallies = [Counter[int]() for _ in range(CLIENTS)]

        async def load() -> None:
            stop = time.monotonic() + DURATION
            await asyncio.gather(*(client(port, f"c{i}-{uuid.uuid4().hex[:6]}", stop, t)
                                   for i, t in enumerate(tallies)))

        asyncio.run(load())
        watcher.join()
    finally:
        app.stop()
        sentinel.stop()
    admitted = [t[200] for t in tallies]
    result: dict[str, Any] = {
        "tree": str(args.tree),
        "admitted": sum(admitted),
        "bound": CLIENTS * LIMIT,
        "over": max(0, sum(admitted) - CLIENTS * LIMIT),
        "most_for_one_identity": max(admitted),
        "identities_over": sum(a > LIMIT for a in admitted),
        "503": sum(t[503] for t in tallies),
        "requests": sum(sum(t.values()) for t in tallies),
        "timeline_s": {k: round(v, 2) for k, v in timeline.items()},
    }
    log(json.dumps(result))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sentinel_failover.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
