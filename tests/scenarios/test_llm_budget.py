"""An LLM budget across a fleet: tokens per window and requests per window, the tokens known
only from each answer.

Four real processes (three sync, one running three asyncio tasks: six calls in flight at
most; see _llm_worker.py) call a fake LLM API (a local HTTP server answering a random
`usage.total_tokens`, up to 2.5 x the estimate, after a few ms) through the httpx
transport for a few seconds, in real time against the real Redis. Each call reserves its
estimate and one request, then settles what it used. Read from the store's own logs (its
clock): the tokens charged are exactly the tokens used; requests never exceed their limit in
any window; the tokens in any window exceed the budget by at most the overshoots of the
calls in flight when it filled (an overshoot is known only from the answer, so a
reservation made meanwhile cannot see it).
"""

from __future__ import annotations

import json
import random
import sys
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
import redis

from ._llm_worker import CALLS, ESTIMATE, TOKENS, WINDOW
from .conftest import REDIS_URL
from .test_fleet import most_in_any_window, run_together

WORKER = Path(__file__).with_name("_llm_worker.py")
RUN_SECONDS = 4.0
IN_FLIGHT = 6  # three sync processes, three tasks in the async one
MOST_USED = 250  # the API's largest answer: 150 over the estimate


class FakeLLM(BaseHTTPRequestHandler):
    used: ClassVar[list[int]] = []
    lock = threading.Lock()

    def do_POST(self) -> None:
        tokens = random.randint(0, MOST_USED)
        with self.lock:
            self.used.append(tokens)
        threading.Event().wait(random.uniform(0.002, 0.02))  # the model "thinks"
        body = json.dumps({"usage": {"total_tokens": tokens}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def units_at(client: redis.Redis, log: bytes) -> list[float]:
    """The time (s) of every unit a sliding log holds: a member "<token>#<cost>" is `cost`
    units, any other one unit; "+" (the running total of costs) is no entry."""
    return sorted(score / 1000 for member, score in client.zrange(log, 0, -1, withscores=True)
                  if member != b"+"
                  for _ in range(int(member.partition(b"#")[2] or 1)))


@pytest.fixture
def api() -> Iterator[str]:
    FakeLLM.used = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeLLM)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/chat"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
def test_four_processes_stay_within_the_token_and_request_budgets(
    redis_client: redis.Redis, api: str
) -> None:
    prefix = "llm" + uuid.uuid4().hex[:10]
    per_process = run_together([[sys.executable, str(WORKER), REDIS_URL, prefix, api, mode,
                                 str(RUN_SECONDS)] for mode in ("sync", "sync", "sync", "async")])
    logs = {key.decode().split(":")[2].split(".")[0]: key
            for key in redis_client.scan_iter(match=f"{prefix}:*")}
    try:
        tokens_at = units_at(redis_client, logs["tokens"])
        calls_at = units_at(redis_client, logs["calls"])
    finally:
        redis_client.delete(*logs.values())
    used = [tokens for process in per_process for tokens in process]

    assert len(used) > CALLS  # the budgets were used over more than one window
    assert sorted(used) == sorted(FakeLLM.used)  # every answer reached its caller
    # The sum charged equals the sum used: one log entry per token really used.
    assert len(tokens_at) == sum(used)
    assert len(calls_at) == len(used)
    assert most_in_any_window(calls_at, WINDOW) <= CALLS
    overshoot = MOST_USED - ESTIMATE
    most = most_in_any_window(tokens_at, WINDOW)  # one log entry per token
    # An overshoot is known only from the answer: at most one per call in flight.
    assert most <= TOKENS + IN_FLIGHT * overshoot, most
