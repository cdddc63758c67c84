"""MemoryBackend's own duties: forgetting idle identities, thread safety, sync and async use,
the text form of a raw ARGV, and the sliding log's sorted set.

Its algorithms are held to the Lua script by tests/test_differential.py and to the
documented semantics by tests/test_limiter.py (which runs on both backends).
"""

from __future__ import annotations

import threading

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import ratelimit_mw as rl
from ratelimit_mw.backends._log import _Log
from ratelimit_mw.backends._store import NEVER
from ratelimit_mw.core import codec
from tests.conftest import StepClock

ALGORITHMS = sorted(rl.ALGORITHMS)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_idle_identities_are_forgotten_once_their_windows_close(
    step_clock: StepClock, algorithm: str
) -> None:
    backend = rl.MemoryBackend()
    limiter = rl.Limiter(backend, clock=step_clock, deny_cache=0)
    policy = rl.Policy("2/second;3/10 seconds", algorithm=algorithm, penalty=5)
    for i in range(50):
        limiter.hit(policy, f"user{i}")
        limiter.hit(policy, f"user{i}", cost=3)  # refused: bans
    assert len(backend) > 50
    step_clock.advance(21)  # past every window (two for sliding-window) and every ban
    for _ in range(10):  # each call sweeps a bounded number of expired keys
        limiter.peek(policy, "someone else")
    assert len(backend) == 0


def test_a_sweep_does_a_bounded_amount_of_work_per_call(step_clock: StepClock) -> None:
    backend = rl.MemoryBackend()
    limiter = rl.Limiter(backend, clock=step_clock, deny_cache=0)
    policy = rl.Policy("1/second", algorithm="gcra")
    for i in range(300):
        limiter.hit(policy, f"u{i}")  # each key lives 1,001 ms
    step_clock.advance_ms(999)
    limiter.peek(policy, "x")
    assert len(backend) == 300  # nothing due yet
    step_clock.advance_ms(3)  # all 300 due, 3 ms after the previous call
    limiter.peek(policy, "x")
    assert len(backend) == 300 - (64 + 16 * 3)  # 64 a call, plus 16 per ms since the last
    assert repr(backend).startswith("MemoryBackend(keys=")


def test_a_key_written_again_keeps_its_latest_expiry(step_clock: StepClock) -> None:
    backend = rl.MemoryBackend()
    limiter = rl.Limiter(backend, clock=step_clock, deny_cache=0)
    policy = rl.Policy("5/10 seconds")
    limiter.hit(policy, "u")
    step_clock.advance(8)
    limiter.hit(policy, "u")
    step_clock.advance(5)  # the first hit's expiry has passed, the second's has not
    limiter.peek(policy, "x")
    assert limiter.peek(policy, "u").remaining == 4


def test_refunding_every_logged_hit_drops_the_log(step_clock: StepClock) -> None:
    backend = rl.MemoryBackend()
    limiter = rl.Limiter(backend, clock=step_clock, deny_cache=0)
    limiter.hit("3/minute", "u", cost=2)
    limiter.refund("3/minute", "u", cost=2)
    assert len(backend) == 0  # as Redis drops an empty sorted set


def test_close_forgets_everything(step_clock: StepClock) -> None:
    backend = rl.MemoryBackend()
    limiter = rl.Limiter(backend, clock=step_clock, deny_cache=0)
    limiter.hit("1/minute", "u")
    backend.close()
    assert len(backend) == 0
    assert limiter.hit("1/minute", "u").allowed


def test_without_a_test_clock_the_backend_reads_the_wall_clock() -> None:
    limiter = rl.Limiter(rl.MemoryBackend(), deny_cache=0)
    policy = rl.Policy("2/hour", algorithm="fixed-window")
    assert [limiter.hit(policy, "u").allowed for _ in range(3)] == [True, True, False]
    assert 0 < limiter.peek(policy, "u").retry_after <= 3600


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_threads_hammering_one_identity_admit_exactly_the_limit(algorithm: str) -> None:
    limiter = rl.Limiter(rl.MemoryBackend(), deny_cache=0)
    policy = rl.Policy("50/hour;70/day", algorithm=algorithm)
    admitted: list[bool] = []
    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait()
        results = [limiter.hit(policy, "shared").allowed for _ in range(20)]
        admitted.extend(results)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert admitted.count(True) == 50


