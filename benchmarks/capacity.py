"""Fleet capacity per Redis core: how many checks one Redis sustains when a fleet loads it.

Redis executes commands and scripts on one thread: whatever the number of app servers, one
Redis (or one cluster shard) serves at most ``1 s / (Redis CPU per check)`` checks per
second. This section loads a private redis-server from N client processes (each its own
event loop on uvloop, C checks in flight, so commands pipeline on the wire), for every
algorithm × 1 and 3 tiers, and reads during each measured window:

- **checks/s**: admitted checks completed by all the client processes together;
- **Redis CPU**: the server's main-thread CPU time over the window (``INFO cpu``), as a share
  of one core;
- **checks per Redis core-second** = checks/s ÷ Redis CPU share: the capacity of one fully
  used Redis core for this check. When the clients saturate Redis (Redis CPU near 100%)
  the two figures coincide; on a small machine, where the clients' own CPU is the limit,
  only the second one measures Redis;
- **in Redis µs / check**: ``INFO commandstats`` usec of every command issued, per check.

Three implementations of the same policy, each through its own client path:

- ``ratelimit_mw``: ``AsyncLimiter.hit`` on ``AsyncRedisBackend`` (its pipelined connection:
  the in-flight checks of a process share one connection, one script call per check);
- ``limits``: ``limits.aio`` strategies on redis.asyncio, one ``hit`` per limit (how slowapi
  calls it; in-flight checks spread over a connection pool);
- ``INCR+PEXPIRE``: the plain fixed-window counter, INCR + PEXPIRE per tier written at once
  per check on one raw connection per process (hiredis packs and parses: the cheapest client
  possible); fixed-window rows only. The floor: what no exact limiter goes below.

The configurations are interleaved over the rounds (rotated order); every figure is the
median over the rounds with the min–max range.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import multiprocessing
import os
import time
from dataclasses import dataclass, field
from typing import Any

from _util import (
    command_delta,
    command_stats,
    importable,
    log,
    rotated,
    spread_dict,
    top_level_usec,
)
from core_latency import ALGORITHMS, LIMITS_STRATEGY, TIERS

IDENTITIES = 10_000
SETUP_S = 0.4  # from the job's arrival to the start of its warm-up: building the clients


@dataclass
class Job:
    impl: str
    algorithm: str
    tiers: int
    checks_per_s: list[float] = field(default_factory=list)
    redis_cpu: list[float] = field(default_factory=list)
    per_core: list[float] = field(default_factory=list)
    redis_us: list[float] = field(default_factory=list)
    errors: int = 0

    @property
    def spec(self) -> tuple[str, str, int]:
        return self.impl, self.algorithm, self.tiers


def default_processes() -> int:
    """One client process per core: 16 on a 16-core machine. On a 2-core machine that is
    2, sharing the cores with Redis: the clients cannot saturate Redis there, which is why
    the per-core figure divides by Redis's measured CPU share."""
    return max(1, os.cpu_count() or 1)


# -- the client processes -----------------------------------------------------------------------
async def _checker(job: dict[str, Any], url: str, worker: int) -> Any:
    """The per-check coroutine function of `job` and the closer of what it opened."""
    impl, algorithm, tiers = job["impl"], job["algorithm"], job["tiers"]
    rates = TIERS[tiers]
    prefix = f"{job['prefix']}w{worker}"
    if impl == "ratelimit_mw":
        from ratelimit_mw import AsyncLimiter, AsyncRedisBackend, Policy

        # Generous timeouts: a saturated 2-core machine must not turn slowness into errors.
        backend = AsyncRedisBackend.from_url(url, socket_timeout=10, socket_connect_timeout=10)
        limiter = AsyncLimiter(backend, prefix=prefix, deny_cache=0)
        policy = Policy(rates, algorithm=algorithm, name=f"{algorithm}-{tiers}")

        async def ours(identity: str) -> bool:
            return (await limiter.hit(policy, identity)).allowed

        return ours, backend.aclose
    if impl == "limits":
        from limits import parse_many
        from limits.aio import storage, strategies

        store = storage.RedisStorage(url.replace("redis://", "async+redis://", 1),
                                     implementation="redispy", key_prefix=prefix)
        strategy = getattr(strategies, LIMITS_STRATEGY[algorithm])(store)
        items = parse_many(rates)

        async def peer(identity: str) -> bool:
            for item in items:
                if not await strategy.hit(item, algorithm, identity):
                    return False
            return True

        async def close() -> None:
            # limits keeps its redis.asyncio client on the storage's bridge (limits 4, 5).
            client = getattr(getattr(store, "bridge", None), "storage", None)
            if client is not None:
                await client.aclose()

        return peer, close
    from ratelimit_mw import Rate

    connection = await _RawPipeline.open(url)
    windows = [Rate.parse(text).period_ms for text in rates.split(";")]

    async def plain(identity: str) -> bool:
        commands = []
        for n, window in enumerate(windows):
            key = f"{prefix}:{identity}:{n}"
            commands.append(("INCR", key))
            commands.append(("PEXPIRE", key, window))
        await connection.send(commands)
        return True

    return plain, connection.close


