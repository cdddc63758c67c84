"""Time inside Redis per check: every algorithm × 1 and 3 tiers, ratelimit_mw beside limits.

Redis runs commands (and Lua scripts) on one thread, so the microseconds one check costs
*inside* Redis bound what one Redis, or one cluster shard, can serve for a whole fleet; no
client-side work can win them back. On a private redis-server (nobody else's commands in
its counters) each configuration runs a batch of sequential admitted checks through the
library's own sync API, and ``INFO commandstats`` is read before and after: the ``usec``
of every command the batch sent (EVALSHA, or for limits one script call per limit, or
INCR + PEXPIRE), summed and divided by the checks. A script's usec holds the commands it
calls, which Redis also counts under their own names: those are listed (calls per check)
but not added again. The configurations are interleaved over
the rounds in a rotated order; the table shows the median and min–max over the rounds, and
each configuration's ratio to the limits figure for the same algorithm and tiers, measured
in the same round.

Three implementations of the same policy (``TIERS`` of core_latency, all admitted):

- ``ratelimit_mw``: ``Limiter.hit`` on ``RedisBackend.from_url`` (one call for all tiers);
- ``limits``: the strategy slowapi and Flask-Limiter use, one ``hit`` per limit;
- ``INCR+PEXPIRE``: the plain counter floor of a fixed window, one INCR and one PEXPIRE per
  tier in one pipeline (what no exact limiter can go below; fixed-window rows only);
- ``TIME floor``: a script that reads Redis's clock and returns, touching no key: what any
  check pays that decides on Redis's clock, as the design requires (limits reads the app
  server's clock instead: its fixed window starts at the first hit, its moving window is
  stamped with ``time.time()``). Where this floor alone exceeds the 0.8 × limits target, no
  exact script on Redis's clock can meet it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
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

TARGET_X_LIMITS = 0.8
IDENTITIES = 10_000

# Reads Redis's clock and returns a reply of one admitted tier's size; touches no key.
CLOCK_FLOOR_SCRIPT = "local t = redis.call('TIME') return {1, 1, t[1] % 2, 0, t[2] % 2, 0}"


@dataclass
class Config:
    impl: str  # "ratelimit_mw", "limits", "INCR+PEXPIRE", "TIME floor"
    algorithm: str
    tiers: int
    fn: Callable[[str], Any]
    usec: list[float] = field(default_factory=list)
    x_limits: list[float] = field(default_factory=list)
    calls: dict[str, float] = field(default_factory=dict)  # command -> calls per check


def counter_pipeline(client: Any, prefix: str, tiers: int) -> Callable[[str], Any]:
    """The plain fixed-window counter: INCR + PEXPIRE per tier, one round trip."""
    from ratelimit_mw import Rate

    windows = [Rate.parse(text).period_ms for text in TIERS[tiers].split(";")]

    def check(identity: str) -> Any:
        pipe = client.pipeline(transaction=False)
        for n, window in enumerate(windows):
            key = f"{prefix}:{identity}:{n}"
            pipe.incr(key)
            pipe.pexpire(key, window)
        return pipe.execute()

    return check


def clock_floor(client: Any, prefix: str) -> Callable[[str], Any]:
    """One EVALSHA of `CLOCK_FLOOR_SCRIPT` with the identity's key (never read or written)."""
    sha = client.script_load(CLOCK_FLOOR_SCRIPT)

    def check(identity: str) -> Any:
        return client.evalsha(sha, 1, f"{prefix}:{identity}")

    return check


def limits_hit(strategy: Any, items: Any, namespace: str) -> Callable[[str], None]:
    """What Flask-Limiter and slowapi do for one request: one ``hit`` per limit."""

    def check(identity: str) -> None:
        for item in items:
            if not strategy.hit(item, namespace, identity):
                raise RuntimeError("limits refused an admitted-path check")

    return check


