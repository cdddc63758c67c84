"""Helpers for the reliability suite: private Redis servers, app servers, counting backends.

Everything that breaks Redis (stop, restart, pause, out of memory) happens to a PRIVATE
`redis-server` started here on a free loopback port; the shared server on 6379 only ever sees
ordinary traffic under a per-test prefix (and SCRIPT FLUSH, which the library survives).
Every process started here is ended by its own pid.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import httpx
import redis
from support import CountingBackend, MonotonicClock, free_port

# The shared server (tests/conftest.py reads the same variable).
SHARED_REDIS_URL = os.environ.get("RATELIMIT_REDIS_URL", "redis://127.0.0.1:6379/0")
TESTS_DIR = Path(__file__).resolve().parent.parent
FIGURES_FILE = Path(os.environ.get("RATELIMIT_FIGURES_FILE",
                                   "/tmp/ratelimit_mw_reliability_figures.json"))


@contextlib.contextmanager
def refused_port() -> Iterator[int]:
    """A port that refuses connections for as long as the block runs.

    The socket is bound but never listens: the kernel answers every SYN with a RST, and
    nobody else can take the port meanwhile.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


class PrivateRedis:
    """A redis-server of our own on a free loopback port, nothing persisted.

    ``stop()`` is SHUTDOWN NOSAVE (what an operator's restart does); ``start()`` again brings
    it back on the same port, empty. ``kill()`` ends the process by its pid (for a paused
    server, which would not read a SHUTDOWN until the pause ends).
    """

    def __init__(self, *extra: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kwargs: Any) -> redis.Redis:
        kwargs.setdefault("socket_timeout", 2)
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)

    def start(self) -> PrivateRedis:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--daemonize", "no", "--logfile", "",
             *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            probe = self.client(socket_timeout=0.5, socket_connect_timeout=0.5)
            try:
                if probe.ping():
                    return self
            except redis.RedisError as exc:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"private redis-server on {self.port} did not start") from exc
                time.sleep(0.02)
            finally:
                probe.close()

    def stop(self) -> None:
        """SHUTDOWN NOSAVE, then wait for the process to be gone (kill it if it lingers)."""
        if self.proc is None:
            return
        # A raw socket: redis-py would retry the command whose connection the exit closes.
        with contextlib.suppress(OSError), \
                socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
            sock.sendall(b"SHUTDOWN NOSAVE\r\n")
            sock.recv(64)  # returns when the server closes the connection on its way out
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
        self.proc = None

    def kill(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=5)
        self.proc = None

    def fill_memory(self) -> None:
        """Push the server well past its --maxmemory (needs ``--enable-debug-command local``).

        DEBUG POPULATE ignores maxmemory, so the server ends up megabytes over the limit: the
        kilobytes of client buffers that come and go can never bring it back under, and
        every write is refused from here on.
        """
        client = self.client()
        try:
            client.execute_command("DEBUG", "POPULATE", "4096", "filler", "1024")
            try:
                client.set("filler:probe", b"x")
            except redis.exceptions.OutOfMemoryError:
                return
            raise RuntimeError("the private server accepts writes after the fill: is "
                               "--maxmemory set?")
        finally:
            client.close()


# One counting backend (sync and async) and one test clock for every HTTP test.
CountingAsyncBackend = CountingBackend
TestClock = MonotonicClock


# -- app servers in subprocesses ----------------------------------------------------------
class AppServer:
    """uvicorn or gunicorn serving an app of `reliability._served`, in its own process group."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], port: int) -> None:
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            list(argv), env={**os.environ, **env}, cwd=str(TESTS_DIR),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(self.base_url + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = self.stop()
                raise RuntimeError(f"{argv[:3]} did not come up: {err[-2000:]}")
            time.sleep(0.05)

    def stop(self) -> str:
        """End the server and its workers (its own process group); return its stderr."""
        if self.proc.poll() is None:
            # The master stops its own workers; the group is only for stragglers.
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        assert self.proc.stderr is not None
        return self.proc.stderr.read().decode(errors="replace")


def uvicorn_server(env: dict[str, str], workers: int) -> AppServer:
    port = free_port()
    return AppServer(
        [sys.executable, "-m", "uvicorn", "reliability._served:make_asgi_app", "--factory",
         "--host",
         "127.0.0.1", "--port", str(port), "--workers", str(workers), "--log-level",
         "warning", "--no-access-log"],
        env, port,
    )


def gunicorn_server(env: dict[str, str], workers: int) -> AppServer:
    port = free_port()
    return AppServer(
        [sys.executable, "-m", "gunicorn", "reliability._served:make_wsgi_app()", "--bind",
         f"127.0.0.1:{port}", "--workers", str(workers), "--worker-class", "sync",
         "--log-level", "warning"],
        env, port,
    )


# -- figures for the README ------------------------------------------------------------------
class Figures:
    """Measured figures, printed at the end of the run and written as JSON for the docs."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}

    def record(self, name: str, value: Any) -> None:
        self.data[name] = value

    def write(self) -> None:
        if not self.data:
            return
        previous: dict[str, Any] = {}
        with contextlib.suppress(OSError, ValueError):
            previous = json.loads(FIGURES_FILE.read_text())
        previous.update(self.data)
        with contextlib.suppress(OSError):
            FIGURES_FILE.write_text(json.dumps(previous, indent=2, sort_keys=True) + "\n")


def seconds_to_midnight(zone: str) -> float:
    now = time.time()
    today = dt.datetime.fromtimestamp(now, ZoneInfo(zone))
    midnight = (today + dt.timedelta(days=1)).replace(hour=0, minute=0, second=0,
                                                      microsecond=0)
    return midnight.timestamp() - now


def away_from_midnight(*zones: str) -> None:
    """Tests whose windows are days never race across a day's end (UTC and `zones`).

    Weeks aligned to the epoch end at a UTC midnight too.
    """
    for zone in ("UTC", *zones):
        left = seconds_to_midnight(zone)
        if left < 10:
            time.sleep(left + 0.5)


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)
