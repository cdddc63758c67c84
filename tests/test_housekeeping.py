"""The test run leaves nothing behind in the shared Redis (tests/housekeeping.py)."""

from __future__ import annotations

import uuid

import redis
from housekeeping import Housekeeper, SweepOutcome

import ratelimit_mw as rl


def _random_prefix(letter: str) -> str:
    return letter + uuid.uuid4().hex[:12]


def test_the_sweep_deletes_recorded_prefixes_and_their_suffixed_twins_only(
    redis_client: redis.Redis, housekeeper: Housekeeper,
) -> None:
    mine, other = _random_prefix("h"), _random_prefix("h")
    keeper = Housekeeper(housekeeper.url)
    keeper.record(mine)
    written = [f"{mine}:{{u}}:p.sl:log", f"{mine}a:{{u}}:p.fw:60000", f"{other}:{{u}}:p.fw:1"]
    for key in written:
        redis_client.set(key, "1", px=60_000)
    try:
        outcome = keeper.sweep()
        assert outcome.clean and outcome.deleted >= 2
        assert redis_client.exists(written[0]) == 0
        assert redis_client.exists(written[1]) == 0
        assert redis_client.exists(written[2]) == 1  # another run's prefix: not ours to drop
    finally:
        redis_client.delete(*written)


def test_a_fixed_prefix_is_never_recorded_so_another_suite_s_keys_survive(
    housekeeper: Housekeeper,
) -> None:
    keeper = Housekeeper(housekeeper.url)
    keeper.record("rl")
    keeper.record("app")
    assert keeper.prefixes == set()
    assert not keeper.owns("rl:{u}:p.sl:log")


def test_every_limiter_on_a_store_records_its_prefix_for_the_sweep(
    housekeeper: Housekeeper, redis_client: redis.Redis,
) -> None:
    on_redis, in_memory = _random_prefix("h"), _random_prefix("h")
    rl.Limiter(rl.RedisBackend(redis_client), prefix=on_redis)
    rl.AsyncLimiter(rl.MemoryBackend(), prefix=in_memory)
    assert on_redis in housekeeper.prefixes
    assert in_memory not in housekeeper.prefixes  # nothing of it lives outside the process


def test_keys_named_after_a_uuid_this_run_drew_are_swept_whoever_wrote_them(
    redis_client: redis.Redis, housekeeper: Housekeeper,
) -> None:
    keeper = Housekeeper(housekeeper.url)
    drawn = uuid.uuid4().hex  # as a test does before handing "trel" + hex[:10] to a server
    keeper.record_uuid(drawn)
    stranger = uuid.uuid4().hex
    ours = [f"trel{drawn[:10]}:{{u}}:p.fw:1", f"fleet{drawn[:10]}:{{u}}:p.sl:log",
            f"t{drawn[:12]}:{{u}}:p.gc:1"]
    theirs = f"trel{stranger[:10]}:{{u}}:p.fw:1"
    for key in [*ours, theirs]:
        redis_client.set(key, "1", px=60_000)
    try:
        assert keeper.sweep().deleted == len(ours)
        assert redis_client.exists(*ours) == 0 and redis_client.exists(theirs) == 1
    finally:
        redis_client.delete(*ours, theirs)


def test_the_run_records_every_uuid_it_draws(housekeeper: Housekeeper) -> None:
    assert uuid.uuid4().hex[:10] in housekeeper.uuids


def test_the_prefix_fixture_is_recorded(prefix: str, housekeeper: Housekeeper) -> None:
    assert prefix in housekeeper.prefixes


def test_survivors_fail_the_run_loudly() -> None:
    outcome = SweepOutcome(deleted=3, survivors=["t0123456789ab:{u}:p.sl:log"])
    assert not outcome.clean
    assert "FAILED" in outcome.message and "t0123456789ab:{u}:p.sl:log" in outcome.message
    assert SweepOutcome(deleted=0).message == ""
