"""The benchmark harness runs end to end (no timing is asserted: figures are measured in
benchmarks/, never judged here).

The harness is one command the lead re-runs after every round of hot-path work; these tests
keep it runnable: its command line, the accounting of time inside Redis (a script's usec
holds the commands it calls), the tables it renders, and a real quick run of the
private-Redis sections with whatever peers are installed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))

import _util  # noqa: E402
import report  # noqa: E402


def _harness(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BENCH / "run.py"), *args], capture_output=True,
                          text=True, timeout=timeout, check=False, cwd=REPO)


def test_help_lists_every_section_and_the_one_command_options() -> None:
    proc = _harness("--help", timeout=60)
    assert proc.returncode == 0, proc.stderr
    for text in ("--quick", "--out", "--rounds", "--setup", "--processes",
                 ",".join(report.SECTIONS)):
        assert text in proc.stdout


def test_unknown_section_is_refused_with_the_list() -> None:
    proc = _harness("--only", "everything", timeout=60)
    assert proc.returncode == 2
    assert "redis_time" in proc.stderr and "capacity" in proc.stderr


def test_script_time_is_counted_once() -> None:
    before = {"evalsha": (10, 100), "get": (10, 20), "set": (10, 30)}
    after = {"evalsha": (20, 260), "get": (20, 45), "set": (20, 60), "ping": (1, 1)}
    delta = _util.command_delta(before, after)
    assert delta == {"evalsha": (10, 160), "get": (10, 25), "set": (10, 30), "ping": (1, 1)}
    # The GET and SET ran inside the script: its 160 usec already hold them.
    assert _util.top_level_usec(delta) == 160
    # Without scripts every command was sent by the client.
    plain = {"incrby": (5, 10), "pexpire": (5, 7)}
    assert _util.top_level_usec(plain) == 17


def _spread(median: float) -> dict[str, float]:
    return {"median": median, "min": median * 0.9, "max": median * 1.1, "n": 3}


def _tables(text: str) -> list[list[dict[str, str]]]:
    """Every markdown table in `text`, as rows of {header: cell}."""
    tables = []
    for block in text.split("\n\n"):
        lines = block.strip("\n").splitlines()
        if lines and lines[0].startswith("| "):
            cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]
            tables.append([dict(zip(cells[0], row, strict=True)) for row in cells[2:]])
    return tables


def test_redis_time_table_marks_the_target_against_limits() -> None:
    section = {
        "rounds": 3, "checks_per_round": 100, "identities": 10, "target_x_limits": 0.8,
        "tiers": {"1": "1/second", "3": "1/second;2/minute;3/hour"},
        "rows": [
            {"impl": "ratelimit_mw", "algorithm": "fixed-window", "tiers": 1,
             "usec": _spread(9.0), "x_limits": _spread(1.5), "calls_per_check": {"evalsha": 1}},
            {"impl": "limits", "algorithm": "fixed-window", "tiers": 1, "usec": _spread(6.0),
             "x_limits": None, "calls_per_check": {"evalsha": 1}},
            {"impl": "ratelimit_mw", "algorithm": "fixed-window", "tiers": 3,
             "usec": _spread(10.0), "x_limits": _spread(0.5), "calls_per_check": {"evalsha": 1}},
            {"impl": "ratelimit_mw", "algorithm": "gcra", "tiers": 1, "usec": _spread(8.0),
             "x_limits": None, "calls_per_check": {"evalsha": 1}},
            {"impl": "TIME floor", "algorithm": "fixed-window", "tiers": 1,
             "usec": _spread(4.0), "x_limits": _spread(0.67),
             "calls_per_check": {"evalsha": 1, "time": 1}},
            {"impl": "TIME floor", "algorithm": "gcra", "tiers": 1, "usec": _spread(4.0),
             "x_limits": None, "calls_per_check": {"evalsha": 1, "time": 1}},
        ],
    }
    against, floors, calls = _tables(report.redis_time_table(section))
    ours = {(r["algorithm"], r["tiers"]): r for r in against}
    assert ours["fixed-window", "1"]["ours × limits"] == "1.50 (1.35–1.65) ✗"
    assert ours["fixed-window", "3"]["ours × limits"] == "0.50 (0.45–0.55) ✓"
    # limits has no GCRA: no figure, no ratio, no mark.
    assert ours["gcra", "1"]["limits µs"] == ours["gcra", "1"]["ours × limits"] == "—"
    # The Redis-clock floor, with its own ratio to limits where limits has the algorithm.
    floor = {(r["algorithm"], r["tiers"]): r["TIME floor µs (× limits)"] for r in floors}
    assert floor["fixed-window", "1"] == "4.00 (3.60–4.40) (0.67×)"
    assert floor["gcra", "1"] == "4.00 (3.60–4.40)"
    # No INCR+PEXPIRE row and no floor row measured for it: dashes, not a crash.
    assert floor["fixed-window", "3"] == "—"
    assert {r["INCR+PEXPIRE µs"] for r in floors} == {"—"}
    # The commands each side sent, one row per implementation measured.
    assert [(r["tiers"], r["implementation"], r["commands per check"]) for r in calls
            if r["algorithm"] == "fixed-window"] == [
        ("1", "ratelimit_mw", "evalsha 1"), ("1", "limits", "evalsha 1"),
        ("3", "ratelimit_mw", "evalsha 1")]


def test_capacity_table_divides_by_redis_cpu_and_compares_per_core() -> None:
    def row(impl: str, rate: float, cpu: float) -> dict[str, object]:
        return {"impl": impl, "algorithm": "fixed-window", "tiers": 1,
                "checks_per_s": _spread(rate), "redis_cpu": _spread(cpu),
                "per_redis_core": _spread(rate / cpu), "redis_us": _spread(5.0), "errors": 0}

    section = {"processes": 2, "concurrency": 8, "rounds": 3, "duration_s": 1.0, "cpus": 2,
               "event_loop": "asyncio", "tiers": {"1": "1/second"},
               "rows": [row("ratelimit_mw", 20_000, 0.5), row("limits", 10_000, 0.5)]}
    table = report.capacity_table(section)
    ours = next(line for line in table.splitlines() if "| ratelimit_mw |" in line)
    assert "40,000 (36,000–44,000)" in ours
    assert ours.rstrip().endswith("| 2.00 |")


def test_http_tables_mark_the_ratio_and_the_flood_call_bound_apart() -> None:
    def row(label: str, rps: float, **extra: object) -> dict[str, object]:
        return {"label": label, "baseline": "bare", "rps": _spread(rps),
                "ratio": _spread(rps / 1000), "p50_ms": _spread(1.0), "p99_ms": _spread(2.0),
                "non2xx_share": _spread(1.0 if extra.get("flood") else 0.0), **extra}

    section = {
        "server": {"server": "gunicorn", "version": "1", "workers": 2, "worker_class": "sync"},
        "load": {"tool": "wrk", "threads": 1, "connections": 16, "duration_s": 2.0},
        "rounds": 3, "limit_admitted": "1000/hour", "limit_flood": "1/day",
        "algorithm": "fixed-window", "redis": "private",
        "rows": [row("bare", 1000), row("ours", 600, target=0.7),
                 row(report.FLOOD_PREFIX + "ours", 1000, target=0.9, flood=True,
                     redis_calls=[{"evalsha": 3, "total": 9}, {"evalsha": 7, "total": 21}]),
                 {"label": "peer", "skipped": "not installed"}],
    }
    text = report.http_table(section)
    admitted, flood, calls = _tables(text)
    assert [r["configuration, all admitted"] for r in admitted] == ["bare", "ours"]
    assert "non-2xx" not in admitted[0]  # 0% on every admitted row: said once, in the notes
    assert "non-2xx: 0% in every admitted run" in text
    assert admitted[1]["× bare"] == "0.60 (0.54–0.66)" and admitted[1]["target"] == "≥ 0.70 ✗"
    assert flood == [{"flood, 1 refused client": "ours", "req/s": "1,000 (900–1,100)",
                      "× bare": "1.00 (0.90–1.10)", "p50 ms": "1.00", "p99 ms": "2.00",
                      "non-2xx": "100%", "target": "≥ 0.90 ✓"}]
    # Two workers, a 2 s run: at most 2 × (2 + 1) = 6 script calls; the second round made 7.
    assert calls[0]["Redis script calls, per round"] == "3, 7"
    assert calls[0]["every command, per round"] == "9, 21"
    assert calls[0]["target"] == "≤ 6 ✗"
    assert "- peer: skipped, not installed" in text


def test_a_table_too_wide_is_dealt_into_tables_that_repeat_the_key_columns() -> None:
    rows = [[f"key {i}", *(f"{i}{c}" * 9 for c in "abcdefghij")] for i in range(3)]
    header = ["name", *(f"column {c}" for c in "abcdefghij")]
    text = report.table(header, "l" + "r" * 10, rows)
    tables = _tables(text)
    assert len(tables) > 1
    assert all(len(line) <= report.WIDTH for line in text.splitlines())
    merged: dict[str, dict[str, str]] = {}
    for part in tables:
        for r in part:
            merged.setdefault(r["name"], {}).update(r)
    assert merged == {row[0]: dict(zip(header, row, strict=True)) for row in rows}


def test_wrapped_prose_never_opens_a_markdown_block() -> None:
    text = "word " * 19 + "- then + and 1. and # here " + "x" * 30
    for width in range(20, 40):
        for line in report.wrap(text, width=width):
            assert not line.startswith(("- ", "+ ", "1. ", "# ")), (width, line)


def test_the_committed_results_render_within_the_page_width() -> None:
    results = report.load(REPO / "docs" / "benchmarks.json")
    assert set(report.SECTIONS) <= set(results)
    markdown = report.render(results)
    too_wide = [line for line in markdown.splitlines() if len(line) > report.WIDTH]
    assert not too_wide, too_wide
    # The page shows what the committed JSON renders to (python benchmarks/report.py redraws).
    page = (REPO / "docs" / "performance.md").read_text()
    assert f"{report.BEGIN}\n{markdown}" in page


def test_report_redraws_the_block_from_the_json_without_measuring(tmp_path: Path) -> None:
    shutil.copy(REPO / "docs" / "benchmarks.json", tmp_path / "benchmarks.json")
    (tmp_path / "capacity.png").write_bytes(b"")
    (tmp_path / "performance.md").write_text(f"# Page\n\n{report.BEGIN}\nold\n{report.END}\n")
    proc = subprocess.run([sys.executable, str(BENCH / "report.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    page = (tmp_path / "performance.md").read_text()
    results = report.load(tmp_path / "benchmarks.json")
    assert page == (f"# Page\n\n{report.BEGIN}\n{report.render(results)}\n"
                    f"![fleet capacity per Redis core](capacity.png)\n\n{report.END}\n")


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH")
def test_quick_run_of_the_private_redis_sections(tmp_path: Path) -> None:
    proc = _harness("--quick", "--only", "redis_time,capacity", "--processes", "1",
                    "--in-flight", "4", "--capacity-duration", "0.2", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "benchmarks.json").read_text())
    assert results["environment"]["cpus"] >= 1
    for name in ("redis_time", "capacity"):
        ours = {(r["algorithm"], r["tiers"]) for r in results[name]["rows"]
                if r["impl"] == "ratelimit_mw"}
        assert ours == {(a, t) for a in ("fixed-window", "sliding-log", "sliding-window",
                                         "gcra") for t in (1, 3)}
    for row in results["redis_time"]["rows"]:
        assert row["usec"]["median"] > 0, row
        assert sum(row["calls_per_check"].values()) >= 1, row
    for row in results["capacity"]["rows"]:
        assert row["errors"] == 0, row
        assert row["checks_per_s"]["median"] > 0, row
    assert "### Fleet capacity per Redis core" in proc.stdout
