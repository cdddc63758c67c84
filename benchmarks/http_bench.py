"""Middleware throughput and latency: hello-world apps under real servers, side by side.

ASGI: Starlette, FastAPI and Litestar under uvicorn (one worker). WSGI: Flask under gunicorn (sync
workers). Every configuration of a section runs as its own server on its own loopback port
for the whole section. Each round loads every configuration once, right beside a run of its
bare app (A/B, the order within the pair flipped every other round, the pairs rotated every
round), and divides its throughput by that adjacent bare run's. The table reports the median
of those ratios over the rounds with their range.

Two kinds of load:

- all admitted: the limit is huge, every request passes; this is the cost of the check.
- flood: one client over its limit (``1/day``): the first request is admitted, every later
  one refused. Around each measured flood the harness reads ``INFO commandstats`` of the
  Redis the servers use (a private one by default, idle but for this server) and reports
  the commands the server sent during the flood, all of them after the first refusal (the
  warm-up made it). With the local deny cache ratelimit_mw should send none.
"""

from __future__ import annotations

import http.client
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from _util import (
    APPS_DIR,
    Child,
    child_env,
    delete_prefix,
    free_port,
    importable,
    log,
    port_open,
    rotated,
    spread_dict,
    version,
)
from loadgen import LoadGenerator, LoadResult

HUGE = "1000000000/hour"
# A day-long fixed window: the flood's one admitted hit stays counted for the whole run. (With
# `1/hour`, a run over the top of the hour began a new window, admitted one request more and
# made one call more than the deny cache's bound allows: seen at 18:00 on 2026-11-24.)
FLOOD = "1/day"

TARGETS = {"asgi": 0.60, "wsgi": 0.70, "flood": 0.90, "django": 0.80, "in-flight": 0.90}


@dataclass
class HttpConfig:
    app: str  # the BENCH_APP the server builds
    label: str
    baseline: str  # the app whose adjacent run this one's throughput is divided by
    requires: tuple[str, ...] = ()
    flood: bool = False
    target: float | None = None
    results: list[LoadResult] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    redis_calls: list[dict[str, int]] = field(default_factory=list)
    port: int = 0
    child: Child | None = None
    skipped: str | None = None

    @property
    def key(self) -> str:
        return self.app + (":flood" if self.flood else "")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"


def asgi_configs() -> list[HttpConfig]:
    rl = ("ratelimit_mw.asgi",)
    slowapi = ("slowapi",)
    return [
        HttpConfig("starlette-bare", "Starlette bare", "starlette-bare"),
        HttpConfig("starlette-floor", "Starlette + floor (1 EVALSHA, redis.asyncio)",
                   "starlette-bare"),
        HttpConfig("starlette-rl-redis", "Starlette + ratelimit_mw (Redis)", "starlette-bare",
                   rl, target=TARGETS["asgi"]),
        HttpConfig("starlette-rl-memory", "Starlette + ratelimit_mw (memory)", "starlette-bare",
                   rl),
        # Against the rate alone, not the bare app: what holding a slot adds.
        HttpConfig("starlette-rl-inflight",
                   "Starlette + ratelimit_mw rate + in-flight (Redis), x the rate alone",
                   "starlette-rl-redis", rl, target=TARGETS["in-flight"]),
        HttpConfig("starlette-slowapi", "Starlette + slowapi SlowAPIMiddleware (Redis)",
                   "starlette-bare", slowapi),
        HttpConfig("starlette-slowapi-asgi", "Starlette + slowapi SlowAPIASGIMiddleware (Redis)",
                   "starlette-bare", ("slowapi.middleware:SlowAPIASGIMiddleware",)),
        HttpConfig("fastapi-bare", "FastAPI bare", "fastapi-bare", ("fastapi",)),
        HttpConfig("fastapi-rl-redis", "FastAPI + ratelimit_mw (Redis)", "fastapi-bare",
                   ("fastapi", *rl), target=TARGETS["asgi"]),
        HttpConfig("litestar-bare", "Litestar bare", "litestar-bare", ("litestar",)),
        HttpConfig("litestar-floor", "Litestar + floor (1 EVALSHA, redis.asyncio)",
                   "litestar-bare", ("litestar",)),
        HttpConfig("litestar-rl-redis", "Litestar + ratelimit_mw (Redis)", "litestar-bare",
                   ("ratelimit_mw.litestar",), target=TARGETS["asgi"]),
        HttpConfig("litestar-own", "Litestar + its own RateLimitConfig (Redis store)",
                   "litestar-bare", ("litestar.stores.redis",)),
        HttpConfig("starlette-rl-redis", "flood, 1 refused client: ratelimit_mw (Redis)",
                   "starlette-bare", rl, flood=True, target=TARGETS["flood"]),
        HttpConfig("starlette-slowapi-asgi", "flood, 1 refused client: slowapi ASGI (Redis)",
                   "starlette-bare", ("slowapi.middleware:SlowAPIASGIMiddleware",),
                   flood=True),
    ]


