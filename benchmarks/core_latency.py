"""Per-check latency: every algorithm, 1 and 3 tiers, sync and async, Redis and memory.

Each figure is the mean time of one admitted check over a batch of sequential calls (one
caller, no concurrency: the latency a request pays). Beside it, on the SAME client: a bare
``PING`` (the floor a one-round-trip check can approach), and the ``limits`` library (what
slowapi and Flask-Limiter run) on the same Redis. A run is several rounds; in each round
every configuration is measured once, in a rotated order, each Redis one right after a PING
batch on the same client, and its ratio to that adjacent PING is kept, so a drift in machine
load cancels out of the ratios. The time Redis itself spends per check is the
``redis_time`` section's (redis_time.py).

Every check is admitted: the limits are far above what a run sends, the identities rotate
over a pool (a sliding log stays a few entries long), and ``deny_cache=0`` keeps the local
deny cache out of the admitted path.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from _util import delete_prefix, importable, log, rotated, spread_dict

ALGORITHMS = ("fixed-window", "sliding-log", "sliding-window", "gcra")
# Far above anything a run sends to one identity of the pool: every check is admitted.
TIERS = {
    1: "1000000/minute",
    3: "100000/second;1000000/minute;10000000/hour",
}
# The limits-library strategy closest to each algorithm (it has no GCRA).
LIMITS_STRATEGY = {
    "fixed-window": "FixedWindowRateLimiter",
    "sliding-log": "MovingWindowRateLimiter",
    "sliding-window": "SlidingWindowCounterRateLimiter",
}
IDENTITIES = 10_000
# The `memory, returning` rows: MemoryBackend on a pool of identities seen before (every
# identity hit once before the rounds), beside the `memory` rows, whose every check is a new
# identity's (keys created, and later swept). Each row has a backend of its own.
RETURNING = 1_000

TARGET_PING_RATIO = 1.15
TARGET_MEMORY_US = 5.0


@dataclass
class Config:
    impl: str  # "PING", "ratelimit_mw", "limits"
    backend: str  # "redis", "memory", "raw socket"
    mode: str  # "sync" or "async"
    fn: Callable[[str], Any]
    algorithm: str = ""
    tiers: int = 0
    pool: int = IDENTITIES  # the identities it rotates over: the first `pool` of them
    us: list[float] = field(default_factory=list)
    ratio: list[float] = field(default_factory=list)

    @property
    def label(self) -> str:
        if self.impl == "PING":
            return f"PING ({self.backend})"
        return f"{self.impl} {self.algorithm} ×{self.tiers}"


def _identities() -> list[str]:
    return [f"user:{i}" for i in range(IDENTITIES)]


class _RawPing:
    """PING over a bare socket: the network and server part of a round trip, no client."""

    def __init__(self, url: str) -> None:
        host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def __call__(self, _identity: str) -> None:
        self.sock.sendall(b"*1\r\n$4\r\nPING\r\n")
        if self.sock.recv(64) != b"+PONG\r\n":
            raise RuntimeError("unexpected PING reply")

    def close(self) -> None:
        self.sock.close()


def _own_memory(limiter_class: Any, backend_class: Any, prefix: str) -> tuple[Any, Any]:
    """The `memory` and `memory, returning` limiters of one configuration, each on a
    MemoryBackend of its own. A backend shared by every configuration charged each one's
    first batch of a round with sweeping the keys the others had left to expire meanwhile
    (1 s tiers, gcra): fixed-window 1 tier measured 5.1 µs on a shared backend against
    3.5 µs on its own, on one host."""
    return (limiter_class(backend_class(), prefix=prefix, deny_cache=0),
            limiter_class(backend_class(), prefix=prefix, deny_cache=0))


def _sync_configs(url: str, prefix: str, closers: list[Callable[[], Any]]) -> list[Config]:
    from ratelimit_mw import Limiter, MemoryBackend, Policy, RedisBackend

    backend = RedisBackend.from_url(url)
    closers.append(backend.close)
    client = backend.client
    raw = _RawPing(url)
    closers.append(raw.close)
    configs = [
        Config("PING", "redis", "sync", lambda _i: client.ping()),
        Config("PING", "raw socket", "sync", raw),
    ]
    on_redis = Limiter(backend, prefix=prefix, deny_cache=0)
    for algorithm in ALGORITHMS:
        for tiers, rates in TIERS.items():
            policy = Policy(rates, algorithm=algorithm, name=f"{algorithm}-{tiers}")
            configs.append(Config("ratelimit_mw", "redis", "sync",
                                  functools.partial(on_redis.hit, policy), algorithm, tiers))
            # A MemoryBackend per configuration (see _own_memory).
            in_memory, returning = _own_memory(Limiter, MemoryBackend, prefix)
            configs.append(Config("ratelimit_mw", "memory", "sync",
                                  functools.partial(in_memory.hit, policy), algorithm, tiers))
            configs.append(Config("ratelimit_mw", "memory, returning", "sync",
                                  functools.partial(returning.hit, policy), algorithm, tiers,
                                  pool=RETURNING))
    if importable("limits") is None:
        from limits import parse_many, storage, strategies

        store = storage.RedisStorage(url, key_prefix=f"{prefix}limits")
        closers.append(lambda: store.storage.close())
        for algorithm, strategy_name in LIMITS_STRATEGY.items():
            strategy = getattr(strategies, strategy_name)(store)
            for tiers, rates in TIERS.items():
                items = parse_many(rates)

                def hit_all(identity: str, _s: Any = strategy, _items: Any = items,
                            _ns: str = algorithm) -> None:
                    # What Flask-Limiter and slowapi do: one hit (one round trip) per limit.
                    # (_ns keeps the strategies' keys apart: they name keys alike.)
                    for item in _items:
                        if not _s.hit(item, _ns, identity):
                            raise RuntimeError("limits refused an admitted-path check")

                configs.append(Config("limits", "redis", "sync", hit_all, algorithm, tiers))
    else:
        log(f"  limits not importable ({importable('limits')}): pip install limits")
    return configs


def _async_configs(url: str, prefix: str,
                   closers: list[Callable[[], Awaitable[Any]]]) -> list[Config]:
    from ratelimit_mw import AsyncLimiter, AsyncRedisBackend, MemoryBackend, Policy

    backend = AsyncRedisBackend.from_url(url)
    closers.append(backend.aclose)
    client = backend.client

    async def ping(_identity: str) -> None:
        await client.ping()

    configs = [Config("PING", "redis", "async", ping)]
    on_redis = AsyncLimiter(backend, prefix=prefix, deny_cache=0)
    for algorithm in ALGORITHMS:
        for tiers, rates in TIERS.items():
            policy = Policy(rates, algorithm=algorithm, name=f"{algorithm}-{tiers}")
            in_memory, returning = _own_memory(AsyncLimiter, MemoryBackend, prefix)
            configs.append(Config("ratelimit_mw", "redis", "async",
                                  functools.partial(on_redis.hit, policy), algorithm, tiers))
            configs.append(Config("ratelimit_mw", "memory", "async",
                                  functools.partial(in_memory.hit, policy), algorithm, tiers))
            configs.append(Config("ratelimit_mw", "memory, returning", "async",
                                  functools.partial(returning.hit, policy), algorithm, tiers,
                                  pool=RETURNING))
    if importable("limits") is None:
        from limits import parse_many
        from limits.aio import storage, strategies

        # implementation="redispy": redis.asyncio, the client ratelimit_mw uses.
        store = storage.RedisStorage(url.replace("redis://", "async+redis://", 1),
                                     implementation="redispy", key_prefix=f"{prefix}limits")
        for algorithm, strategy_name in LIMITS_STRATEGY.items():
            strategy = getattr(strategies, strategy_name)(store)
            for tiers, rates in TIERS.items():
                items = parse_many(rates)

                async def hit_all(identity: str, _s: Any = strategy, _items: Any = items,
                                  _ns: str = algorithm) -> None:
                    for item in _items:
                        if not await _s.hit(item, _ns, identity):
                            raise RuntimeError("limits refused an admitted-path check")

                configs.append(Config("limits", "redis", "async", hit_all, algorithm, tiers))
    return configs


def _measure_sync(fn: Callable[[str], Any], ids: list[str], start: int, n: int) -> float:
    gc.collect()
    k = len(ids)
    t0 = time.perf_counter()
    for i in range(start, start + n):
        fn(ids[i % k])
    return (time.perf_counter() - t0) / n * 1e6


async def _measure_async(fn: Callable[[str], Awaitable[Any]], ids: list[str], start: int,
                         n: int) -> float:
    gc.collect()
    k = len(ids)
    t0 = time.perf_counter()
    for i in range(start, start + n):
        await fn(ids[i % k])
    return (time.perf_counter() - t0) / n * 1e6


def _ping_of(configs: list[Config]) -> Config:
    return next(c for c in configs if c.impl == "PING" and c.backend == "redis")


def _compares_to_ping(config: Config) -> bool:
    return config.backend == "redis" and config.impl != "PING"


def _warm_up(config: Config) -> int:
    """Checks before the rounds: connections open, scripts loaded; every identity of a
    returning pool seen once."""
    return max(200, config.pool) if config.pool < IDENTITIES else 200


def _rounds_sync(configs: list[Config], rounds: int, n: int, ids: list[str]) -> None:
    for config in configs:
        _measure_sync(config.fn, ids[:config.pool], 0, _warm_up(config))
    ping = _ping_of(configs)
    cursor = 200
    for r in range(rounds):
        for config in rotated(configs, r):
            # A/B: a PING batch on the same client right before each Redis configuration.
            adjacent = (_measure_sync(ping.fn, ids, cursor, n // 2)
                        if _compares_to_ping(config) else None)
            us = _measure_sync(config.fn, ids[:config.pool], cursor, n)
            config.us.append(us)
            if adjacent is not None:
                config.ratio.append(us / adjacent)
        cursor += n
        log(f"  core sync round {r + 1}/{rounds} done")


async def _rounds_async(url: str, prefix: str, rounds: int, n: int,
                        ids: list[str]) -> list[Config]:
    closers: list[Callable[[], Awaitable[Any]]] = []
    configs = _async_configs(url, prefix, closers)
    try:
        for config in configs:
            await _measure_async(config.fn, ids[:config.pool], 0, _warm_up(config))
        ping = _ping_of(configs)
        cursor = 200
        for r in range(rounds):
            for config in rotated(configs, r):
                adjacent = (await _measure_async(ping.fn, ids, cursor, n // 2)
                            if _compares_to_ping(config) else None)
                us = await _measure_async(config.fn, ids[:config.pool], cursor, n)
                config.us.append(us)
                if adjacent is not None:
                    config.ratio.append(us / adjacent)
            cursor += n
            log(f"  core async round {r + 1}/{rounds} done")
    finally:
        for close in closers:
            await close()
    return configs


def event_loop_name() -> str:
    return "uvloop" if importable("uvloop") is None else "asyncio"


def run(url: str, *, rounds: int, n: int, shared_server: bool) -> dict[str, Any]:
    """Measure and return the ``core`` section of benchmarks.json."""
    prefix = f"rlbench{int(time.time() * 1000) % 10**9}"
    ids = _identities()
    sync_closers: list[Callable[[], Any]] = []
    try:
        sync_configs = _sync_configs(url, prefix, sync_closers)
        _rounds_sync(sync_configs, rounds, n, ids)
    finally:
        for close in sync_closers:
            close()
    loop = event_loop_name()
    if loop == "uvloop":
        import uvloop

        async_configs = uvloop.run(_rounds_async(url, prefix, rounds, n, ids))
    else:
        async_configs = asyncio.run(_rounds_async(url, prefix, rounds, n, ids))
    if shared_server:
        delete_prefix(url, prefix)
    rows = [
        {
            "label": config.label,
            "impl": config.impl,
            "backend": config.backend,
            "mode": config.mode,
            "algorithm": config.algorithm,
            "tiers": config.tiers,
            "us": spread_dict(config.us),
            "x_ping": spread_dict(config.ratio),
        }
        for config in [*sync_configs, *async_configs]
    ]
    return {
        "rounds": rounds,
        "checks_per_round": n,
        "identities": IDENTITIES,
        "returning_identities": RETURNING,
        # Runs before this key existed shared one MemoryBackend among the `memory` rows and
        # another among the `memory, returning` rows (see _own_memory).
        "memory_backend_per_row": True,
        "tiers": {str(k): v for k, v in TIERS.items()},
        "event_loop": loop,
        "rows": rows,
    }
