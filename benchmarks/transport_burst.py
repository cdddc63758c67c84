"""Bursts from outside, per transport: does a healthy Redis admit exactly the limit?

    python benchmarks/transport_burst.py                     # this checkout
    python benchmarks/transport_burst.py --tree /path/old   # another checkout's ratelimit_mw
    python benchmarks/transport_burst.py --out DIR          # also DIR/transport_burst.json

One private redis-server serves a plain port, a TLS port (a self-signed certificate made
here) and a unix socket; one sentinel watches it. For each transport (``redis://``,
``rediss://``, ``unix://``, ``redis+sentinel://``), uvicorn (1 worker, uvloop + httptools)
serves apps/burst_app.py at the library's defaults, and BURSTS bursts of 400 requests over
200 connections hit one identity at 100/minute: loop free, then with 12 requests among them
that each hold the worker's loop for 150 ms. With ``on_backend_error="allow"`` the figure is
the admitted count (100 is exact; more is the failure policy letting requests through); with
``"deny"`` it is the count of 503s (0 is right on a healthy Redis). ``in process``: the same
app driven in this process by httpx's ASGI transport, 400 requests at once (no server
between: every request reaches the limiter in the same loop iteration). ``conns`` is how many
connections the server accepted while one worker served its eight bursts (INFO stats
``total_connections_received``, the probe's own excluded): with a pool per burst, each TLS
one a handshake.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _util import BENCH_DIR, Child, child_env, free_port, log, port_open

REQUESTS, CONNECTIONS, BURSTS, BLOCKING = 400, 200, 4, 12


@contextlib.contextmanager
def servers() -> Iterator[dict[str, str]]:
    """The private Redis (plain, TLS, unix) and a sentinel on it: each transport's URL."""
    workdir = Path(tempfile.mkdtemp(prefix="rl-bench-transports-"))
    cert, key, sock = workdir / "cert.pem", workdir / "key.pem", workdir / "redis.sock"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    port, tls_port, sentinel_port = free_port(), free_port(), free_port()
    children = [Child("redis-server", [
        "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
        "--appendonly", "no", "--dir", str(workdir), "--tls-port", str(tls_port),
        "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file",
        str(cert), "--tls-auth-clients", "no", "--unixsocket", str(sock)])]
    try:
        config = workdir / "sentinel.conf"
        config.write_text(f"sentinel monitor bench 127.0.0.1 {port} 1\n")
        children.append(Child("sentinel", ["redis-server", str(config), "--sentinel", "--port",
                                           str(sentinel_port), "--bind", "127.0.0.1"]))
        deadline = time.monotonic() + 15
        while not (port_open(port) and port_open(sentinel_port) and sock.exists()):
            if time.monotonic() > deadline:
                raise RuntimeError("servers did not start:\n" + children[0].output())
            time.sleep(0.05)
        yield {
            "redis://": f"redis://127.0.0.1:{port}/0",
            "rediss://": f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={cert}",
            "unix://": f"unix://{sock}?db=0",
            "redis+sentinel://": f"redis+sentinel://127.0.0.1:{sentinel_port}/bench/0",
        }
    finally:
        for child in reversed(children):
            child.stop()
        shutil.rmtree(workdir, ignore_errors=True)


