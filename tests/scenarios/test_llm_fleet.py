"""The fleet proof of benchmarks/llm_fleet.py, shortened: three processes x four threads on
the openai SDK through ratelimit_mw.httpx2, half of the calls streamed, against a provider
that answers some calls 429 (Retry-After: 2) and 2 % 500; on the real Redis, in real time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REDIS_URL

pytest.importorskip("openai")  # Python 3.11+ (the test extra installs it there)

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "llm_fleet.py"


@pytest.mark.slow
def test_a_fleet_of_sdk_clients_keeps_the_budgets_and_the_providers_pauses() -> None:
    # A higher share of 429s than the proof's 3 %, so that a short run surely meets some.
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--seconds", "10", "--window", "5", "--tokens", "15000",
         "--calls", "80", "--p429", "0.08", "--redis", REDIS_URL, "--json"],
        capture_output=True, text=True, timeout=300)
    numbers = json.loads(result.stdout.strip().splitlines()[-1])
    assert result.returncode == 0, numbers
    assert numbers["tokens_used"] > numbers["tokens_limit"], numbers  # more than one window spent
    assert numbers["most_tokens_in_any_window"] <= numbers["tokens_bound"], numbers
    assert numbers["most_requests_in_any_window"] <= numbers["calls_limit"], numbers
    assert numbers["tokens_charged"] == numbers["tokens_used"], numbers  # refusals charged 0
    assert numbers["answered_429"] >= 1, numbers
    assert numbers["pauses_stored"] == numbers["answered_429"], numbers
    assert numbers["admitted_during_a_pause"] == 0, numbers
    calls = numbers["sdk_calls"]
    assert calls.get("streamed", 0) > 0 and calls.get("plain", 0) > 0, numbers