async def test_the_async_entry_point_shares_state_with_the_sync_one(
    step_clock: StepClock,
) -> None:
    backend = rl.MemoryBackend()
    sync = rl.Limiter(backend, clock=step_clock, deny_cache=0)
    asyn = rl.AsyncLimiter(backend, clock=step_clock, deny_cache=0)
    sync.hit("3/minute", "u")
    assert (await asyn.hit("3/minute", "u")).remaining == 1
    await asyn.refund("3/minute", "u")
    assert sync.peek("3/minute", "u").remaining == 2
    await backend.aclose()
    assert len(backend) == 0


def _idle_identities(limiter: rl.Limiter, count: int) -> None:
    policy = rl.Policy("1/second", algorithm="fixed-window", name="idle")
    for i in range(count):
        limiter.hit(policy, f"idle{i}")


def test_expired_entries_are_reclaimed_while_every_call_is_refused(
    step_clock: StepClock,
) -> None:
    backend = rl.MemoryBackend()
    limiter = rl.Limiter(backend, clock=step_clock, deny_cache=0)
    _idle_identities(limiter, 40_000)
    assert len(backend) == 40_000
    step_clock.advance_ms(10_000)  # every idle identity's window is over
    flood = rl.Policy("1/hour", name="flood")
    assert limiter.hit(flood, "attacker").allowed
    refused = 0
    for _ in range(10_000):
        refused += not limiter.hit(flood, "attacker").allowed
    assert refused == 10_000
    assert len(backend) == 1  # the attacker's log; the 40,000 expired keys are gone


def test_a_backend_called_seldom_still_reclaims_what_expired_meanwhile(
    step_clock: StepClock,
) -> None:
    """In front of the backend a cache may answer most refusals (the deny cache), so the
    backend can see one call a second: reclaiming keeps pace with time, not with calls."""
    backend = rl.MemoryBackend()
    limiter = rl.Limiter(backend, clock=step_clock, deny_cache=0)
    flood = rl.Policy("1/hour", name="flood")
    limiter.hit(flood, "attacker")
    _idle_identities(limiter, 40_000)
    left = []
    for _ in range(3):
        step_clock.advance_ms(1_000)  # the idle identities' windows are over after the first
        assert not limiter.hit(flood, "attacker").allowed
        left.append(len(backend))
    # ~16,000 per idle second, spread over the calls (64 a call would leave 39,809).
    assert 1 < left[0] < 40_000 - 15_000 and left[1] < left[0], left
    assert left[-1] == 1, left


def _schedule_holds_every_key_once(backend: rl.MemoryBackend, latest: dict[str, int]) -> None:
    """The sweep's bookkeeping: each held key sits in exactly one bucket, due no later than
    the latest expiry it has had (a key is filed at its expiry; written again later it keeps
    its place until the sweep files it at the new one; a refund may move its expiry earlier,
    and then it is dropped at its place, expired), the heap names exactly the buckets' ms,
    and no bucket is left empty. `latest`: each key's latest expiry seen so far, updated."""
    due: dict[str, int] = {}
    for at, keys in backend._due.items():
        assert keys, f"an empty bucket at {at}"
        for key in keys:
            assert key not in due, f"{key} is scheduled twice"
            due[key] = at
    assert sorted(backend._due_times) == [*sorted(backend._due), NEVER]
    assert set(due) == backend._scheduled
    for key, expires in backend._expires.items():
        assert key in backend._data
        latest[key] = max(latest.get(key, expires), expires)
        assert due[key] <= latest[key], (key, due[key], latest[key])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    calls=st.lists(
        st.tuples(st.sampled_from(["hit", "hit", "hit", "reset", "refund", "peek"]),
                  st.integers(0, 7),  # identity
                  st.integers(0, 3),  # policy
                  st.one_of(st.integers(0, 6), st.sampled_from([20, 400]))),  # ms before
        min_size=5, max_size=60),
    crowd=st.integers(0, 400),  # identities hit within one ms first: buckets bigger than a sweep
)
# A gcra refund moves the key's expiry before the ms it is filed at (a review found it).
@example(calls=[("hit", 0, 1, 0), ("hit", 0, 1, 0), ("hit", 0, 1, 0), ("refund", 0, 1, 3),
                ("hit", 0, 0, 0)], crowd=0)
