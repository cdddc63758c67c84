"""The start-up check's report: which store, which server and version, one round trip.

``ping()`` / ``aping()`` connect, load the script on every primary, and report what this
module assembles, or raise the BackendError made by `unreachable`. The limiter finds a
store's check with `pinger` and reports its failure with `ping_failed`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ratelimit_mw.backends.clients import describe
from ratelimit_mw.core import scripts
from ratelimit_mw.core.errors import BackendError, ConfigurationError


def ping_report(backend: str, *, version: str | None, nodes: int, rtt_s: float,
                script_sha: str, server: str = "redis") -> dict[str, Any]:
    """What ``ping()`` answers: which store, which server ("redis" or "valkey") and its
    version, its size and one round trip."""
    return {
        "backend": backend,
        "server": server,
        "version": version,
        "cluster": backend == "redis-cluster",
        "nodes": nodes,
        "rtt_ms": round(rtt_s * 1000, 3),
        "script_sha": script_sha,
    }


async def aping_pipelined(connection: Any) -> float:
    """Open a pipelined connection (a no-op if open), load the script on its node and time
    one PING on it: the round trip of the network, the set-up excluded."""
    await connection.command("PING")
    start = time.perf_counter()
    await connection.command("PING")
    rtt = time.perf_counter() - start
    await connection.command("SCRIPT", "LOAD", scripts.source())
    return rtt


def server_of(info: Any) -> dict[str, Any]:
    """The server and its version from INFO (redis-py's parsed dict, or the raw text of
    hiredis), as ``ping_report`` takes them. Valkey reports the Redis version it is
    compatible with as ``redis_version`` (7.2.4 for every Valkey 8); its own is
    ``valkey_version``."""
    if isinstance(info, bytes):
        info = info.decode(errors="replace")
    if isinstance(info, str):
        info = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    if not isinstance(info, dict):
        return {"version": None}
    server = "valkey" if "valkey_version" in info else "redis"
    version = info.get(f"{server}_version")
    return {"server": server, "version": None if version is None else str(version).strip()}


def unreachable(client: Any, exc: BaseException) -> BackendError:
    return BackendError(f"start-up check failed for {describe(client)}: {type(exc).__name__}: "
                        f"{exc}")


def pinger(backend: Any, method: str) -> Callable[[], Any]:
    """The backend's start-up check (`ping` or `aping`)."""
    found = getattr(backend, method, None)
    if not callable(found):
        raise ConfigurationError(
            f"{backend!r} has no {method}(), so the limiter cannot check it; use "
            "MemoryBackend, RedisBackend or AsyncRedisBackend, or give yours that method"
        )
    return found  # type: ignore[no-any-return]


def ping_failed(exc: BaseException) -> BackendError:
    return BackendError(f"the store did not answer a ping: {type(exc).__name__}: {exc}")
