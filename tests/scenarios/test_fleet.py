"""Fleet-wide throttling: processes sharing one Redis share one quota.

Four real processes (three sync, one running three asyncio tasks; see _fleet_worker.py) call
`acquire` for ~1.5 s under "20/second", in real time against the real Redis. The assertions
are on counts, never on timing: every admitted call is one entry in the log; no window of one
second (by Redis's clock) holds more than 20; and, by the processes' own clock, no 0.999 s span
wholly contains more than 20 admissions (a span shorter than a second absorbs Redis's
millisecond rounding).
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from ._fleet_worker import RATE
from .conftest import REDIS_URL

WORKER = Path(__file__).with_name("_fleet_worker.py")
RUN_SECONDS = 1.5
Span = tuple[float, float]  # wall-clock time before acquire() was called, and after it returned


def most_in_any_window(times: list[float], width: float) -> int:
    """The largest number of the sorted `times` inside one window [t, t + width)."""
    best, lo = 0, 0
    for hi, t in enumerate(times):
        while times[lo] <= t - width:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


def most_spans_inside_any_window(spans: list[Span], width: float) -> int:
    """The largest number of spans wholly inside one window [x, x + width); it is largest
    when x is the start of one of them."""
    return max(
        (sum(1 for before, after in spans if x <= before and after < x + width)
         for x, _ in spans),
        default=0,
    )


def run_together(commands: list[list[str]]) -> list[Any]:
    """Run each command as a process; each prints "ready", then waits for a line on stdin
    (so that all start together) and prints its JSON result: the results, in order."""
    procs = [subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for command in commands]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        for proc in procs:  # everyone starts together
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = []
        for proc in procs:
            out, _ = proc.communicate(timeout=60)
            assert proc.returncode == 0
            results.append(json.loads(out))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def run_fleet(prefix: str, modes: list[str]) -> list[list[Span]]:
    return [[(before, after) for before, after in spans] for spans in run_together(
        [[sys.executable, str(WORKER), REDIS_URL, prefix, mode, str(RUN_SECONDS)]
         for mode in modes])]


@pytest.mark.slow
def test_processes_sharing_redis_never_exceed_the_shared_rate(
    redis_client: redis.Redis,
) -> None:
    prefix = "fleet" + uuid.uuid4().hex[:10]
    per_process = run_fleet(prefix, ["sync", "sync", "sync", "async"])
    spans = sorted(span for spans in per_process for span in spans)
    (log,) = list(redis_client.scan_iter(match=f"{prefix}:*"))
    try:
        entries = redis_client.zrange(log, 0, -1, withscores=True)
    finally:
        redis_client.delete(log)
    admitted_at = sorted(score / 1000 for _, score in entries)

    assert len(admitted_at) == len(spans)  # one log entry per admitted call, nothing more
    assert len(per_process) == 4
    assert len(spans) >= RATE  # the quota was used: 1.5 s at 20/second admits 40 or so
    # Four separate quotas would admit 80 in the first second; one shared quota admits 20.
    # (Which process gets them is up to the race: one may well take them all.)
    assert most_in_any_window(admitted_at, 1.0) <= RATE
    assert most_spans_inside_any_window(spans, 0.999) <= RATE


def test_the_window_counters_count_what_they_claim() -> None:
    assert most_in_any_window([0.0, 0.5, 0.999, 1.0, 1.5], 1.0) == 3
    assert most_spans_inside_any_window([(0.0, 0.1), (0.2, 0.3), (0.95, 1.01)], 1.0) == 2
    assert most_spans_inside_any_window([], 1.0) == 0