def _configs(url: str, prefix: str, closers: list[Callable[[], Any]]) -> list[Config]:
    import redis

    from ratelimit_mw import Limiter, Policy, RedisBackend

    backend = RedisBackend.from_url(url)
    closers.append(backend.close)
    ours = Limiter(backend, prefix=prefix, deny_cache=0)
    plain = redis.Redis.from_url(url)
    closers.append(plain.close)
    configs: list[Config] = []
    have_limits = importable("limits") is None
    if have_limits:
        from limits import parse_many, storage, strategies

        store = storage.RedisStorage(url, key_prefix=f"{prefix}limits")
        closers.append(lambda: store.storage.close())
    else:
        log(f"  limits not importable ({importable('limits')}): pip install limits")
    for algorithm in ALGORITHMS:
        for tiers, rates in TIERS.items():
            policy = Policy(rates, algorithm=algorithm, name=f"{algorithm}-{tiers}")
            configs.append(Config("ratelimit_mw", algorithm, tiers,
                                  functools.partial(ours.hit, policy)))
            if have_limits and algorithm in LIMITS_STRATEGY:
                strategy = getattr(strategies, LIMITS_STRATEGY[algorithm])(store)
                configs.append(Config("limits", algorithm, tiers,
                                      limits_hit(strategy, parse_many(rates), algorithm)))
            if algorithm == "fixed-window":
                configs.append(Config("INCR+PEXPIRE", algorithm, tiers,
                                      counter_pipeline(plain, f"{prefix}plain{tiers}", tiers)))
            configs.append(Config("TIME floor", algorithm, tiers,
                                  clock_floor(plain, f"{prefix}clock")))
    return configs


def _measure(config: Config, stats: Any, ids: list[str], start: int, n: int) -> float:
    """Run n checks; the usec Redis spent on them, per check. Keeps the calls per check."""
    before = command_stats(stats)
    k = len(ids)
    for i in range(start, start + n):
        config.fn(ids[i % k])
    delta = command_delta(before, command_stats(stats))
    config.calls = {name: calls / n for name, (calls, _usec) in delta.items()}
    return top_level_usec(delta) / n


def run(url: str, *, rounds: int, n: int) -> dict[str, Any]:
    """Measure and return the ``redis_time`` section of benchmarks.json (private server)."""
    import redis

    prefix = f"rlrt{int(time.time() * 1000) % 10**8}"
    ids = [f"user:{i}" for i in range(IDENTITIES)]
    closers: list[Callable[[], Any]] = []
    try:
        configs = _configs(url, prefix, closers)
        stats = redis.Redis.from_url(url)
        closers.append(stats.close)
        for config in configs:  # warm-up: connections open, scripts loaded
            _measure(config, stats, ids, 0, 100)
        cursor = 100
        for r in range(rounds):
            this_round: dict[tuple[str, str, int], float] = {}
            for config in rotated(configs, r):
                us = _measure(config, stats, ids, cursor, n)
                config.usec.append(us)
                this_round[(config.impl, config.algorithm, config.tiers)] = us
            for config in configs:
                peer = this_round.get(("limits", config.algorithm, config.tiers))
                if peer:
                    config.x_limits.append(this_round[(config.impl, config.algorithm,
                                                       config.tiers)] / peer)
            cursor += n
            log(f"  redis_time round {r + 1}/{rounds} done")
    finally:
        for close in closers:
            close()
    rows = [
        {
            "impl": c.impl,
            "algorithm": c.algorithm,
            "tiers": c.tiers,
            "usec": spread_dict(c.usec),
            "x_limits": spread_dict(c.x_limits) if c.impl != "limits" and c.x_limits else None,
            "calls_per_check": {k: round(v, 3) for k, v in sorted(c.calls.items())},
        }
        for c in configs
    ]
    return {"rounds": rounds, "checks_per_round": n, "identities": IDENTITIES,
            "tiers": {str(k): v for k, v in TIERS.items()}, "target_x_limits": TARGET_X_LIMITS,
            "rows": rows}