def wsgi_configs() -> list[HttpConfig]:
    return [
        HttpConfig("flask-bare", "Flask bare", "flask-bare"),
        HttpConfig("flask-floor", "Flask + floor (1 EVALSHA in before_request)", "flask-bare"),
        HttpConfig("flask-rl-ext", "Flask + ratelimit_mw extension (Redis)", "flask-bare",
                   ("ratelimit_mw.flask",), target=TARGETS["wsgi"]),
        HttpConfig("flask-rl-wsgi", "Flask + ratelimit_mw WSGI middleware (Redis)",
                   "flask-bare", ("ratelimit_mw.wsgi",), target=TARGETS["wsgi"]),
        HttpConfig("flask-limiter", "Flask + Flask-Limiter (Redis)", "flask-bare",
                   ("flask_limiter",)),
        HttpConfig("flask-rl-ext", "flood, 1 refused client: ratelimit_mw extension (Redis)",
                   "flask-bare", ("ratelimit_mw.flask",), flood=True, target=TARGETS["flood"]),
        HttpConfig("flask-limiter", "flood, 1 refused client: Flask-Limiter (Redis)",
                   "flask-bare", ("flask_limiter",), flood=True),
        HttpConfig("django-bare", "Django bare", "django-bare", ("django",)),
        HttpConfig("django-floor", "Django + floor (1 EVALSHA in a middleware)", "django-bare",
                   ("django",)),
        HttpConfig("django-rl", "Django + ratelimit_mw middleware (Redis)", "django-bare",
                   ("django", "ratelimit_mw.django"), target=TARGETS["django"]),
        HttpConfig("django-ratelimit", "Django + django-ratelimit (Redis, django-redis)",
                   "django-bare", ("django_ratelimit", "django_redis")),
    ]


def _missing(requires: tuple[str, ...]) -> str | None:
    for requirement in requires:
        module, _, attribute = requirement.partition(":")
        why = importable(module)
        if why is not None:
            return f"{module} not importable ({why})"
        if attribute and not hasattr(sys.modules[module], attribute):
            return f"{module} has no {attribute} (upgrade it)"
    return None


def server_settings(stack: str, workers: int) -> dict[str, Any]:
    if stack == "asgi":
        return {
            "server": "uvicorn",
            "version": version("uvicorn"),
            "workers": 1,
            "loop": "uvloop" if importable("uvloop") is None else "asyncio",
            "http": "httptools" if importable("httptools") is None else "h11",
        }
    return {"server": "gunicorn", "version": version("gunicorn"), "workers": workers,
            "worker_class": "sync"}


def _argv(stack: str, port: int, settings: dict[str, Any]) -> list[str]:
    if stack == "asgi":
        return [sys.executable, "-m", "uvicorn", "bench_asgi_app:app", "--app-dir",
                str(APPS_DIR), "--host", "127.0.0.1", "--port", str(port), "--no-access-log",
                "--log-level", "warning", "--loop", settings["loop"], "--http",
                settings["http"]]
    return [sys.executable, "-m", "gunicorn", "--workers", str(settings["workers"]),
            "--worker-class", "sync", "--bind", f"127.0.0.1:{port}", "--chdir", str(APPS_DIR),
            "--log-level", "warning", "bench_wsgi_app:app"]


def _get(port: int) -> tuple[int, dict[str, str]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/")
        response = conn.getresponse()
        response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}
    finally:
        conn.close()


def _start(configs: list[HttpConfig], stack: str, settings: dict[str, Any], redis_url: str,
           prefix: str) -> None:
    for n, config in enumerate(configs):
        config.port = free_port()
        env = child_env(BENCH_APP=config.app, BENCH_REDIS_URL=redis_url,
                        BENCH_PREFIX=f"{prefix}{n}", BENCH_LIMIT=FLOOD if config.flood else HUGE)
        config.child = Child(config.key, _argv(stack, config.port, settings), env=env)
    deadline = time.monotonic() + 60
    for config in configs:
        child = config.child
        if child is None:
            continue
        while not port_open(config.port):
            if not child.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server {config.key} did not start:\n{child.output()}")
            time.sleep(0.05)


def _probe(config: HttpConfig) -> None:
    """Check that the server limits as configured (a silent misconfiguration would make a
    fast, meaningless row), and make the first refusal of a flood before it is measured."""
    status, headers = _get(config.port)
    if status != 200:
        raise RuntimeError(f"{config.key}: first request answered {status}, expected 200")
    if "-rl-" in config.app and "ratelimit-policy" not in headers:
        raise RuntimeError(f"{config.key}: no RateLimit-Policy header: is the middleware on?")
    if config.flood:
        status, headers = _get(config.port)
        if status != 429:
            raise RuntimeError(f"{config.key}: second request answered {status}, expected 429")