class _RawPipeline(asyncio.Protocol):
    """The cheapest client there is for the plain counter floor: one connection per process,
    commands packed by hiredis and written at once, replies parsed by hiredis in order. (A
    redis.asyncio pipeline costs the client ~10× more CPU than Redis spends on it, which on a
    small machine would measure the client instead of Redis.)"""

    def __init__(self) -> None:
        import hiredis

        self.reader = hiredis.Reader()
        self.pending: collections.deque[tuple[asyncio.Future[None], int]] = collections.deque()
        self.transport: Any = None
        self.pack = hiredis.pack_command

    @classmethod
    async def open(cls, url: str) -> _RawPipeline:
        host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
        loop = asyncio.get_running_loop()
        _transport, protocol = await loop.create_connection(cls, host, int(port))
        return protocol

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while (reply := self.reader.gets()) is not False:
            future, left = self.pending[0]
            if isinstance(reply, Exception) and not future.done():
                future.set_exception(reply)
            if left > 1:
                self.pending[0] = (future, left - 1)
                continue
            self.pending.popleft()
            if not future.done():
                future.set_result(None)

    async def send(self, commands: list[tuple[Any, ...]]) -> None:
        future = asyncio.get_running_loop().create_future()
        self.pending.append((future, len(commands)))
        self.transport.write(b"".join(self.pack(c) for c in commands))
        await future

    async def close(self) -> None:
        self.transport.close()


async def _load(job: dict[str, Any], url: str, worker: int) -> tuple[int, int]:
    check, close = await _checker(job, url, worker)
    ids = [f"user:{i}" for i in range(IDENTITIES)]
    start_at, end_at = job["start_at"], job["start_at"] + job["duration"]
    counted = [0, 0]  # admitted checks completed inside the window, failures
    clock = time.monotonic

    async def one(slot: int) -> None:
        i = slot
        k = len(ids)
        while True:
            try:
                ok = await check(ids[i % k])
            except Exception:  # a failed check is counted, the load goes on
                ok = False
            now = clock()
            if now >= end_at:
                return
            if now >= start_at:
                counted[0 if ok else 1] += 1
            i += job["concurrency"]

    try:
        delay = job["start_at"] - job["warmup"] - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        await asyncio.gather(*(one(s) for s in range(job["concurrency"])))
    finally:
        await close()
    return counted[0], counted[1]


def _worker(conn: Any, url: str, worker: int) -> None:
    """A client process: runs the jobs the parent sends until it sends None."""
    # Everything a job imports, imported before the parent starts timing: a first job must
    # not spend its window importing.
    for module in ("ratelimit_mw", "redis.asyncio", "hiredis", "limits", "limits.aio.storage",
                   "limits.aio.strategies"):
        importable(module)
    conn.send("ready")
    if importable("uvloop") is None:
        import uvloop

        runner: Any = uvloop.run
    else:
        runner = asyncio.run
    while True:
        job = conn.recv()
        if job is None:
            return
        try:
            conn.send(runner(_load(job, url, worker)))
        except Exception as exc:  # reported by the parent, which stops the section
            conn.send(f"{type(exc).__name__}: {exc}")


