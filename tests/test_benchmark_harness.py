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
    table = report.redis_time_table(section)
    lines = {line.split(" | ")[0] + line.split(" | ")[1]: line
             for line in table.splitlines() if line.startswith("| ")}
    assert "1.50 (1.35–1.65) ✗" in lines["| fixed-window1"]
    assert "0.50 (0.45–0.55) ✓" in lines["| fixed-window3"]
    assert "| — |" in lines["| gcra1"]  # limits has no GCRA: no ratio, no mark
    # The Redis-clock floor, with its own ratio to limits where limits has the algorithm.
    assert "| 4.00 (3.60–4.40) (0.67×) |" in lines["| fixed-window1"]
    assert "| 4.00 (3.60–4.40) |" in lines["| gcra1"]
    # No INCR+PEXPIRE row and no floor row measured for it: dashes, not a crash.
    assert lines["| fixed-window3"].endswith("| — | — | evalsha 1 / — |")


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