def test_the_sweep_forgets_exactly_what_expired_and_keeps_every_key_scheduled(
    calls: list[tuple[str, int, int, int]], crowd: int
) -> None:
    """Random calls on short windows, so keys expire, are swept part by part (a crowd in one
    ms overflows a call's budget) and are written again while scheduled: after every call
    the schedule still holds every key once, by the latest expiry it has had, and nothing
    live has been dropped. Then, past every expiry, the backend forgets everything."""
    clock = StepClock()
    backend = rl.MemoryBackend()
    limiter = rl.Limiter(backend, clock=clock, deny_cache=0)
    policies = [rl.Policy("3/4ms;5/9ms", algorithm=algorithm, name=f"p{i}",
                          penalty=0.01 if algorithm == "gcra" else None)
                for i, algorithm in enumerate(ALGORITHMS)]
    crowd_policy = rl.Policy("1/3ms", algorithm="gcra", name="crowd")
    for i in range(crowd):
        limiter.hit(crowd_policy, f"c{i}")
    latest: dict[str, int] = {}
    for kind, identity, policy, wait in calls:
        clock.advance_ms(wait)
        name = f"u{identity}"
        before = dict(backend._expires)
        if kind == "hit":
            limiter.hit(policies[policy], name)
        elif kind == "reset":
            limiter.reset(policies[policy], name)
        elif kind == "refund":
            limiter.refund(policies[policy], name)
        else:
            limiter.peek(policies[policy], name)
        _schedule_holds_every_key_once(backend, latest)
        if kind in ("hit", "peek"):  # (reset and refund delete keys themselves)
            dropped = before.keys() - backend._expires.keys()
            assert all(before[key] <= clock.ms for key in dropped), "a live key was dropped"
    clock.advance_ms(60_000)
    for _ in range(10):
        limiter.peek(policies[0], "someone else")
    assert len(backend) == 0
    assert not backend._due and backend._due_times == [NEVER] and not backend._scheduled


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls=st.lists(
    st.tuples(st.sampled_from([codec.HIT, codec.HIT, codec.PEEK, codec.REFUND, codec.RESET,
                               codec.BOOK, codec.CANCEL]),
              st.integers(0, len(ALGORITHMS) - 1),
              st.sampled_from([0, 1, 999, 1_000, 61_000]),  # ms before the call
              st.sampled_from([1, 2, 7]),  # cost
              st.sampled_from([-3_000, 0, 700, 30_000])),  # a booking's time from now
    min_size=5, max_size=40))
def test_a_raw_argv_of_text_gets_the_replies_of_the_core_s_ints(
    calls: list[tuple[str, int, int, int, int]],
) -> None:
    """What a Redis client sends (every argument as text) is read as the core's ints, for
    every operation, with a penalty and a calendar's schedule among the tiers."""
    policies = [rl.Policy("2/second;5/day", algorithm=algorithm, penalty=2, name=f"t{i}",
                          tz="Asia/Kathmandu" if algorithm == "fixed-window" else None)
                for i, algorithm in enumerate(ALGORITHMS)]
    ints, text = rl.MemoryBackend(), rl.MemoryBackend()
    now_ms = 1_800_000_000_000
    for n, (op, policy, wait, cost, offset) in enumerate(calls):
        now_ms += wait
        checks = [codec.Check(policies[policy], "u", cost)]
        if op in (codec.BOOK, codec.CANCEL) and policies[policy].algorithm != "sliding-log":
            continue
        call = codec.build(op, checks, "raw", now_us=now_ms * 1000 + 7, clock_ms=now_ms,
                           at_ms=now_ms + offset if op == codec.BOOK else None,
                           token=f"t{n - 1 if op == codec.CANCEL else n}"
                           if op in (codec.HIT, codec.BOOK, codec.CANCEL) else None)
        expected = ints.run(call)
        as_text: list[codec.Arg] = [str(arg) for arg in call.args]
        assert text.run(call._replace(args=as_text)) == expected, call.args
    assert ints._data.keys() == text._data.keys()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(
    st.tuples(st.sampled_from(["add", "remove", "trim", "drop"]),
              st.integers(0, 4),  # score
              st.lists(st.sampled_from([f"t{k}:{j}" for k in range(3) for j in range(1, 13)]),
                       min_size=1, max_size=12, unique=True)),
    max_size=40))
