"""One client of the fake LLM API in test_llm_budget.py, run as its own process.

    python _llm_worker.py <redis url> <prefix> <api url> <sync|async> <seconds>

It prints "ready", waits for a line on stdin (so every worker starts together), then calls
the API through the httpx transport until its time is up (three asyncio tasks in async
mode): each call reserves ESTIMATE tokens and one request, and settles the tokens the answer
says it used. It prints one JSON list: the tokens of each call it made.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx

import ratelimit_mw as rl
from ratelimit_mw.httpx import AsyncRateLimitTransport, RateLimitTransport

ESTIMATE = 100
WINDOW = 2  # seconds
TOKENS = 2000  # per window
CALLS = 18  # per window
# The hour tiers never bind; they keep the whole run in the logs (the test reads them).
TOKEN_POLICY = rl.Policy(f"{TOKENS}/{WINDOW} seconds;10000000/hour", name="tokens")
CALL_POLICY = rl.Policy(f"{CALLS}/{WINDOW} seconds;100000/hour", name="calls")


def used(response: httpx.Response) -> int:
    return int(response.json()["usage"]["total_tokens"])


def run_sync(url: str, prefix: str, api: str, seconds: float) -> list[int]:
    limiter = rl.Limiter(rl.RedisBackend.from_url(url), prefix=prefix)
    stop = time.time() + seconds
    tokens = []
    transport = RateLimitTransport(limiter, TOKEN_POLICY, key="llm", cost=ESTIMATE,
                                   calls=CALL_POLICY, settle=used, on_backend_error="raise")
    with httpx.Client(transport=transport) as http:
        while time.time() < stop:
            transport.timeout = max(0.0, stop - time.time())
            try:
                tokens.append(used(http.post(api)))
            except rl.RateLimitExceeded:
                break
    return tokens


async def run_async(url: str, prefix: str, api: str, seconds: float) -> list[int]:
    backend = rl.AsyncRedisBackend.from_url(url)
    limiter = rl.AsyncLimiter(backend, prefix=prefix)
    stop = time.time() + seconds
    tokens: list[int] = []

    async def task() -> None:
        transport = AsyncRateLimitTransport(limiter, TOKEN_POLICY, key="llm", cost=ESTIMATE,
                                            calls=CALL_POLICY, settle=used,
                                            on_backend_error="raise")
        async with httpx.AsyncClient(transport=transport) as http:
            while time.time() < stop:
                transport.timeout = max(0.0, stop - time.time())
                try:
                    tokens.append(used(await http.post(api)))
                except rl.RateLimitExceeded:
                    return

    await asyncio.gather(task(), task(), task())
    await backend.aclose()
    return tokens


def main() -> None:
    url, prefix, api, mode, seconds = sys.argv[1:6]
    print("ready", flush=True)
    sys.stdin.readline()
    if mode == "sync":
        tokens = run_sync(url, prefix, api, float(seconds))
    else:
        tokens = asyncio.run(run_async(url, prefix, api, float(seconds)))
    print(json.dumps(tokens), flush=True)


if __name__ == "__main__":
    main()