def _command_calls(client: Any) -> dict[str, int]:
    stats = client.info("commandstats")
    calls = {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}
    # The harness's own INFO calls are not the server's traffic.
    calls.pop("info", None)
    return calls


def _settle(client: Any, quiet: float = 0.1, limit: float = 5.0) -> dict[str, int]:
    """Wait until Redis sees no traffic for `quiet` seconds; return its counts then.

    A gunicorn sync worker still answers the requests queued in its backlog after the load
    generator has stopped: without this, the previous server's tail would be counted as this
    one's calls.
    """
    deadline = time.monotonic() + limit
    calls = _command_calls(client)
    while True:
        time.sleep(quiet)
        now = _command_calls(client)
        if now == calls or time.monotonic() > deadline:
            return now
        calls = now


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    delta = {name: after.get(name, 0) - before.get(name, 0) for name in after}
    nonzero = {name: n for name, n in delta.items() if n}
    return {"total": sum(nonzero.values()), "evalsha": nonzero.get("evalsha", 0),
            **{f"cmd:{k}": v for k, v in sorted(nonzero.items())}}


def _load(config: HttpConfig, load: LoadGenerator, stats_client: Any) -> None:
    before = _settle(stats_client) if config.flood else None
    result = load.run(config.url)
    if before is not None:
        # Settled again: the requests still queued when the load stopped count too.
        config.redis_calls.append(_delta(before, _settle(stats_client)))
    config.results.append(result)
    if result.errors:
        log(f"  {config.label}: {result.errors} socket errors")


def run(stack: str, *, redis_url: str, load: LoadGenerator, rounds: int, warmup: float,
        gunicorn_workers: int, private_redis: bool) -> dict[str, Any]:
    """Measure and return the ``asgi`` or ``wsgi`` section of benchmarks.json."""
    configs = asgi_configs() if stack == "asgi" else wsgi_configs()
    for config in configs:
        config.skipped = _missing(config.requires)
        if config.skipped:
            log(f"  skip {config.label}: {config.skipped}")
    active = [c for c in configs if c.skipped is None]
    # A bare app, or a measured one that another row is compared with (the in-flight row).
    named = {c.baseline for c in active}
    baselines = {c.app: c for c in active
                 if not c.flood and (c.app == c.baseline or c.app in named)}
    for config in active:
        if config.baseline not in baselines:
            config.skipped = f"its baseline {config.baseline} is not available"
    active = [c for c in active if c.skipped is None]
    settings = server_settings(stack, gunicorn_workers)
    prefix = f"rlb{int(time.time() * 1000) % 10**8}{stack}"
    import redis

    # One connection for the whole run: a new one would add its own handshake to the counts.
    stats_client = redis.Redis.from_url(redis_url)
    try:
        log(f"  starting {len(active)} {settings['server']} servers")
        _start(active, stack, settings, redis_url, prefix)
        for config in active:
            _probe(config)
            load.warm(config.url, warmup)
        measured = [c for c in active if c.app != c.baseline or c.flood]
        for r in range(rounds):
            # A/B pairs: each configuration right beside a run of its bare app, the pair's
            # order flipped every other round, the pairs' order rotated every round.
            for config in rotated(measured, r):
                base = baselines[config.baseline]
                pair = (base, config) if r % 2 == 0 else (config, base)
                for one in pair:
                    _load(one, load, stats_client)
                rps = base.results[-1].rps
                config.ratios.append(config.results[-1].rps / rps if rps else 0.0)
                if base.app == base.baseline:  # a measured baseline keeps its own ratios
                    base.ratios.append(1.0)
            log(f"  {stack} round {r + 1}/{rounds} done")
    finally:
        for config in configs:
            if config.child is not None:
                config.child.stop()
        stats_client.close()
        if not private_redis:
            delete_prefix(redis_url, prefix)
    rows = []
    for config in configs:
        row: dict[str, Any] = {"label": config.label, "app": config.app,
                               "baseline": baselines[config.baseline].label
                               if config.baseline in baselines else config.baseline,
                               "flood": config.flood, "target": config.target,
                               "skipped": config.skipped}
        if config.results:
            row.update({
                "rps": spread_dict([x.rps for x in config.results]),
                "ratio": spread_dict(config.ratios),
                "p50_ms": spread_dict([x.p50_ms for x in config.results]),
                "p99_ms": spread_dict([x.p99_ms for x in config.results]),
                "non2xx_share": spread_dict([x.non2xx / x.requests if x.requests else 0.0
                                             for x in config.results]),
                "errors": sum(x.errors for x in config.results),
            })
            if config.flood:
                row["redis_calls"] = config.redis_calls
        rows.append(row)
    return {"server": settings, "load": load.describe(), "rounds": rounds,
            "limit_admitted": HUGE, "limit_flood": FLOOD, "algorithm": "fixed-window",
            "redis": "private" if private_redis else redis_url,
            "rows": rows}
