"""The LLM client as people write it today, across a fleet: the openai SDK on httpx2, through
``ratelimit_mw.httpx2.RateLimitTransport(settle="usage")``, against a fake provider that
refuses some calls.

    python benchmarks/llm_fleet.py --seconds 60                   # the proof, ~75 s
    python benchmarks/llm_fleet.py --seconds 10 --window 5 --json # what the slow test runs

PROCESSES processes x THREADS threads call ``client.chat.completions.create`` in a loop (half
of the calls streamed with ``stream_options={"include_usage": True}``; the SDK's own retries
on), each call estimated at ESTIMATE tokens and using a random 0..2 x ESTIMATE, under TOKENS
tokens and CALLS requests per window, on the real Redis. The provider (a local HTTP server in
this process, speaking OpenAI's JSON and server-sent events) answers 3 % of calls 429 with
``Retry-After: 2`` and 2 % 500, and notes when each call arrived and what it used.

Each worker's limiter runs on a backend that notes every script call (when it was sent and
answered, its op, the token cost it carries, its reply), so that the checks read what was
charged, independently of how the store keeps it:

- tokens used in any window (by arrival at the provider) <= TOKENS + one overshoot (the
  largest answer over the estimate) per call in flight;
- requests arriving in any window <= CALLS;
- tokens charged (admitted reservations + overshoots charged - amounts given back) equal the
  tokens used (refusals are charged 0, as documented);
- after each provider 429, no reservation was admitted, in any process, between the moment
  its pause was stored and its end (``Retry-After`` from then, on the store's clock); the
  calls that reached the provider meanwhile had been admitted before (on their way: how long
  after the pause the latest arrived is reported).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

REPO = Path(__file__).resolve().parent.parent
PROCESSES, THREADS = 3, 4
ESTIMATE = 300  # each call uses 0..2 x ESTIMATE: an overshoot is at most ESTIMATE
P_429, P_500, RETRY_AFTER = 0.03, 0.02, 2


class Provider(BaseHTTPRequestHandler):
    """OpenAI's chat completions, as JSON or as server-sent events."""

    protocol_version = "HTTP/1.1"
    lock = threading.Lock()
    log: ClassVar[list[tuple[float, int, int]]] = []  # (arrived, status, tokens used)
    p_429: ClassVar[float] = P_429

    def do_POST(self) -> None:
        arrived = time.time()
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        draw = random.random()
        status = 429 if draw < self.p_429 else 500 if draw < self.p_429 + P_500 else 200
        used = random.randint(0, 2 * ESTIMATE) if status == 200 else 0
        with self.lock:
            self.log.append((arrived, status, used))
        time.sleep(random.uniform(0.005, 0.03))  # the model "thinks"
        if status != 200:
            body = json.dumps({"error": {"message": "busy", "type": "x"}}).encode()
            self._send(status, "application/json", [body],
                       {"retry-after": str(RETRY_AFTER)} if status == 429 else {})
            return
        usage = {"prompt_tokens": used // 2, "completion_tokens": used - used // 2,
                 "total_tokens": used}
        base = {"id": "c", "created": 0, "model": "m"}
        if not request.get("stream"):
            answer = {**base, "object": "chat.completion", "usage": usage, "choices": [
                {"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "hi"}}]}
            self._send(200, "application/json", [json.dumps(answer).encode()])
            return
        chunks = [{**base, "object": "chat.completion.chunk", "usage": None, "choices": [
            {"index": 0, "delta": {"content": word}, "finish_reason": None}]}
            for word in ("he", "llo")]
        chunks.append({**base, "object": "chat.completion.chunk", "choices": [],
                       "usage": usage})
        events = [f"data: {json.dumps(chunk)}\n\n".encode() for chunk in chunks]
        self._send(200, "text/event-stream", [*events, b"data: [DONE]\n\n"])

    def _send(self, status: int, kind: str, parts: list[bytes],
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(sum(map(len, parts))))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        for part in parts:  # a stream arrives in pieces
            self.wfile.write(part)
            self.wfile.flush()

    def log_message(self, *args: object) -> None:
        pass


class Recording:
    """A sync backend that notes every call: (sent, answered, op, token cost, admitted)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.is_cluster = backend.is_cluster
        self.calls: list[tuple[float, float, str, int, int]] = []
        self.lock = threading.Lock()

    def run(self, call: Any, deadline: float | None = None) -> list[int]:
        sent = time.time()
        reply: list[int] = self.backend.run(call, deadline)
        policy = call.layout[0][0]
        # The tokens tier is the call's first (charge, settle and pause build it so);
        # a pause carries its length in ms where a booking carries its time.
        cost = int(call.args[8]) if policy.name == "tokens" else 0
        # A pause's reply is its end on the store's clock (this machine's), in ms.
        outcome = reply[1] if call.op == "Z" else reply[0]
        with self.lock:
            self.calls.append((sent, time.time(), call.op, cost, outcome))
        return reply

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)


def worker(url: str, redis_url: str, prefix: str, seconds: float, window: float,
           tokens: int, calls: int) -> None:
    import httpx2
    import openai

    import ratelimit_mw as rl
    from ratelimit_mw.httpx2 import RateLimitTransport

    backend = Recording(rl.RedisBackend.from_url(redis_url))
    limiter = rl.Limiter(backend, prefix=prefix)  # type: ignore[arg-type]
    per = f"{window:g} seconds" if window != 60 else "minute"
    budget = rl.Policy(f"{tokens}/{per}", name="tokens")
    requests = rl.Policy(f"{calls}/{per}", name="calls")
    transport = RateLimitTransport(limiter, budget, key="openai", cost=ESTIMATE,
                                   calls=requests, settle="usage")
    client = openai.OpenAI(api_key="k", base_url=url, http_client=httpx2.Client(
        transport=transport, timeout=120))
    outcomes: dict[str, int] = {}
    lock = threading.Lock()
    print("ready", flush=True)
    sys.stdin.readline()
    deadline = time.time() + seconds

    def loop() -> None:
        while time.time() < deadline:
            messages = [{"role": "user", "content": "hi"}]
            try:
                if random.random() < 0.5:
                    for _ in client.chat.completions.create(
                            model="m", messages=messages,  # type: ignore[arg-type]
                            stream=True, stream_options={"include_usage": True}):
                        pass
                    kind = "streamed"
                else:
                    client.chat.completions.create(model="m", messages=messages)  # type: ignore[arg-type]
                    kind = "plain"
            except openai.APIStatusError as exc:
                kind = f"failed {exc.status_code}"
            with lock:
                outcomes[kind] = outcomes.get(kind, 0) + 1

    threads = [threading.Thread(target=loop) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(json.dumps({"calls": backend.calls, "outcomes": outcomes}), flush=True)


def most_in_window(events: list[tuple[float, int]], width: float) -> int:
    """The largest sum of weights of the sorted (time, weight) events in one [t, t + width)."""
    best = total = lo = 0
    for t, weight in events:
        total += weight
        while events[lo][0] <= t - width:
            total -= events[lo][1]
            lo += 1
        best = max(best, total)
    return best


def run(seconds: float, window: float, tokens: int, calls: int, redis_url: str,
        p_429: float = P_429) -> dict[str, Any]:
    Provider.log = []
    Provider.p_429 = p_429
    server = ThreadingHTTPServer(("127.0.0.1", 0), Provider)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    prefix = "llmfleet" + uuid.uuid4().hex[:8]
    command = [sys.executable, __file__, "--worker", url, "--redis", redis_url,
               "--prefix", prefix, "--seconds", str(seconds), "--window", str(window),
               "--tokens", str(tokens), "--calls", str(calls)]
    procs = [subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for _ in range(PROCESSES)]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = []
        for proc in procs:
            out, _ = proc.communicate(timeout=seconds + 120)
            if proc.returncode != 0:
                raise RuntimeError(f"a worker failed ({proc.returncode})")
            results.append(json.loads(out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        server.shutdown()
        server.server_close()
        import redis
        client = redis.Redis.from_url(redis_url)
        stale = list(client.scan_iter(match=f"{prefix}:*"))
        if stale:
            client.delete(*stale)
        client.close()
    return analyse(results, window, tokens, calls)


def analyse(results: list[dict[str, Any]], window: float, tokens: int,
            calls: int) -> dict[str, Any]:
    log = sorted(Provider.log)
    store = sorted(call for result in results for call in result["calls"])
    used = sum(tokens_used for _, _, tokens_used in log)
    charged = 0
    for _, _, op, cost, reply in store:
        if (op == "H" and reply == 1) or op == "F":
            charged += cost
        elif op == "R":
            charged -= cost
    overshoot = max((u - ESTIMATE for _, _, u in log), default=0)
    pauses = [(sent, answered, end_ms / 1000) for sent, answered, op, _, end_ms in store
              if op == "Z"]
    # Reservations admitted after a pause was stored (sent after its reply) and before it
    # ended (answered before its end): each would be a call the pause failed to hold back.
    broken = sum(1 for sent, answered, op, cost, reply in store
                 if op == "H" and reply == 1 and cost
                 and any(stored < sent and answered < end for _, stored, end in pauses))
    # Calls that reached the provider while a pause held: how long after it was stored
    # (admitted before it, they were on their way).
    lags = [arrived - stored for arrived, _, _ in log for _, stored, end in pauses
            if stored < arrived < end]
    outcomes: dict[str, int] = {}
    for result in results:
        for kind, n in result["outcomes"].items():
            outcomes[kind] = outcomes.get(kind, 0) + n
    in_flight = PROCESSES * THREADS
    return {
        "window_s": window, "tokens_limit": tokens, "calls_limit": calls,
        "sdk_calls": outcomes,
        "http_requests": len(log),
        "answered_429": sum(1 for _, s, _ in log if s == 429),
        "answered_500": sum(1 for _, s, _ in log if s == 500),
        "most_tokens_in_any_window": most_in_window([(t, u) for t, _, u in log], window),
        "tokens_bound": tokens + in_flight * max(overshoot, 0),
        "most_requests_in_any_window": most_in_window([(t, 1) for t, _, _ in log], window),
        "tokens_used": used, "tokens_charged": charged,
        "pauses_stored": len(pauses),
        "admitted_during_a_pause": broken,
        "arrived_during_a_pause_admitted_before_it": len(lags),
        "latest_such_arrival_after_the_pause_s": round(max(lags, default=0.0), 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--window", type=float, default=60.0)
    parser.add_argument("--tokens", type=int, default=90_000)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--p429", type=float, default=P_429,
                        help="the share of calls answered 429 (Retry-After: 2)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.redis, args.prefix, args.seconds, args.window, args.tokens,
               args.calls)
        return 0
    result = run(args.seconds, args.window, args.tokens, args.calls, args.redis, args.p429)
    if args.json:
        print(json.dumps(result))
    else:
        for name, value in result.items():
            print(f"{name:45} {value}")
    ok = (result["most_tokens_in_any_window"] <= result["tokens_bound"]
          and result["most_requests_in_any_window"] <= args.calls
          and result["tokens_charged"] == result["tokens_used"]
          and result["admitted_during_a_pause"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
