"""Redis memory per identity, for each algorithm, on a private redis-server.

Two figures per case:

- ``MEMORY USAGE`` (``SAMPLES 0``: exact) summed over the keys one identity leaves, as Redis
  accounts a key: its name, value and object overhead.
- ``used_memory`` after writing N identities minus before, divided by N: everything the
  server spends, including its key dictionaries and the expiry of every key.

Keys are what a middleware writes: prefix ``rl``, identities like ``ip:10.0.3.7``, the
policy named by its rate text. A private server is flushed between cases, which the shared
one must never be.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from _util import log

TARGET_BYTES = 150


@dataclass(frozen=True)
class Case:
    algorithm: str
    rate: str
    hits: int
    share: int  # identities written = N // share (long logs cost many calls per identity)
    note: str = ""
    two_windows: bool = False

    @property
    def label(self) -> str:
        extra = f", {self.note}" if self.note else ""
        return f"{self.algorithm} {self.rate}, {self.hits} hit{'s' * (self.hits > 1)}{extra}"

    @property
    def has_target(self) -> bool:
        return self.algorithm in ("fixed-window", "sliding-window", "gcra")


CASES = (
    Case("fixed-window", "100/minute", 1, 1),
    Case("sliding-window", "100/minute", 1, 1),
    Case("sliding-window", "100/minute", 2, 1, "steady state: two windows", two_windows=True),
    Case("gcra", "100/minute", 1, 1),
    Case("sliding-log", "100/minute", 1, 1),
    Case("sliding-log", "100/minute", 100, 10),
    Case("sliding-log", "200/minute", 200, 20, "past the compact encoding"),
)


class _Clock:
    """Seconds, moved by hand: lets a case write into two consecutive windows at once."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def _identity(i: int) -> str:
    return f"ip:10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}"


def _write(limiter: Any, clock: _Clock, case: Case, policy: Any, identity: str) -> None:
    if case.two_windows:
        start = clock.now
        limiter.hit(policy, identity)
        clock.now = start + 60  # the next window: the previous one is still read
        limiter.hit(policy, identity)
        clock.now = start
        return
    for _ in range(case.hits):
        if not limiter.hit(policy, identity).allowed:
            raise RuntimeError(f"{case.label}: a hit was refused; the figure would be wrong")


def _measure(client: Any, case: Case, identities: int) -> dict[str, Any]:
    from ratelimit_mw import Limiter, Policy, RedisBackend

    clock = _Clock()
    backend = RedisBackend(client)
    # Redis's own clock, except where a case must span two windows (then a test clock).
    limiter = Limiter(backend, prefix="rl", deny_cache=0,
                      clock=clock if case.two_windows else None)
    policy = Policy(case.rate, algorithm=case.algorithm)

    client.flushall()
    _write(limiter, clock, case, policy, _identity(0))
    keys = sorted(client.keys("*"))
    usage = {key.decode(): int(client.memory_usage(key, samples=0) or 0) for key in keys}
    encodings = sorted({client.object("encoding", key).decode() for key in keys})

    client.flushall()
    count = max(1, identities // case.share)
    # Keys must not expire while they are counted: a GCRA key of one hit of 100/minute lives
    # 0.6 s, less than writing 10 000 identities takes.
    client.execute_command("DEBUG", "SET-ACTIVE-EXPIRE", "0")
    # The script is cached after the flush; one call outside the measured window loads it.
    _write(limiter, clock, case, policy, "warm")
    client.delete(*client.keys("*"))
    before = int(client.info("memory")["used_memory"])
    for i in range(count):
        _write(limiter, clock, case, policy, _identity(i))
    # Let the server finish rehashing its key dictionaries (it does so in its cron, ~10 Hz):
    # half-done, both tables would be counted, or not, by chance.
    time.sleep(0.5)
    after = int(client.info("memory")["used_memory"])
    client.execute_command("DEBUG", "SET-ACTIVE-EXPIRE", "1")
    return {
        "label": case.label,
        "algorithm": case.algorithm,
        "rate": case.rate,
        "hits": case.hits,
        "keys": len(keys),
        "key_names": list(usage),
        "encodings": encodings,
        "memory_usage_bytes": sum(usage.values()),
        "used_memory_per_identity": (after - before) / count,
        "identities": count,
        "target_bytes": TARGET_BYTES if case.has_target else None,
    }


# What the private server for this section is started with (DEBUG SET-ACTIVE-EXPIRE).
SERVER_ARGS = ("--enable-debug-command", "local")


def run(url: str, *, identities: int) -> dict[str, Any]:
    """Measure and return the ``memory`` section of benchmarks.json (`url`: a private
    server started with `SERVER_ARGS`; it is flushed)."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        # Thrown away: the server's first allocations (script cache, buffers) are not an
        # identity's.
        _measure(client, CASES[0], min(identities, 1000))
        rows = []
        for case in CASES:
            rows.append(_measure(client, case, identities))
            log(f"  memory: {case.label} done")
        server = client.info("server")
        memory = client.info("memory")
    finally:
        client.close()
    return {"identities": identities, "redis_server": server.get("redis_version"),
            "allocator": memory.get("mem_allocator"), "rows": rows}
