"""HTTP load: wrk when it is installed, else a small keep-alive load generator of our own.

Both send ``GET /`` over N concurrent keep-alive connections to a loopback server for a
fixed time and report requests/s, p50/p99 latency and the non-2xx count. The built-in one
runs in Python in this process and cannot push as hard as wrk: with it, a fast server is
partly limited by the load generator, which pulls every ratio towards 1. Install wrk
(``apt-get install -y wrk``) for figures worth comparing.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import time
from dataclasses import dataclass

_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


@dataclass
class LoadResult:
    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    non2xx: int
    errors: int


class LoadGenerator:
    """``tool`` is ``"wrk"`` or ``"builtin"``; ``run(url)`` loads one server for `duration`."""

    def __init__(self, connections: int, duration: float, *, force_builtin: bool = False,
                 max_requests: int = 2_000_000) -> None:
        self.connections = connections
        self.duration = duration
        self.max_requests = max_requests
        self.wrk = None if force_builtin else shutil.which("wrk")
        self.tool = "wrk" if self.wrk else "builtin"

    def describe(self) -> dict[str, object]:
        return {"tool": self.tool, "connections": self.connections, "threads": 1,
                "duration_s": self.duration}

    def run(self, url: str) -> LoadResult:
        if self.wrk:
            return _run_wrk(self.wrk, url, self.connections, self.duration)
        return asyncio.run(_run_builtin(url, self.connections, self.duration,
                                        self.max_requests))

    def warm(self, url: str, seconds: float) -> None:
        """A short load before measuring (connection pools filled, scripts loaded); by the
        built-in generator, as wrk counts only in whole seconds."""
        asyncio.run(_run_builtin(url, min(4, self.connections), seconds, self.max_requests))


# -- wrk ----------------------------------------------------------------------------------------
def _ms(text: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if match is None:
        raise ValueError(f"cannot read the wrk duration {text!r}")
    return float(match[1]) * _UNITS[match[2]]


def _run_wrk(wrk: str, url: str, connections: int, seconds: float) -> LoadResult:
    # wrk takes whole seconds; -t1: one load thread, leaving the other core to the server.
    argv = [wrk, "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--latency", url]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False,
                          timeout=seconds + 30)
    out = proc.stdout
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    total = re.search(r"(\d+) requests in", out)
    if proc.returncode != 0 or rps is None or total is None:
        raise RuntimeError(f"wrk failed ({proc.returncode}): {out}{proc.stderr}")
    p50 = re.search(r"^\s+50%\s+(\S+)", out, re.MULTILINE)
    p99 = re.search(r"^\s+99%\s+(\S+)", out, re.MULTILINE)
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)",
                       out)
    return LoadResult(
        rps=float(rps[1]),
        p50_ms=_ms(p50[1]) if p50 else float("nan"),
        p99_ms=_ms(p99[1]) if p99 else float("nan"),
        requests=int(total[1]),
        non2xx=int(non2xx[1]) if non2xx else 0,
        # gunicorn's sync workers close every connection: wrk counts those as read errors
        # and reconnects, so only connect errors and timeouts are failures.
        errors=(int(errors[1]) + int(errors[4])) if errors else 0,
    )


# -- built-in -----------------------------------------------------------------------------------
async def _connection(host: str, port: int, path: str, deadline: float, limit: int,
                      latencies: list[float], counts: list[int]) -> None:
    request = f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
    reader: asyncio.StreamReader | None = None
    writer: asyncio.StreamWriter | None = None
    try:
        while time.perf_counter() < deadline and len(latencies) < limit:
            try:
                if writer is None or reader is None:
                    reader, writer = await asyncio.open_connection(host, port)
                started = time.perf_counter()
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                lower = head.lower()
                length = re.search(rb"\r\ncontent-length:\s*(\d+)", lower)
                if length is not None:
                    await reader.readexactly(int(length[1]))
                else:
                    await reader.read()
                latencies.append(time.perf_counter() - started)
                if head[9:10] != b"2":
                    counts[0] += 1
                if length is None or b"\r\nconnection: close" in lower:
                    writer.close()
                    reader = writer = None
            # A failed request is counted and the connection replaced; the loop goes on.
            except (OSError, asyncio.IncompleteReadError,  # noqa: PERF203
                    asyncio.LimitOverrunError):
                counts[1] += 1
                if writer is not None:
                    writer.close()
                reader = writer = None
    finally:
        if writer is not None:
            writer.close()


async def _run_builtin(url: str, connections: int, seconds: float, limit: int) -> LoadResult:
    match = re.fullmatch(r"http://([\d.]+):(\d+)(/.*)?", url)
    if match is None:
        raise ValueError(f"the built-in load generator takes http://127.0.0.1:PORT/ URLs, "
                         f"got {url!r}")
    host, port, path = match[1], int(match[2]), match[3] or "/"
    latencies: list[float] = []
    counts = [0, 0]  # non-2xx, errors
    started = time.perf_counter()
    deadline = started + seconds
    await asyncio.gather(*(
        _connection(host, port, path, deadline, limit, latencies, counts)
        for _ in range(connections)
    ))
    elapsed = time.perf_counter() - started
    ordered = sorted(latencies)

    def percentile(q: float) -> float:
        if not ordered:
            return float("nan")
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3

    return LoadResult(rps=len(ordered) / elapsed, p50_ms=percentile(0.50),
                      p99_ms=percentile(0.99), requests=len(ordered), non2xx=counts[0],
                      errors=counts[1])