async def get(port: int, paths: list[tuple[str, str]], go: asyncio.Event,
              ready: list[int]) -> list[int]:
    """The statuses of GETs sent one after another on one keep-alive connection, the first
    when `go` is set (once every connection is open: the burst arrives at once). A plain
    HTTP/1.1 client: httpx's pool spends seconds of CPU per burst of this size."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    ready.append(1)
    await go.wait()
    statuses = []
    try:
        for path, identity in paths:
            writer.write(f"GET {path} HTTP/1.1\r\nHost: bench\r\nx-client: {identity}\r\n\r\n"
                         .encode())
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            length = next(int(line.split(":", 1)[1]) for line in lines
                          if line.lower().startswith("content-length:"))
            await reader.readexactly(length)
            statuses.append(int(lines[0].split(" ")[1]))
    finally:
        writer.close()
    return statuses


async def burst(port: int, blocking: int) -> dict[int, int]:
    """REQUESTS requests of one identity over CONNECTIONS connections, with `blocking`
    /block requests (another identity) among them, one per connection."""
    identity, blocker = uuid.uuid4().hex, uuid.uuid4().hex
    plans: list[list[tuple[str, str]]] = [[] for _ in range(CONNECTIONS)]
    for i in range(REQUESTS):
        plans[i % CONNECTIONS].append(("/burst", identity))
    for i in range(blocking):
        plans[i * (CONNECTIONS // blocking)].insert(0, ("/block", blocker))
    go, ready = asyncio.Event(), []
    clients = asyncio.gather(*(get(port, plan, go, ready) for plan in plans),
                             return_exceptions=True)
    while len(ready) < CONNECTIONS and not clients.done():
        await asyncio.sleep(0.01)
    go.set()
    results = await clients
    counts: dict[int, int] = {}
    for plan, statuses in zip(plans, results, strict=True):
        if isinstance(statuses, BaseException):
            counts[-1] = counts.get(-1, 0) + 1
            continue
        for (path, _), status in zip(plan, statuses, strict=True):
            if path == "/burst":
                counts[status] = counts.get(status, 0) + 1
    return counts


def in_process(url: str, tree: Path, on_error: str) -> dict[int, int]:
    """apps/burst_app.py's in-process burst, in a child process importing `tree`."""
    env = child_env(RL_REDIS_URL=url, RL_PREFIX="bt" + uuid.uuid4().hex[:8],
                    RL_ON_ERROR=on_error)
    env["PYTHONPATH"] = f"{tree}:{BENCH_DIR / 'apps'}:{env['PYTHONPATH']}"
    done = subprocess.run([sys.executable, str(BENCH_DIR / "apps" / "burst_app.py"),
                           str(REQUESTS)], env=env, capture_output=True, text=True,
                          timeout=60, check=True)
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    return {int(status): count for status, count in counts.items()}


def connections(url: str) -> int:
    """The connections the server has accepted so far (this probe's included)."""
    import redis

    probe = redis.Redis.from_url(url)
    try:
        return int(probe.info("stats")["total_connections_received"])
    finally:
        probe.close()


def serve(url: str, tree: Path, on_error: str) -> Child:
    port = free_port()
    env = child_env(RL_REDIS_URL=url, RL_PREFIX="bt" + uuid.uuid4().hex[:8],
                    RL_ON_ERROR=on_error)
    env["PYTHONPATH"] = f"{tree}:{BENCH_DIR / 'apps'}:{env['PYTHONPATH']}"
    child = Child("uvicorn", [sys.executable, "-m", "uvicorn", "burst_app:make_app", "--factory",
                              "--port", str(port), "--workers", "1", "--loop", "uvloop",
                              "--http", "httptools", "--no-access-log", "--log-level",
                              "warning"], env=env)
    deadline = time.monotonic() + 30
    while not port_open(port):
        if not child.alive() or time.monotonic() > deadline:
            child.stop()
            raise RuntimeError("uvicorn did not start:\n" + child.output())
        time.sleep(0.05)
    child.port = port  # type: ignore[attr-defined]
    return child


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=BENCH_DIR.parent,
                        help="the checkout whose ratelimit_mw is measured")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    # A `timeout` or a closed terminal ends the run through its finally blocks: every
    # server it started is stopped.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    results: dict[str, Any] = {"tree": str(args.tree)}
    with servers() as urls:
        for name, url in urls.items():
            for on_error in ("allow", "deny"):
                accepted = connections(urls["redis://"])
                app = serve(url, args.tree, on_error)
                try:
                    row: dict[str, Any] = {}
                    for phase, blocking in (("free", 0), ("busy", BLOCKING)):
                        row[phase] = [asyncio.run(burst(app.port, blocking))  # type: ignore[attr-defined]
                                      for _ in range(BURSTS)]
                    row["connections"] = connections(urls["redis://"]) - accepted - 1
                finally:
                    app.stop()
                row["in process"] = [in_process(url, args.tree, on_error)
                                     for _ in range(BURSTS)]
                results[f"{name} {on_error}"] = row
                figure = 200 if on_error == "allow" else 503
                log(f"{name:20} {on_error:5}  " + "  ".join(
                    f"{phase}: " + ", ".join(str(c.get(figure, 0)) for c in row[phase])
                    for phase in ("free", "busy", "in process"))
                    + f"  conns: {row['connections']}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "transport_burst.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
