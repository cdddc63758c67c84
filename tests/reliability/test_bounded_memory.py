"""Bounded memory: whatever number of identities come by, state goes away once idle.

- Redis (a private server, so that DBSIZE counts only this test): 100k distinct identities,
  spread over every algorithm, a two-tier policy, a policy with a penalty (bans) and
  bookings, all with periods of one or two seconds. Every key carries a TTL no longer than
  the design allows for its kind, and once the windows have closed the server holds nothing:
  the only real wait of the suite, a bounded poll.
- MemoryBackend (the fake clock): idle identities are swept by later calls, a bounded number
  per call, until only the active identity is left; the deny cache stays within its size.
- The middleware's per-path caches stay bounded under a flood of distinct paths.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

import ratelimit_mw as rl
from ratelimit_mw import asgi
from ratelimit_mw.core import codec, scripts
from reliability._apps import asgi_app
from reliability._support import Figures, PrivateRedis, TestClock, ms

pytestmark = pytest.mark.slow

IDENTITIES = 100_000
SWEEP_PER_CALL = 64  # the MemoryBackend's documented per-call sweep
RELEASE_DEADLINE = 30.0  # seconds: a generous bound on the poll, never a claim

# name -> (policy, the longest TTL (ms) its keys may carry)
POLICIES: dict[str, tuple[rl.Policy, int]] = {
    "fw": (rl.Policy("3/second", algorithm="fixed-window", name="fw"), 1_000),
    "sl": (rl.Policy("3/second;5/2 seconds", algorithm="sliding-log", name="sl"), 2_000),
    "sw": (rl.Policy("3/second", algorithm="sliding-window", name="sw"), 2_000),  # 2 periods
    "gc": (rl.Policy("3/second", algorithm="gcra", name="gc"), 1_000),
    "pen": (rl.Policy("1/second", algorithm="fixed-window", name="pen",
                      penalty="1 second"), 1_000),
}
BOOKING, BOOKING_AHEAD_MS = rl.Policy("2/second", name="book"), 1_000
# A booking at now + 1 s keeps its log until its window has passed.
BOOKING_TTL_MS = BOOKING_AHEAD_MS + 1_000
NAMES = [*POLICIES, "book"]


def _calls(prefix: str, redis_now_ms: int) -> Any:
    """The script calls of the run: one identity each, hits of every kind, bans, bookings."""
    for i in range(IDENTITIES):
        name = NAMES[i % len(NAMES)]
        identity = f"user:{i}"
        if name == "book":
            yield codec.build(codec.BOOK, [codec.Check(BOOKING, identity)], prefix,
                             at_ms=redis_now_ms + BOOKING_AHEAD_MS)
            continue
        call = codec.build(codec.HIT, [codec.Check(POLICIES[name][0], identity)], prefix)
        yield call
        if name == "pen":
            # A second hit within the second is refused and starts a one-second ban.
            yield codec.build(codec.HIT, [codec.Check(POLICIES[name][0], identity)], prefix)


def _ttl_bound(key: str) -> int:
    segment = key.split(":")[-2]  # prefix:{identity}:<name>.<code>:<tier>
    name = segment.split(".")[0]
    return BOOKING_TTL_MS if name == "book" else POLICIES[name][1]


def _ttls_checked(client: Any, keys: list[str]) -> set[str]:
    """Each of `keys`, just written by a batch of calls, carries a TTL within what its kind
    needs (-1 would be "never expires"); the kinds seen. Checked per batch, not by a scan
    after the run: a slow machine writes the 100k calls in longer than a one-second key
    lives."""
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.pttl(key)
    kinds: set[str] = set()
    for key, ttl in zip(keys, pipe.execute(), strict=True):
        if ttl == -2:  # not written (the ban of an admitted hit), or expired since
            continue
        assert 0 <= ttl <= _ttl_bound(key), (key, ttl)
        kinds.add(key.split(":")[-2].split(".")[0] + ":" + key.split(":")[-1])
    return kinds


def test_redis_forgets_100k_identities_once_their_windows_close(
    private_redis: Callable[..., PrivateRedis], prefix: str, figures: Figures
) -> None:
    server = private_redis()
    client = server.client()
    client.script_load(scripts.source())
    seconds, micros = client.time()
    redis_now_ms = seconds * 1000 + micros // 1000

    started = time.monotonic()
    pipe = client.pipeline(transaction=False)
    queued = refused = 0
    batch: list[str] = []
    kinds_seen: set[str] = set()
    for call in _calls(prefix, redis_now_ms):
        pipe.evalsha(scripts.sha1(), len(call.keys), *call.keys, *call.args)
        batch.extend(call.keys)
        queued += 1
        if queued % 2_000 == 0:
            refused += sum(reply[0] == 0 for reply in pipe.execute())
            kinds_seen |= _ttls_checked(client, batch)
            batch = []
    refused += sum(reply[0] == 0 for reply in pipe.execute())
    kinds_seen |= _ttls_checked(client, batch)
    written_in = time.monotonic() - started
    # The second hits under the penalty policy are refused (ban keys written), except where
    # the two straddled a one-second window boundary.
    penalised = IDENTITIES // len(NAMES)
    assert 0.9 * penalised <= refused <= penalised
    peak_keys = client.dbsize()
    peak_memory = client.info("memory")["used_memory"]
    # Every kind of key was checked, bans too.
    assert {k for k in kinds_seen if k.endswith(":ban")}, kinds_seen
    assert {"fw:1000", "gc:1000", "sw:1000", "sl:log"} <= kinds_seen, kinds_seen

    # Once the windows have closed, nothing is left (expired keys are reclaimed by Redis's
    # active expiry; DBSIZE counts them until then).
    deadline = time.monotonic() + RELEASE_DEADLINE
    while client.dbsize() and time.monotonic() < deadline:
        time.sleep(0.1)
    emptied_after = time.monotonic() - started
    assert client.dbsize() == 0, client.dbsize()
    left_memory = client.info("memory")["used_memory"]
    client.close()
    figures.record("bounded_memory.redis", {
        "identities": IDENTITIES,
        "script_calls": queued,
        "write_and_ttl_check_seconds": round(written_in, 2),
        "keys_alive_after_write": peak_keys,
        "used_memory_after_write_bytes": peak_memory,
        "seconds_from_first_write_until_dbsize_0": round(emptied_after, 2),
        "used_memory_when_empty_bytes": left_memory,
        "key_kinds_ttl_checked": sorted(kinds_seen),
    })


def test_memory_backend_forgets_idle_identities_and_the_deny_cache_stays_bounded(
    figures: Figures,
) -> None:
    backend = rl.MemoryBackend()
    clock = TestClock()
    clock.now = 1_800_000_000.0
    limiter = rl.Limiter(backend, clock=clock)
    policies = [policy for policy, _ in POLICIES.values()]
    for i in range(IDENTITIES):
        policy = policies[i % len(policies)]
        limiter.hit(policy, f"user:{i}")
        if i % len(policies) == len(policies) - 1:
            limiter.hit(policy, f"user:{i}")  # refused: a ban and a deny-cache entry
    held = len(backend)
    assert held >= IDENTITIES
    deny_entries = len(limiter._deny or ())
    assert 0 < deny_entries <= 10_000  # the deny cache's default size

    clock.advance(3.0)  # every window (and ban) of the run has closed
    # A limit the driving identity never reaches: a refusal would be answered from the deny
    # cache, without a backend call, and so without a sweep.
    active = rl.Policy("1000000/second", algorithm="gcra", name="active")
    calls = 0
    while len(backend) > 1 and calls < 2 * held // SWEEP_PER_CALL + 10:
        limiter.hit(active, "still-here")
        calls += 1
    assert len(backend) <= 1, len(backend)  # only the one identity still active
    assert calls <= held // SWEEP_PER_CALL + 2
    figures.record("bounded_memory.memory_backend", {
        "identities": IDENTITIES, "keys_held": held, "deny_cache_entries": deny_entries,
        "calls_to_sweep_everything": calls,
    })


def test_the_asgi_middleware_per_path_caches_stay_bounded_under_a_flood_of_paths(
    figures: Figures,
) -> None:
    mw = asgi.RateLimitMiddleware(asgi_app(), rl.AsyncLimiter(), default="1000/second",
                                  rules={"/api/*": "1000/second"})

    async def flood() -> float:
        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            return None

        started = time.perf_counter()
        for i in range(20_000):
            path = f"/api/{i}" if i % 2 else f"/x/{i}"
            await mw({"type": "http", "method": "GET", "path": path, "raw_path": path.encode(),
                      "root_path": "", "query_string": b"", "headers": [],
                      "client": ("192.0.2.1", 1), "server": ("t", 80), "scheme": "http",
                      "http_version": "1.1", "asgi": {"version": "3.0"}}, receive, send)
        return time.perf_counter() - started

    elapsed = asyncio.run(flood())
    assert len(mw.guard._rule_cache) <= 4_096
    assert len(mw._resolver._cache) <= 4_096
    assert len(mw._entries) <= 4_096
    figures.record("bounded_memory.path_flood_request_ms_mean", ms(elapsed / 20_000))
