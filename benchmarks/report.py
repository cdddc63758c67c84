"""Tables, the JSON file, the chart and the results block of docs/performance.md.

Everything here reads the results dictionary only, so a partial run (``--only asgi``)
merges into the sections an earlier run left in benchmarks.json and the tables and chart are
drawn again from the whole.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from _util import fmt, fmt_spread, importable

BEGIN = "<!-- benchmarks:begin (written by benchmarks/run.py; edits here are overwritten) -->"
END = "<!-- benchmarks:end -->"
SECTIONS = ("core", "redis_time", "capacity", "asgi", "wsgi", "memory")
CHART_TITLES = {
    "performance.png": "throughput ratios and per-check latency",
    "capacity.png": "fleet capacity per Redis core",
}

PING_TARGET = 1.15
MEMORY_BACKEND_TARGET_US = 5.0


def _mark(ok: bool | None) -> str:
    return "" if ok is None else (" ✓" if ok else " ✗")


# -- core ---------------------------------------------------------------------------------------
def core_table(section: dict[str, Any]) -> str:
    rows: dict[tuple[str, str, str, int], dict[str, dict[str, Any]]] = {}
    for row in section["rows"]:
        key = (row["impl"], row["backend"], row["algorithm"], row["tiers"])
        rows.setdefault(key, {})[row["mode"]] = row
    lines = [
        "| check | backend | tiers | sync µs | sync × PING | async µs | async × PING |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for (impl, backend, algorithm, tiers), modes in rows.items():
        name = "PING" if impl == "PING" else f"{impl} {algorithm}"
        cells = []
        for mode in ("sync", "async"):
            row = modes.get(mode)
            if row is None:
                cells += ["—", "—"]
                continue
            us = fmt_spread(row["us"])
            ratio = row.get("x_ping")
            if impl == "ratelimit_mw" and backend.startswith("memory"):
                us += _mark(row["us"]["median"] <= MEMORY_BACKEND_TARGET_US)
            if impl == "PING":
                ratio_text = "1.00" if backend == "redis" else "—"
            elif ratio:
                ok = ratio["median"] <= PING_TARGET if impl == "ratelimit_mw" else None
                ratio_text = fmt_spread(ratio, 2) + _mark(ok)
            else:
                ratio_text = "—"
            cells += [us, ratio_text]
        lines.append(f"| {name} | {backend} | {tiers or '—'} | " + " | ".join(cells) + " |")
    notes = (
        f"\nµs per admitted check, median of {section['rounds']} rounds of "
        f"{section['checks_per_round']} sequential checks (min–max); × PING: the ratio to a "
        f"PING batch on the same client run right before it (target ≤ {PING_TARGET}, ✓/✗), "
        f"MemoryBackend target ≤ {MEMORY_BACKEND_TARGET_US:g} µs. Tiers: 1 = "
        f"`{section['tiers']['1']}`, 3 = `{section['tiers']['3']}`, rotating over "
        f"{section['identities']:,} identities, `deny_cache=0`. memory: in the default "
        f"rounds every check is its identity's first (its keys created, later swept); "
        f"memory, returning: a pool of "
        f"{section.get('returning_identities', 1000):,} identities, each hit once "
        f"before the rounds; {_memory_backends(section)}. `limits`: one `hit` (one "
        f"round trip) per limit, as slowapi and Flask-Limiter call it; sliding-log ↔ "
        f"MovingWindowRateLimiter, sliding-window ↔ SlidingWindowCounterRateLimiter. Async "
        f"event loop: {section['event_loop']}. The time Redis spends inside each check is the "
        f"next table's."
    )
    return "\n".join(lines) + "\n" + notes


# -- time inside Redis ---------------------------------------------------------------------------
def _memory_backends(section: dict[str, Any]) -> str:
    if section.get("memory_backend_per_row"):
        return "every memory row on a MemoryBackend of its own"
    # How runs before core_latency._own_memory measured (their JSON lacks the key).
    return ("one MemoryBackend shared by the `memory` rows, another by the `memory, "
            "returning` rows, so a row's first batch of a round also swept what the others "
            "had left to expire")


def _calls_text(calls: dict[str, float]) -> str:
    return ", ".join(f"{name} {n:g}" for name, n in calls.items())


def _floor_text(row: dict[str, Any] | None) -> str:
    if row is None:
        return "—"
    ratio = row.get("x_limits")
    return fmt_spread(row["usec"], 2) + (f" ({ratio['median']:.2f}×)" if ratio else "")


def redis_time_table(section: dict[str, Any]) -> str:
    target = section["target_x_limits"]
    lines = [
        "| algorithm | tiers | ratelimit_mw µs | limits µs | ours × limits | INCR+PEXPIRE µs "
        "| TIME floor µs (× limits) | commands per check: ours / limits |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    rows = {(r["impl"], r["algorithm"], r["tiers"]): r for r in section["rows"]}
    keys = sorted({(r["algorithm"], r["tiers"]) for r in section["rows"]},
                  key=lambda k: ([r["algorithm"] for r in section["rows"]].index(k[0]), k[1]))
    for algorithm, tiers in keys:
        ours = rows.get(("ratelimit_mw", algorithm, tiers))
        peer = rows.get(("limits", algorithm, tiers))
        plain = rows.get(("INCR+PEXPIRE", algorithm, tiers))
        clock = rows.get(("TIME floor", algorithm, tiers))
        ratio = ours.get("x_limits") if ours else None
        ratio_text = (fmt_spread(ratio, 2) + _mark(ratio["median"] <= target)) if ratio else "—"
        calls = " / ".join(_calls_text(r["calls_per_check"]) if r else "—" for r in (ours, peer))
        lines.append(
            f"| {algorithm} | {tiers} | {fmt_spread(ours['usec'], 2) if ours else '—'} | "
            f"{fmt_spread(peer['usec'], 2) if peer else '—'} | {ratio_text} | "
            f"{fmt_spread(plain['usec'], 2) if plain else '—'} | {_floor_text(clock)} | {calls} |"
        )
    notes = (
        f"\nµs Redis spent executing the commands one admitted check sends (INFO commandstats "
        f"usec on a private redis-server, summed over the commands the client sent: a script's "
        f"usec already holds the commands it calls, listed at the right, which are not added "
        f"again), median of {section['rounds']} interleaved rounds of "
        f"{section['checks_per_round']} sequential checks (min–max). ours × limits: the ratio "
        f"in the same round (target ≤ {target}, ✓/✗). limits: one `hit` per limit, as "
        f"slowapi and Flask-Limiter call it (no GCRA there). INCR+PEXPIRE: the plain "
        f"fixed-window counter, one INCR and one PEXPIRE per tier in one pipeline. TIME floor: "
        f"a script that only reads Redis's clock and returns (no key touched), what any check "
        f"deciding on Redis's clock pays at least; limits decides on the app server's clock "
        f"(a fixed window from its first hit, a moving window stamped with `time.time()`), "
        f"so where the floor's own ratio is above {target} no exact script on Redis's clock "
        f"meets the target. Tiers as in the latency table, {section['identities']:,} "
        f"identities, all admitted."
    )
    return "\n".join(lines) + "\n" + notes


# -- fleet capacity -----------------------------------------------------------------------------
CAPACITY_IMPLS = ("ratelimit_mw", "limits", "INCR+PEXPIRE")


def capacity_table(section: dict[str, Any]) -> str:
    lines = [
        "| algorithm | tiers | implementation | checks per Redis core-second | checks/s "
        "| Redis CPU | in Redis µs / check | × limits (per core) |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    rows = {(r["impl"], r["algorithm"], r["tiers"]): r for r in section["rows"]}
    for row in section["rows"]:
        peer = rows.get(("limits", row["algorithm"], row["tiers"]))
        if row["impl"] != "limits" and peer and peer["per_redis_core"]["median"]:
            ratio = f"{row['per_redis_core']['median'] / peer['per_redis_core']['median']:.2f}"
        else:
            ratio = "—"
        cpu = row["redis_cpu"]
        lines.append(
            f"| {row['algorithm']} | {row['tiers']} | {row['impl']} | "
            f"{fmt_spread(row['per_redis_core'], 0)} | {fmt_spread(row['checks_per_s'], 0)} | "
            f"{cpu['median'] * 100:.0f}% ({cpu['min'] * 100:.0f}–{cpu['max'] * 100:.0f}%) | "
            f"{fmt_spread(row['redis_us'], 1)} | {ratio} |"
            + (f" ({row['errors']} failed checks)" if row.get("errors") else "")
        )
    notes = (
        f"\nA private redis-server loaded by {section['processes']} client processes "
        f"({section['cpus']} CPUs on this machine), each on {section['event_loop']} with "
        f"{section['concurrency']} checks in flight, {section['duration_s']:g} s measured per "
        f"configuration and round, {section['rounds']} interleaved rounds, median (min–max). "
        f"checks/s: admitted checks completed by all clients; Redis CPU: the main thread's CPU "
        f"time over the window (INFO cpu) as a share of one core; checks per Redis "
        f"core-second = checks/s ÷ Redis CPU: what one fully busy Redis core (one Redis, or "
        f"one cluster shard) sustains for the whole fleet. Where Redis CPU is well below "
        f"100%, the clients, not Redis, were the limit (a small machine): the per-core figure "
        f"is then the one that measures Redis, and it is a lower bound (a busier Redis reads "
        f"more commands per wake-up). ratelimit_mw: AsyncLimiter on AsyncRedisBackend; limits: "
        f"limits.aio strategies, one hit per limit; INCR+PEXPIRE: the plain counter floor, "
        f"written raw and pipelined. × limits: the per-core ratio of the medians."
    )
    return "\n".join(lines) + "\n" + notes


# -- HTTP ---------------------------------------------------------------------------------------
def _flood_calls_text(row: dict[str, Any]) -> str:
    calls = row.get("redis_calls")
    if not calls:
        return "—"
    return ", ".join(f"{c['evalsha']} ({c['total']})" for c in calls)


def flood_call_bound(section: dict[str, Any]) -> int:
    """The most script calls a flood may cost in one run: the deny cache's age bound
    (`deny_cache_max_age`, 1 s by default: how soon a reset made elsewhere must be seen)
    lets each worker ask the store once per second, plus the refusal it started from."""
    workers = section["server"].get("workers") or 1
    return int(workers * (math.ceil(section["load"]["duration_s"]) + 1))


def _target_text(row: dict[str, Any], call_bound: int) -> str:
    target = row.get("target")
    ratio = row.get("ratio")
    if target is None or not ratio:
        return ""
    ok = ratio["median"] >= target
    text = f"≥ {target:.2f}"
    if row.get("flood"):
        calls = row.get("redis_calls") or []
        ok = ok and all(c["evalsha"] <= call_bound for c in calls)
        text += f", ≤ {call_bound} calls"
    return text + _mark(ok)


def http_table(section: dict[str, Any], title: str) -> str:
    server = section["server"]
    load = section["load"]
    lines = [
        "| configuration | req/s | × bare | p50 ms | p99 ms | non-2xx | Redis calls in flood "
        "| target |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    skipped = []
    call_bound = flood_call_bound(section)
    for row in section["rows"]:
        if row.get("skipped"):
            skipped.append(f"- {row['label']}: skipped, {row['skipped']}")
            continue
        non2xx = row["non2xx_share"]["median"] * 100
        is_bare = row["baseline"] == row["label"]
        ratio = "1.00" if is_bare else fmt_spread(row["ratio"], 2)
        lines.append(
            f"| {row['label']} | {fmt_spread(row['rps'], 0)} | {ratio} | "
            f"{fmt(row['p50_ms']['median'], 2)} | {fmt(row['p99_ms']['median'], 2)} | "
            f"{non2xx:.0f}% | {_flood_calls_text(row)} | {_target_text(row, call_bound)} |"
        )
    if server["server"] == "uvicorn":
        where = (f"uvicorn {server['version']}, 1 worker, loop={server['loop']}, "
                 f"http={server['http']}, --no-access-log")
    else:
        where = (f"gunicorn {server['version']}, {server['workers']} {server['worker_class']} "
                 f"worker(s)")
    notes = [
        "",
        f"{title}: {where}; load: {load['tool']}, {load['threads']} thread, "
        f"{load['connections']} connections, {load['duration_s']:g} s per run, "
        f"{section['rounds']} round(s). × bare: throughput over that of the bare app loaded "
        f"right beside it (A/B pairs, order flipped every other round), median (min–max). "
        f"Every limiter checks every request by client IP (one identity: all load comes "
        f"from 127.0.0.1) with {section['algorithm']} and limit `{section['limit_admitted']}` "
        f"(all admitted); flood rows: limit `{section['limit_flood']}`, every request after "
        f"the first refused; Redis calls = script calls (EVALSHA; in parentheses every "
        f"command, those the script ran included) the Redis server ran during each flood "
        f"run (INFO commandstats delta on a {section['redis']} server, one figure per round); "
        f"the bound, {call_bound}, is one call per worker per second of the run plus one: "
        f"the deny cache answers a refusal in process for at most `deny_cache_max_age` "
        f"(1 s), so that a reset made elsewhere is seen within it.",
    ]
    if load["tool"] != "wrk":
        notes.append("The built-in Python load generator was used (no wrk, or --builtin-load): it "
                     "caps the bare app's throughput, so every ratio is pulled towards 1.")
    return "\n".join(lines + notes + (["", *skipped] if skipped else []))


# -- memory -------------------------------------------------------------------------------------
def memory_table(section: dict[str, Any]) -> str:
    lines = [
        "| state per identity | keys | encoding | MEMORY USAGE (B) | used_memory / identity (B) "
        "| target |",
        "|---|---:|---|---:|---:|---|",
    ]
    for row in section["rows"]:
        target = row.get("target_bytes")
        mark = (f"≤ {target} B" + _mark(row["memory_usage_bytes"] <= target)) if target else ""
        lines.append(
            f"| {row['label']} | {row['keys']} | {', '.join(row['encodings'])} | "
            f"{row['memory_usage_bytes']:,} | {row['used_memory_per_identity']:,.0f} "
            f"(n={row['identities']:,}) | {mark} |"
        )
    notes = (
        f"\nPrivate redis-server {section['redis_server']} ({section['allocator']}), keys as "
        f"the middleware writes them (`rl:{{ip:10.0.0.0}}:100/minute.fw:60000`). MEMORY USAGE "
        f"(SAMPLES 0) of the keys one identity leaves; used_memory / identity: the server's "
        f"growth over n identities divided by n (adds its key and expiry dictionaries)."
    )
    return "\n".join(lines) + "\n" + notes


# -- the whole ----------------------------------------------------------------------------------
def _meta_text(results: dict[str, Any]) -> str:
    env = results.get("environment", {})
    pkgs = env.get("packages", {})
    shown = ", ".join(f"{name} {v}" for name, v in pkgs.items() if v)
    runs = []
    for name in SECTIONS:
        run = results.get(name, {}).get("run")
        if run:
            runs.append(f"{name}: {run['date']}{' (--quick: noisy)' if run['quick'] else ''}")
    loads = []
    for name in SECTIONS:
        run = results.get(name, {}).get("run") or {}
        if run.get("load_average_before"):
            loads.append(f"{name} {run['load_average_before'][0]:g} → "
                         f"{(run.get('load_average_after') or ['?'])[0]}")
    return (
        f"Machine: {env.get('cpu_model') or 'CPU model unknown'}, {env.get('cpus')} CPUs, "
        f"{env.get('platform')}, Python {env.get('python')}, Redis "
        f"{env.get('redis_server')} (private server), revision {env.get('revision')}.  \n"
        f"Packages: {shown}.  \nLoad generator: wrk "
        f"{env.get('wrk_source') or env.get('wrk') or 'not installed'}.  \n"
        f"Runs: {'; '.join(runs)}.  \n"
        f"1-minute load average before → after each section (other work on the machine: "
        f"above ~1 on 2 CPUs the figures are noisy; the ranges show how much): "
        f"{'; '.join(loads) or 'not recorded'}."
    )


def render(results: dict[str, Any]) -> str:
    parts = ["### Environment", "", _meta_text(results)]
    titles = {
        "core": "Per-check latency",
        "redis_time": "Time inside Redis per check",
        "capacity": "Fleet capacity per Redis core",
        "asgi": "ASGI throughput (Starlette, FastAPI, Litestar)",
        "wsgi": "WSGI throughput (Flask)",
        "memory": "Redis memory per identity",
    }
    for name in SECTIONS:
        section = results.get(name)
        if not section:
            continue
        if name == "core":
            table = core_table(section)
        elif name == "redis_time":
            table = redis_time_table(section)
        elif name == "capacity":
            table = capacity_table(section)
        elif name == "memory":
            table = memory_table(section)
        else:
            table = http_table(section, titles[name])
        parts += ["", f"### {titles[name]}", "", table]
    return "\n".join(parts) + "\n"


def load(path: Path) -> dict[str, Any]:
    if path.exists():
        try:
            data = json.loads(path.read_text())
            if isinstance(data, dict):
                return data
        except json.JSONDecodeError:
            pass
    return {}


def save(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, sort_keys=False, default=_json_default)
                    + "\n")


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    raise TypeError(f"cannot write {value!r} to JSON")


def update_doc(doc: Path, markdown: str) -> bool:
    """Replace the marked results block of `doc`; False when it has none."""
    if not doc.exists():
        return False
    text = doc.read_text()
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.DOTALL)
    if not pattern.search(text):
        return False
    doc.write_text(pattern.sub(lambda _m: f"{BEGIN}\n{markdown}\n{END}", text, count=1))
    return True


# -- charts --------------------------------------------------------------------------------------
def charts(results: dict[str, Any], out: Path) -> dict[str, str | None]:
    """Draw every chart into `out`: file name -> None, or why it was not drawn."""
    return {"performance.png": chart(results, out / "performance.png"),
            "capacity.png": capacity_chart(results, out / "capacity.png")}


def capacity_chart(results: dict[str, Any], path: Path) -> str | None:
    """Grouped bars: checks per Redis core-second, per algorithm × tiers, per implementation."""
    section = results.get("capacity")
    if not section:
        return "no capacity results"
    why = importable("matplotlib")
    if why is not None:
        return f"matplotlib not importable ({why}): pip install matplotlib"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {(r["impl"], r["algorithm"], r["tiers"]): r for r in section["rows"]}
    groups: list[tuple[str, int]] = []
    for r in section["rows"]:
        if (r["algorithm"], r["tiers"]) not in groups:
            groups.append((r["algorithm"], r["tiers"]))
    colors = {"ratelimit_mw": "tab:blue", "limits": "tab:orange", "INCR+PEXPIRE": "tab:gray"}
    width = 0.27
    fig, ax = plt.subplots(figsize=(11, 4.8))
    for i, impl in enumerate(CAPACITY_IMPLS):
        xs, med, lo, hi = [], [], [], []
        for g, (algorithm, tiers) in enumerate(groups):
            row = rows.get((impl, algorithm, tiers))
            if row is None:
                continue
            d = row["per_redis_core"]
            xs.append(g + (i - 1) * width)
            med.append(d["median"] / 1000)
            lo.append((d["median"] - d["min"]) / 1000)
            hi.append((d["max"] - d["median"]) / 1000)
        if xs:
            label = impl if impl != "INCR+PEXPIRE" else "plain INCR+PEXPIRE (floor)"
            ax.bar(xs, med, width=width, yerr=[lo, hi], capsize=2, color=colors[impl],
                   label=label)
    ax.set_xticks(range(len(groups)),
                  [f"{a}\n{t} tier{'s' * (t > 1)}" for a, t in groups], fontsize=8)
    ax.set_ylabel("thousand checks per Redis core-second")
    ax.set_title(f"Fleet capacity per Redis core ({section['processes']} client processes × "
                 f"{section['concurrency']} in flight; median, bars min–max)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", linewidth=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def chart(results: dict[str, Any], path: Path) -> str | None:
    """Draw the chart; the reason when it cannot be drawn."""
    why = importable("matplotlib")
    if why is not None:
        return f"matplotlib not importable ({why}): pip install matplotlib"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    http_rows = [(name, row) for name in ("asgi", "wsgi")
                 for row in results.get(name, {}).get("rows", [])
                 if row.get("ratio") and row["baseline"] != row["label"]]
    core_rows = [row for row in results.get("core", {}).get("rows", [])
                 if row["backend"] == "redis"]
    panels = int(bool(http_rows)) + int(bool(core_rows))
    if panels == 0:
        return "nothing to draw"
    height = max(4.0, 0.32 * max(len(http_rows), len(core_rows) // 2 + 1) + 1.5)
    fig, axes = plt.subplots(1, panels, figsize=(8 * panels, height), squeeze=False)
    ax_iter = iter(axes[0])
    if http_rows:
        ax = next(ax_iter)
        labels = [f"{name}: {row['label']}" for name, row in http_rows]
        med = [row["ratio"]["median"] for _, row in http_rows]
        err = [[row["ratio"]["median"] - row["ratio"]["min"] for _, row in http_rows],
               [row["ratio"]["max"] - row["ratio"]["median"] for _, row in http_rows]]
        colors = ["tab:blue" if "ratelimit_mw" in row["label"] else
                  ("tab:gray" if "floor" in row["label"] else "tab:orange")
                  for _, row in http_rows]
        ax.barh(range(len(labels)), med, xerr=err, color=colors, capsize=3)
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        ax.invert_yaxis()
        for x, text in ((0.6, "ASGI target"), (0.7, "Flask target"), (0.9, "flood target")):
            ax.axvline(x, linestyle="--", linewidth=0.8, color="black")
            ax.text(x, 1.0, f" {text}", fontsize=7, rotation=90, va="bottom",
                    transform=ax.get_xaxis_transform())
        ax.set_xlim(0, max(1.05, max(med) * 1.1))
        ax.set_xlabel("throughput × bare app run beside it (median; bars: min–max)")
        ax.set_title("Middleware throughput (blue: ratelimit_mw, orange: peers, gray: floor)",
                     fontsize=9, pad=48)
    if core_rows:
        ax = next(ax_iter)
        names = []
        for row in core_rows:
            name = f"{row['label']}"
            if name not in names:
                names.append(name)
        width = 0.4
        for i, mode in enumerate(("sync", "async")):
            by_name = {r["label"]: r for r in core_rows if r["mode"] == mode}
            values = [by_name[n]["us"]["median"] if n in by_name else 0.0 for n in names]
            ax.barh([k + (i - 0.5) * width for k in range(len(names))], values, height=width,
                    label=mode, color="tab:blue" if mode == "sync" else "tab:green")
        for mode, color in (("sync", "tab:blue"), ("async", "tab:green")):
            ping = next((r for r in core_rows if r["impl"] == "PING" and r["mode"] == mode),
                        None)
            if ping is not None:
                ax.axvline(ping["us"]["median"] * PING_TARGET, linestyle="--", linewidth=0.8,
                           color=color, label=f"{mode} target: PING × {PING_TARGET}")
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("µs per admitted check (median), Redis")
        ax.set_title("Per-check latency beside PING and limits (same Redis)", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
