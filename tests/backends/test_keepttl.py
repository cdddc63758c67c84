"""With Redis's own clock, fixed-window and sliding-window writes inside one window keep the
key's TTL (KEEPTTL) instead of setting it again: the TTL must still end where the window
needs it, and the counts must still be right."""

from __future__ import annotations

import time

import fakeredis
import pytest
import redis

import ratelimit_mw as rl


@pytest.fixture(params=["redis", "fakeredis"])
def client(request: pytest.FixtureRequest, redis_client: redis.Redis) -> redis.Redis:
    if request.param == "redis":
        return redis_client
    return fakeredis.FakeRedis(server=fakeredis.FakeServer())


@pytest.mark.parametrize("algorithm", ["fixed-window", "sliding-window"])
def test_ttls_end_where_the_window_needs_them_under_redis_time(
    client: redis.Redis, algorithm: str, prefix: str
) -> None:
    limiter = rl.Limiter(rl.RedisBackend(client), prefix=prefix, deny_cache=0)
    policy = rl.Policy("50/2 seconds;100/10 seconds", algorithm=algorithm)
    decisions = []
    for _ in range(20):
        decisions.append(limiter.hit(policy, "ip:1"))
        for key in client.scan_iter(match=f"{prefix}:*"):
            # The clock is read before PTTL: a pause between the two (a busy CI machine) can
            # then only loosen the bound, never make a correct TTL look too long.
            now = int(time.time() * 1000)
            ttl = client.pttl(key)
            period = int(key.decode().rsplit(":", 1)[1])
            start = now - now % period
            windows = 1 if algorithm == "fixed-window" else 2
            if ttl == -2:
                continue  # expired between SCAN and PTTL: its window ended meanwhile
            # Never without a TTL (-1), and not outliving what the algorithm needs (5 ms for
            # clock reads). 0 is a key in its last millisecond: a hit just before a window's
            # end sets a TTL of 1 ms or less.
            assert 0 <= ttl <= start + windows * period - now + 5, (key, ttl)
        time.sleep(0.005)
    assert all(d.allowed for d in decisions)
    # Counted once each: 20 hits in the 10-second tier unless it rolled over meanwhile.
    ten_second = next(t for t in decisions[-1].tiers if t.rate.period_ms == 10_000)
    assert ten_second.remaining in range(80, 100)