def test_the_log_s_bulk_operations_keep_redis_s_order(
    steps: list[tuple[str, int, list[str]]],
) -> None:
    """_Log.add / remove of many members in one pass (a large cost) leave exactly what
    one-by-one ZADD / ZREM leave: entries ordered by score, then member ("t:10" before
    "t:2"), as Redis orders a sorted set; a member added again moves."""
    log = _Log()
    model: dict[str, int] = {}
    for kind, score, members in steps:
        if kind == "add":
            log.add(score, list(members))
            model.update(dict.fromkeys(members, score))
        elif kind == "remove":
            log.remove(members)
            for member in members:
                model.pop(member, None)
        elif kind == "trim":  # ZREMRANGEBYSCORE -inf score, as a commit trims
            log.remove_entries(0, sum(1 for s in log.scores if s <= score))
            model = {m: s for m, s in model.items() if s > score}
        else:  # the newest entries, as a refund without a token takes them
            count = len(members)
            log.remove_entries(max(0, len(log.scores) - count), len(log.scores))
            ordered = sorted(model.items(), key=lambda item: (item[1], item[0]))
            model = dict(ordered[: max(0, len(ordered) - count)])
        assert log.entries == sorted((s, m) for m, s in model.items())
        assert log.members == model


def test_a_hit_of_a_million_on_a_sliding_log_completes(step_clock: StepClock) -> None:
    """A cost of 999,999 on 1,000,000 per 2 seconds: its members are merged in one sort, not
    inserted one by one (quadratic: minutes). Only the answers are asserted, not the time."""
    limiter = rl.Limiter(rl.MemoryBackend(), clock=step_clock, deny_cache=0)
    policy = rl.Policy("1000000/2 seconds")
    big = limiter.hit(policy, "u", cost=999_999)
    assert (big.allowed, big.remaining) == (True, 1)
    assert not limiter.hit(policy, "u", cost=2).allowed
    assert limiter.hit(policy, "u").remaining == 0
    limiter.refund(policy, "u", cost=999_999)
    assert limiter.peek(policy, "u").remaining == 999_999


LEASE_MS = 2000


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(st.tuples(st.sampled_from(["take", "give back", "renew", "wait"]),
                                st.integers(0, 6), st.integers(-LEASE_MS, 2 * LEASE_MS)),
                      max_size=60))
# A set read past its expiry, found again by a clock stepped back before the sweep came.
@example(steps=[("take", 0, 0), ("wait", 0, -1), ("take", 0, 0), ("wait", 0, LEASE_MS),
                ("wait", 0, -1)])
def test_in_flight_slots_answer_as_a_sorted_set_whose_ended_leases_go_first(
    steps: list[tuple[str, int, int]],
) -> None:
    """Takes, give-backs, renewals and waits across lease ends (and a clock stepped back, as
    NTP may) on one tier of 3 slots answer as a plain {token: lease end} model does, ended
    leases dropped before every count; and the tier's `soonest` never passes an end it
    holds (its ended leases are looked for only once it has passed)."""
    from ratelimit_mw.core.codec import Check

    clock = StepClock()
    backend = rl.MemoryBackend()
    limiter = rl.Limiter(backend, clock=clock, deny_cache=0)
    policy = rl.Policy.in_flight(3, lease=LEASE_MS / 1000)
    compiled = limiter.compile([(policy, 1)])
    checks = (Check(policy, "u", 1),)
    held: dict[str, int] = {}  # token -> when its lease ends, ms
    gone = 0  # when the tier's key expires: a lease after its last take or renewal (PEXPIRE)

    def live(now: int) -> dict[str, int]:
        return {t: end for t, end in held.items() if end > now} if gone > now else {}

    for kind, n, ms in steps:
        token, now = f"t{n}", clock.ms
        held = live(now)
        if kind == "take":
            decision = limiter.hit_compiled(compiled, ("u",), token=token)
            assert decision.allowed == (len(held) + 1 <= 3)
            if decision.allowed:
                held[token] = gone = now + LEASE_MS
            else:
                assert decision.retry_after == min(min(held.values()) - now, 1000) / 1000
        elif kind == "give back":
            limiter.give_back_all([(checks, token, 0)])
            held.pop(token, None)
        elif kind == "renew":
            kept = limiter.renew(checks, token)
            assert kept == (token in held or len(held) + 1 <= 3)
            if kept:
                held[token] = gone = now + LEASE_MS
        else:
            clock.advance(ms / 1000)
            now = clock.ms
            held = live(now)
        peek = limiter.peek(policy, "u")
        assert peek.remaining == 3 - len(held)
        assert peek.reset_after == ((max(held.values()) - now) / 1000 if held else 0.0)
        for slots in backend._data.values():
            assert not slots or slots.soonest <= min(slots.values())