# -- the parent ---------------------------------------------------------------------------------
def _redis_cpu(info: dict[str, Any]) -> float:
    """CPU seconds of the thread that executes commands (the whole process on old Redis)."""
    if "used_cpu_user_main_thread" in info:
        return float(info["used_cpu_user_main_thread"]) + float(info["used_cpu_sys_main_thread"])
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _jobs() -> list[Job]:
    jobs = []
    have_limits = importable("limits") is None
    for algorithm in ALGORITHMS:
        for tiers in TIERS:
            jobs.append(Job("ratelimit_mw", algorithm, tiers))
            if have_limits and algorithm in LIMITS_STRATEGY:
                jobs.append(Job("limits", algorithm, tiers))
            if algorithm == "fixed-window":
                jobs.append(Job("INCR+PEXPIRE", algorithm, tiers))
    return jobs


def _measure(job: Job, pipes: list[Any], stats: Any, url_prefix: str, *, duration: float,
             warmup: float, concurrency: int) -> None:
    start_at = time.monotonic() + SETUP_S + warmup
    spec = {"impl": job.impl, "algorithm": job.algorithm, "tiers": job.tiers,
            "prefix": url_prefix, "start_at": start_at, "warmup": warmup,
            "duration": duration, "concurrency": concurrency}
    for conn in pipes:
        conn.send(spec)
    time.sleep(max(0.0, start_at - time.monotonic()))
    t0 = time.monotonic()
    cpu0, cmd0 = _redis_cpu(stats.info("cpu")), command_stats(stats)
    time.sleep(max(0.0, start_at + duration - time.monotonic()))
    cpu1, cmd1 = _redis_cpu(stats.info("cpu")), command_stats(stats)
    wall = time.monotonic() - t0
    admitted = failed = 0
    for conn in pipes:
        reply = conn.recv()
        if isinstance(reply, str):
            raise RuntimeError(f"capacity client failed on {job.spec}: {reply}")
        admitted += reply[0]
        failed += reply[1]
    job.errors += failed
    rate = admitted / duration
    share = (cpu1 - cpu0) / wall
    job.checks_per_s.append(rate)
    job.redis_cpu.append(share)
    job.per_core.append(rate / share if share > 0 else 0.0)
    if admitted:
        job.redis_us.append(top_level_usec(command_delta(cmd0, cmd1)) / admitted)


def run(url: str, *, processes: int, concurrency: int, rounds: int, duration: float,
        warmup: float) -> dict[str, Any]:
    """Measure and return the ``capacity`` section of benchmarks.json (private server)."""
    import redis

    jobs = _jobs()
    prefix = f"rlcap{int(time.time() * 1000) % 10**8}"
    context = multiprocessing.get_context("spawn")
    pipes, procs = [], []
    stats = redis.Redis.from_url(url)
    try:
        for n in range(processes):
            parent, child = context.Pipe()
            proc = context.Process(target=_worker, args=(child, url, n), daemon=True)
            proc.start()
            pipes.append(parent)
            procs.append(proc)
        for conn in pipes:
            if not conn.poll(60) or conn.recv() != "ready":
                raise RuntimeError("a capacity client process did not start")
        log(f"  {processes} client processes × {concurrency} checks in flight, "
            f"{len(jobs)} configurations")
        for r in range(rounds):
            for job in rotated(jobs, r):
                _measure(job, pipes, stats, prefix, duration=duration, warmup=warmup,
                         concurrency=concurrency)
            log(f"  capacity round {r + 1}/{rounds} done")
    finally:
        for conn in pipes:
            with contextlib.suppress(OSError):  # a client that died is joined below
                conn.send(None)
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
        stats.close()
    rows = [
        {
            "impl": job.impl,
            "algorithm": job.algorithm,
            "tiers": job.tiers,
            "checks_per_s": spread_dict(job.checks_per_s),
            "redis_cpu": spread_dict(job.redis_cpu),
            "per_redis_core": spread_dict(job.per_core),
            "redis_us": spread_dict(job.redis_us),
            "errors": job.errors,
        }
        for job in jobs
    ]
    return {"processes": processes, "concurrency": concurrency, "rounds": rounds,
            "duration_s": duration, "tiers": {str(k): v for k, v in TIERS.items()},
            "cpus": os.cpu_count(), "event_loop": "uvloop" if importable("uvloop") is None
            else "asyncio", "rows": rows}
