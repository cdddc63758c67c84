"""Tables, the JSON file, the chart and the results block of docs/performance.md.

Everything here reads the results dictionary only, so a partial run (``--only asgi``)
merges into the sections an earlier run left in benchmarks.json and the tables and chart are
drawn again from the whole; ``python benchmarks/report.py [DIR]`` redraws the results block of
DIR/performance.md from DIR/benchmarks.json alone. Every line of the block fits in WIDTH.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from _util import REPO, fmt, fmt_spread, importable

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


# -- layout: every line of the block fits in WIDTH ------------------------------------------
WIDTH = 120  # the longest line the results block may have
PROSE = 100  # where prose is wrapped
# A word that would open a list, a quote, a heading or a table when it starts a line.
_OPENS_BLOCK = re.compile(r"^([-+*>|=]|#+|\d+[.)])$")
_GLUED = ("×", "≤", "≥", "÷", "=")  # kept on the line of the word that follows them


def wrap(text: str, first: str = "", rest: str = "", width: int = PROSE) -> list[str]:
    """Greedy word wrap at `width`; `first` opens the first line, `rest` the others.

    Words are never broken (a code span without spaces stays whole), a word that markdown
    would read as the start of a block (`-`, `+`, `1.`, `#`, ...) never starts a line, and
    `×`, `≤`, `≥` stay with their operand while the line stays within WIDTH.
    """
    lines: list[str] = []
    line, prev = first, ""
    for word in text.split():
        if not prev:
            line += word
        elif len(line) + 1 + len(word) <= width or _OPENS_BLOCK.match(word) or (
                prev in _GLUED and len(line) + 1 + len(word) <= WIDTH):
            line += " " + word
        else:
            lines.append(line)
            line = rest + word
        prev = word
    lines.append(line)
    return lines


def _paragraph(text: str) -> str:
    return "\n".join(wrap(text))


def _bullet(text: str) -> str:
    return "\n".join(wrap(text, "- ", "  "))


def table(header: list[str], align: str, rows: list[list[str]], keys: int = 1) -> str:
    """A markdown table; `align` is one letter per column (l or r).

    When a row would be wider than WIDTH, the columns after the first `keys` are dealt into
    several tables, each repeating the key columns, so that no figure is cut.
    """
    def width(columns: list[int]) -> int:
        return max(1 + sum(len(row[i]) + 3 for i in columns) for row in [header, *rows])

    groups: list[list[int]] = [list(range(len(header)))]
    if width(groups[0]) > WIDTH:
        groups = []
        for i in range(keys, len(header)):
            if groups and width([*groups[-1], i]) <= WIDTH:
                groups[-1].append(i)
            else:
                groups.append([*range(keys), i])

    def one(columns: list[int]) -> str:
        return "\n".join([
            "| " + " | ".join(header[i] for i in columns) + " |",
            "|" + "|".join("---:" if align[i] == "r" else "---" for i in columns) + "|",
            *("| " + " | ".join(row[i] for i in columns) + " |" for row in rows),
        ])

    return "\n\n".join(one(columns) for columns in groups)


# -- core ---------------------------------------------------------------------------------------
def _us_text(row: dict[str, Any] | None, impl: str, backend: str) -> str:
    if row is None:
        return "—"
    us = fmt_spread(row["us"])
    if impl == "ratelimit_mw" and backend.startswith("memory"):
        us += _mark(row["us"]["median"] <= MEMORY_BACKEND_TARGET_US)
    return us


def _ping_ratio_text(row: dict[str, Any] | None, impl: str, backend: str) -> str:
    if row is None:
        return "—"
    if impl == "PING":
        return "1.00" if backend == "redis" else "—"
    ratio = row.get("x_ping")
    if not ratio:
        return "—"
    return fmt_spread(ratio, 2) + _mark(ratio["median"] <= PING_TARGET
                                        if impl == "ratelimit_mw" else None)


def core_table(section: dict[str, Any]) -> str:
    rows: dict[tuple[str, str, str, int], dict[str, dict[str, Any]]] = {}
    for row in section["rows"]:
        key = (row["impl"], row["backend"], row["algorithm"], row["tiers"])
        rows.setdefault(key, {})[row["mode"]] = row
    on_redis: list[list[str]] = []
    in_memory: dict[tuple[str, str, int], dict[str, str]] = {}
    for (impl, backend, algorithm, tiers), modes in rows.items():
        sync, async_ = modes.get("sync"), modes.get("async")
        if backend.startswith("memory"):
            cells = in_memory.setdefault((impl, algorithm, tiers), {})
            short = backend.removeprefix("memory, ")
            for mode, row in (("sync", sync), ("async", async_)):
                cells[f"{short} {mode} µs"] = _us_text(row, impl, backend)
            continue
        if impl == "PING":
            name = "PING" if backend == "redis" else f"PING ({backend})"
        else:
            name = f"{impl} {algorithm}" + ("" if backend == "redis" else f" ({backend})")
        on_redis.append([name, str(tiers or "—"),
                         _us_text(sync, impl, backend), _ping_ratio_text(sync, impl, backend),
                         _us_text(async_, impl, backend), _ping_ratio_text(async_, impl, backend)])
    notes = (
        f"µs per admitted check: median (min–max) of {section['rounds']} rounds of "
        f"{section['checks_per_round']} sequential checks; sync: `Limiter`, async: "
        f"`AsyncLimiter` on {section['event_loop']}. × PING: over a PING batch on the same "
        f"client run right before it (target ≤ {PING_TARGET}); MemoryBackend target ≤ "
        f"{MEMORY_BACKEND_TARGET_US:g} µs. Tiers: 1 = `{section['tiers']['1']}`, 3 = "
        f"`{section['tiers']['3']}`; identities rotate over {section['identities']:,}, "
        f"`deny_cache=0`. memory: every check its identity's first; memory, returning: a pool "
        f"of {section.get('returning_identities', 1000):,} identities, each hit once before "
        f"the rounds; {_memory_backends(section)}."
    )
    tables = []
    for k, mode in enumerate(("sync", "async")):
        body = [[name, tiers, *cells[2 * k:2 * k + 2]] for name, tiers, *cells in on_redis
                if cells[2 * k] != "—"]
        if body:
            tables.append(table(["check, on Redis", "tiers", f"{mode} µs", f"{mode} × PING"],
                                "lrrr", body, keys=2))
    columns = list(dict.fromkeys(c for cells in in_memory.values() for c in cells))
    if in_memory:
        tables.append(table(
            ["check, in process", "tiers", *columns], "lr" + "r" * len(columns),
            [[f"{impl} {algorithm}", str(tiers), *(cells.get(c, "—") for c in columns)]
             for (impl, algorithm, tiers), cells in in_memory.items()], keys=2))
    return "\n\n".join([*tables, _paragraph(notes)])


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
    rows = {(r["impl"], r["algorithm"], r["tiers"]): r for r in section["rows"]}
    keys = sorted({(r["algorithm"], r["tiers"]) for r in section["rows"]},
                  key=lambda k: ([r["algorithm"] for r in section["rows"]].index(k[0]), k[1]))
    against: list[list[str]] = []
    floors: list[list[str]] = []
    calls: list[list[str]] = []
    for algorithm, tiers in keys:
        ours = rows.get(("ratelimit_mw", algorithm, tiers))
        peer = rows.get(("limits", algorithm, tiers))
        plain = rows.get(("INCR+PEXPIRE", algorithm, tiers))
        clock = rows.get(("TIME floor", algorithm, tiers))
        ratio = ours.get("x_limits") if ours else None
        ratio_text = (fmt_spread(ratio, 2) + _mark(ratio["median"] <= target)) if ratio else "—"
        against.append([algorithm, str(tiers), fmt_spread(ours["usec"], 2) if ours else "—",
                        fmt_spread(peer["usec"], 2) if peer else "—", ratio_text])
        floors.append([algorithm, str(tiers), fmt_spread(plain["usec"], 2) if plain else "—",
                       _floor_text(clock)])
        calls += [[algorithm, str(tiers), r["impl"], _calls_text(r["calls_per_check"])]
                  for r in (ours, peer) if r]
    notes = (
        f"µs Redis spent executing the commands of one admitted check (INFO commandstats usec "
        f"of the commands the client sent, on a private redis-server; a script's usec already "
        f"holds the commands it calls, listed in the last table but not added again): median "
        f"(min–max) of {section['rounds']} interleaved rounds of {section['checks_per_round']} "
        f"sequential checks over {section['identities']:,} identities, tiers as in the "
        f"latency tables. ours × limits: in the same round, target ≤ {target}. TIME floor: a "
        f"script that only reads Redis's clock; where its ratio to limits is above {target}, no "
        f"exact script on Redis's clock can meet the target."
    )
    return "\n\n".join([
        table(["algorithm", "tiers", "ratelimit_mw µs", "limits µs", "ours × limits"],
              "lrrrr", against, keys=2),
        table(["algorithm", "tiers", "INCR+PEXPIRE µs", "TIME floor µs (× limits)"],
              "lrrr", floors, keys=2),
        table(["algorithm", "tiers", "implementation", "commands per check"], "lrll", calls,
              keys=3),
        _paragraph(notes),
    ])


# -- fleet capacity -----------------------------------------------------------------------------
CAPACITY_IMPLS = ("ratelimit_mw", "limits", "INCR+PEXPIRE")


def capacity_table(section: dict[str, Any]) -> str:
    rows = {(r["impl"], r["algorithm"], r["tiers"]): r for r in section["rows"]}
    per_core, parts = [], []
    for row in section["rows"]:
        peer = rows.get(("limits", row["algorithm"], row["tiers"]))
        if row["impl"] != "limits" and peer and peer["per_redis_core"]["median"]:
            ratio = f"{row['per_redis_core']['median'] / peer['per_redis_core']['median']:.2f}"
        else:
            ratio = "—"
        impl = row["impl"] + (f" ({row['errors']} failed checks)" if row.get("errors") else "")
        key = [row["algorithm"], str(row["tiers"]), impl]
        cpu = row["redis_cpu"]
        per_core.append([*key, fmt_spread(row["per_redis_core"], 0), ratio])
        parts.append([
            *key, fmt_spread(row["checks_per_s"], 0),
            f"{cpu['median'] * 100:.0f}% ({cpu['min'] * 100:.0f}–{cpu['max'] * 100:.0f}%)",
            fmt_spread(row["redis_us"], 1),
        ])
    notes = (
        f"A private redis-server loaded by {section['processes']} client processes "
        f"({section['cpus']} CPUs on this machine), each on {section['event_loop']} with "
        f"{section['concurrency']} checks in flight; {section['duration_s']:g} s per "
        f"configuration and round, {section['rounds']} interleaved rounds, median (min–max). "
        f"Checks per Redis core-second = checks/s ÷ Redis CPU (the main thread's CPU time over "
        f"the window, INFO cpu); × limits: the per-core ratio of the medians. Where Redis CPU "
        f"is well below 100%, the clients were the limit and the per-core figure is a lower "
        f"bound."
    )
    return "\n\n".join([
        table(["algorithm", "tiers", "implementation", "checks per Redis core-second",
               "× limits (per core)"], "lrlrr", per_core, keys=3),
        table(["algorithm", "tiers", "implementation", "checks/s", "Redis CPU",
               "in Redis µs / check"], "lrlrrr", parts, keys=3),
        _paragraph(notes),
    ])


# -- HTTP ---------------------------------------------------------------------------------------
FLOOD_PREFIX = "flood, 1 refused client: "


def flood_call_bound(section: dict[str, Any]) -> int:
    """The most script calls a flood may cost in one run: the deny cache's age bound
    (`deny_cache_max_age`, 1 s by default: how soon a reset made elsewhere must be seen)
    lets each worker ask the store once per second, plus the refusal it started from."""
    workers = section["server"].get("workers") or 1
    return int(workers * (math.ceil(section["load"]["duration_s"]) + 1))


def _ratio_target(row: dict[str, Any]) -> str:
    target = row.get("target")
    ratio = row.get("ratio")
    if target is None or not ratio:
        return ""
    return f"≥ {target:.2f}" + _mark(ratio["median"] >= target)


def _calls_target(row: dict[str, Any], call_bound: int) -> str:
    if row.get("target") is None or not row.get("ratio"):
        return ""
    calls = row.get("redis_calls") or []
    return f"≤ {call_bound}" + _mark(all(c["evalsha"] <= call_bound for c in calls))


def http_table(section: dict[str, Any]) -> str:
    server = section["server"]
    load = section["load"]
    admitted, flood, flood_calls, skipped = [], [], [], []
    call_bound = flood_call_bound(section)
    for row in section["rows"]:
        if row.get("skipped"):
            skipped.append(_bullet(f"{row['label']}: skipped, {row['skipped']}"))
            continue
        is_bare = row["baseline"] == row["label"]
        cells = [
            fmt_spread(row["rps"], 0), "1.00" if is_bare else fmt_spread(row["ratio"], 2),
            fmt(row["p50_ms"]["median"], 2), fmt(row["p99_ms"]["median"], 2),
            f"{row['non2xx_share']['median'] * 100:.0f}%", _ratio_target(row),
        ]
        if not row.get("flood"):
            admitted.append([row["label"], *cells])
            continue
        name = row["label"].removeprefix(FLOOD_PREFIX)
        flood.append([name, *cells])
        calls = row.get("redis_calls") or []
        flood_calls.append([name, ", ".join(str(c["evalsha"]) for c in calls) or "—",
                            ", ".join(str(c["total"]) for c in calls) or "—",
                            _calls_target(row, call_bound)])
    header = ["req/s", "× bare", "p50 ms", "p99 ms", "non-2xx", "target"]
    all_2xx = all(cells[5] == "0%" for cells in admitted)
    if all_2xx:  # the column would say 0% on every row: the notes say it once
        admitted = [[*cells[:5], cells[6]] for cells in admitted]
    tables = []
    if admitted:
        columns = [h for h in header if not (all_2xx and h == "non-2xx")]
        tables.append(table(["configuration, all admitted", *columns],
                            "lrrrr" + "r" * (not all_2xx) + "l", admitted))
    if flood:
        tables.append(table(["flood, 1 refused client", *header], "lrrrrrl", flood))
        tables.append(table(["flood, 1 refused client", "Redis script calls, per round",
                             "every command, per round", "target"], "lrrl", flood_calls))
    if server["server"] == "uvicorn":
        where = (f"uvicorn {server['version']}, 1 worker, loop={server['loop']}, "
                 f"http={server['http']}, --no-access-log")
    else:
        where = (f"gunicorn {server['version']}, {server['workers']} {server['worker_class']} "
                 f"worker(s)")
    notes = [
        f"{where}; load: {load['tool']}, {load['threads']} thread, {load['connections']} "
        f"connections, {load['duration_s']:g} s per run, {section['rounds']} round(s). × bare: "
        f"over the bare app loaded right beside it (A/B pairs, order flipped every other "
        f"round), median (min–max); p50, p99, non-2xx: medians"
        + (" (non-2xx: 0% in every admitted run)" if admitted and all_2xx else "")
        + f". Every limiter checks every request by client IP (one identity) with "
        f"{section['algorithm']}: all admitted with `{section['limit_admitted']}`; flood with "
        f"`{section['limit_flood']}`, every request after the first refused. Redis calls: the "
        f"script calls (EVALSHA) and every command the {section['redis']} Redis server ran in "
        f"each flood run (INFO commandstats); the bound, {call_bound}, is one call per worker "
        f"per second of the run plus one (`deny_cache_max_age`, 1 s).",
    ]
    if load["tool"] != "wrk":
        notes.append("The built-in Python load generator was used (no wrk, or --builtin-load): it "
                     "caps the bare app's throughput, so every ratio is pulled towards 1.")
    blocks = [*tables, *(_paragraph(n) for n in notes)]
    if skipped:
        blocks.append("\n".join(skipped))
    return "\n\n".join(blocks)


# -- memory -------------------------------------------------------------------------------------
def memory_table(section: dict[str, Any]) -> str:
    body = []
    for row in section["rows"]:
        target = row.get("target_bytes")
        mark = (f"≤ {target} B" + _mark(row["memory_usage_bytes"] <= target)) if target else ""
        body.append([row["label"], str(row["keys"]), ", ".join(row["encodings"]),
                     f"{row['memory_usage_bytes']:,}",
                     f"{row['used_memory_per_identity']:,.0f} (n={row['identities']:,})", mark])
    notes = (
        f"Private redis-server {section['redis_server']} ({section['allocator']}), keys as "
        f"the middleware writes them (`rl:{{ip:10.0.0.0}}:100/minute.fw:60000`). MEMORY USAGE "
        f"(SAMPLES 0) of the keys one identity leaves; used_memory / identity: the server's "
        f"growth over n identities divided by n (adds its key and expiry dictionaries)."
    )
    header = ["state per identity", "keys", "encoding", "MEMORY USAGE (B)",
              "used_memory / identity (B)", "target"]
    return table(header, "lrlrrl", body) + "\n\n" + _paragraph(notes)


# -- the whole ----------------------------------------------------------------------------------
def _meta_text(results: dict[str, Any]) -> str:
    env = results.get("environment", {})
    pkgs = env.get("packages", {})
    shown = ", ".join(f"{name} {v}" for name, v in pkgs.items() if v)
    items = [
        f"Machine: {env.get('cpu_model') or 'CPU model unknown'}, {env.get('cpus')} CPUs, "
        f"{env.get('platform')}, Python {env.get('python')}, Redis "
        f"{env.get('redis_server')} (private server), revision {env.get('revision')}.",
        f"Packages: {shown}.",
        f"Load generator: wrk {env.get('wrk_source') or env.get('wrk') or 'not installed'}.",
    ]
    runs = []
    for name in SECTIONS:
        run = results.get(name, {}).get("run")
        if not run:
            continue
        before = run.get("load_average_before")
        after = run.get("load_average_after") or ["?"]
        runs.append([name, run["date"] + (" (--quick: noisy)" if run["quick"] else ""),
                     f"{before[0]:g} → {after[0]}" if before else "not recorded"])
    text = "\n".join(_bullet(item) for item in items)
    if runs:
        text += "\n\n" + table(["section", "run", "1-minute load average before → after"],
                                "lll", runs)
        text += "\n\n" + _paragraph(
            "A load average above ~1 on 2 CPUs means other work shared the machine: the "
            "figures are noisy, and the ranges show how much.")
    return text


def render(results: dict[str, Any]) -> str:
    parts = ["### Environment", "", _meta_text(results)]
    titles = {
        "core": "Per-check latency",
        "redis_time": "Time inside Redis per check",
        "capacity": "Fleet capacity per Redis core",
        "asgi": "ASGI throughput (Starlette, FastAPI, Litestar)",
        "wsgi": "WSGI throughput (Flask, Django)",
        "memory": "Redis memory per identity",
    }
    for name in SECTIONS:
        section = results.get(name)
        if not section:
            continue
        if name == "core":
            block = core_table(section)
        elif name == "redis_time":
            block = redis_time_table(section)
        elif name == "capacity":
            block = capacity_table(section)
        elif name == "memory":
            block = memory_table(section)
        else:
            block = http_table(section)
        parts += ["", f"### {titles[name]}", "", block]
    return "\n".join(parts) + "\n"


def chart_links(out: Path) -> str:
    """The image lines for the charts that lie in `out`, as run.py appends them."""
    return "".join(f"\n![{title}]({name})\n" for name, title in CHART_TITLES.items()
                   if (out / name).exists())


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


def redraw(out: Path) -> bool:
    """Write the results block of OUT/performance.md again from OUT/benchmarks.json, measuring
    nothing and drawing no chart (the charts already in OUT are linked); False when the page
    has no block or there are no results."""
    results = load(out / "benchmarks.json")
    return bool(results) and update_doc(out / "performance.md", render(results) + chart_links(out))


if __name__ == "__main__":
    import sys

    out = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "docs"
    if not redraw(out):
        sys.exit(f"no results block redrawn in {out / 'performance.md'}")
    print(f"redrew the results block of {out / 'performance.md'} from {out / 'benchmarks.json'}")
