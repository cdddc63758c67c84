"""Shared plumbing for the benchmark harness: ports, child processes, a private Redis, stats.

Every process the harness starts is a child in its own session (so a server's workers go
with it) and is stopped in a ``finally``: nothing outlives a run, even on Ctrl-C.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
APPS_DIR = BENCH_DIR / "apps"


def log(message: str) -> None:
    """Progress goes to stderr, so that stdout carries only the tables."""
    print(message, file=sys.stderr, flush=True)


# -- statistics ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spread:
    """Median and range of one figure over the rounds of a run."""

    median: float
    lo: float
    hi: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise ValueError("no values")
        return cls(statistics.median(values), min(values), max(values), len(values))

    def as_dict(self) -> dict[str, float]:
        return {"median": self.median, "min": self.lo, "max": self.hi, "n": self.n}


def spread_dict(values: Sequence[float]) -> dict[str, float] | None:
    return Spread.of(values).as_dict() if values else None


def fmt(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "—"
    return f"{value:,.{digits}f}"


def fmt_spread(d: dict[str, float] | None, digits: int = 1, suffix: str = "") -> str:
    """``median (min–max)``; the range is left out when there was one round only."""
    if not d:
        return "—"
    text = f"{d['median']:,.{digits}f}{suffix}"
    if d.get("n", 1) > 1:
        text += f" ({d['min']:,.{digits}f}–{d['max']:,.{digits}f})"
    return text


def rotated(items: Sequence[Any], shift: int) -> list[Any]:
    """The round-robin order of round `shift`: each item takes every position in turn, so
    a drift in machine load spreads over all configurations instead of hitting one."""
    if not items:
        return []
    k = shift % len(items)
    return [*items[k:], *items[:k]]


# -- ports and processes ------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_open(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
        return True
    return False


class Child:
    """A child process in its own session, its output in a temporary file, always stopped."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None,
                 cwd: Path | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        # Lives as long as the child and is closed by stop(), not by a with-block.
        self._out = tempfile.TemporaryFile(mode="w+b")  # noqa: SIM115
        self.proc = subprocess.Popen(
            self.argv, stdout=self._out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, cwd=cwd, start_new_session=True,
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def output(self, limit: int = 4000) -> str:
        if self._out.closed:
            return ""
        self._out.flush()
        self._out.seek(0)
        data = self._out.read()
        return data[-limit:].decode(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            # The whole session this child leads (gunicorn's workers too), and nothing else.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        else:
            # The leader is gone; its workers (same process group) may not be.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self._out.close()


# -- a private Redis ----------------------------------------------------------------------------
@contextlib.contextmanager
def private_redis(*extra: str) -> Iterator[str]:
    """A redis-server of our own on a free loopback port (nothing saved), stopped on exit.

    The shared server at 6379 carries other test runs: its ``used_memory`` and
    ``INFO commandstats`` would count their traffic as ours.
    """
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not on PATH (apt-get install -y redis-server), or "
                           "pass --redis-url to use a running server")
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="rl-bench-redis-")
    child = Child("redis-server", [
        binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--dir", workdir, "--protected-mode", "no", *extra,
    ])
    try:
        deadline = time.monotonic() + 10
        while not port_open(port):
            if not child.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"private redis-server did not start:\n{child.output()}")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        child.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def delete_prefix(url: str, prefix: str) -> int:
    """Remove what a run wrote under `prefix` (SCAN, off the hot path) on a shared server."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        removed = 0
        batch: list[bytes] = []
        for key in client.scan_iter(match=f"{prefix}*", count=1000):
            batch.append(key)
            if len(batch) >= 500:
                removed += int(client.unlink(*batch))
                batch.clear()
        if batch:
            removed += int(client.unlink(*batch))
        return removed
    finally:
        client.close()


# -- environment --------------------------------------------------------------------------------
def importable(module: str) -> str | None:
    """None if `module` imports, else why not (one line)."""
    try:
        importlib.import_module(module)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def wrk_version() -> str | None:
    binary = shutil.which("wrk")
    if binary is None:
        return None
    proc = subprocess.run([binary, "-v"], capture_output=True, text=True, check=False)
    first = (proc.stdout or proc.stderr).strip().splitlines()
    return first[0] if first else "wrk"


def git_revision() -> str | None:
    try:
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain",
                                "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return rev + ("+dirty" if dirty else "")


def cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or None


def load_average() -> list[float] | None:
    """1, 5 and 15-minute load averages: what else ran on the machine (noise record)."""
    with contextlib.suppress(OSError, AttributeError):
        return [round(x, 2) for x in os.getloadavg()]
    return None


def wrk_source() -> str:
    """How the harness gets wrk, in words for the log and the results."""
    binary = shutil.which("wrk")
    if binary is None:
        return ("not installed: the built-in Python load generator runs instead (install wrk "
                "with `apt-get install -y wrk`, or `python benchmarks/run.py --setup`)")
    return f"{binary} ({wrk_version()}), found on PATH"


def environment(redis_url: str) -> dict[str, Any]:
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        server = client.info("server")
    finally:
        client.close()
    packages = ["redis", "hiredis", "starlette", "fastapi", "uvicorn", "uvloop", "httptools",
                "gunicorn", "flask", "werkzeug", "slowapi", "flask-limiter", "limits",
                "matplotlib", "pyinstrument"]
    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "load_average_at_start": load_average(),
        "redis_server": server.get("redis_version"),
        "packages": {name: version(name) for name in packages},
        "wrk": wrk_version(),
        "wrk_source": wrk_source(),
        "revision": git_revision(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }


def child_env(**extra: str) -> dict[str, str]:
    """The harness's environment for a server child, with the repository importable."""
    env = dict(os.environ)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + path if path else "")
    env.update(extra)
    return env


# -- time inside Redis --------------------------------------------------------------------------
# A script's usec in INFO commandstats includes the commands it calls, which Redis counts
# again under their own names: summing every line would count them twice.
SCRIPT_COMMANDS = frozenset({"eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro"})


def command_stats(client: Any) -> dict[str, tuple[int, int]]:
    """command -> (calls, usec) from INFO commandstats, the harness's own INFO left out."""
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
            for name, v in stats.items() if name != "cmdstat_info"}


def command_delta(before: dict[str, tuple[int, int]],
                  after: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """The commands run between two readings: name -> (calls, usec)."""
    delta = {}
    for name, (calls, usec) in after.items():
        c0, u0 = before.get(name, (0, 0))
        if calls > c0:
            delta[name] = (calls - c0, usec - u0)
    return delta


def top_level_usec(delta: dict[str, tuple[int, int]]) -> int:
    """The usec of the commands the clients sent. When scripts ran, only the script calls
    count (each one's usec holds the commands it called): the workloads measured here send
    either script calls only (ratelimit_mw, limits) or plain commands only (INCR+PEXPIRE)."""
    scripts = [usec for name, (_c, usec) in delta.items() if name in SCRIPT_COMMANDS]
    if scripts:
        return sum(scripts)
    return sum(usec for _c, usec in delta.values())
