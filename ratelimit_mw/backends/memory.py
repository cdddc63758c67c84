"""MemoryBackend: the script's algorithms in Python, in this process.

It runs the very same wire protocol as lua/main.lua — same arguments, same integer
arithmetic, same reply — so one core serves both and a differential test
(tests/test_differential.py) holds the two to identical answers. State is per process:
gunicorn or uvicorn with several workers needs Redis.

By job: the storage and its sweep (`_store`), the algorithms (`_algorithms`: one check per
algorithm, with one signature), main.lua's flow over them (`_script`: phases 1 and 2,
refusals, upkeep), and here the two ways in. A hit from the limiter or the middleware takes
`hitter`: its compiled selection's tiers typed once, each hit straight to the checks and the
`Decision`, no call, no ARGV, no reply list. Every other call (peek, reset, bookings, the CLI,
the Lua differential test) takes `run`, the ARGV adapter over the same checks and writes
(tests/test_memory_typed.py holds the two to the same answers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from math import inf
from time import time_ns
from typing import TYPE_CHECKING, Any

from ratelimit_mw.backends._algorithms import _Tier
from ratelimit_mw.backends._script import (
    _UPKEEP,
    _from_text,
    _read_tiers,
    _Script,
    charges_of,
)
from ratelimit_mw.core.codec import (
    ScriptCall,
    admitted_decision,
    decode_generic,
    governing_tier,
    new_token,
)
from ratelimit_mw.core.decision import Decision, TierState
from ratelimit_mw.core.identity import CACHED_LENGTH, encode_identity, encode_short

if TYPE_CHECKING:
    from ratelimit_mw.core.compiled import Compiled
    from ratelimit_mw.core.policy import Policy
    from ratelimit_mw.core.rates import Rate

# A compiled hit on this store: (identities, token or None) -> its Decision.
Hitter = Callable[[Sequence[str], "str | None"], Decision]
ClockUs = Callable[[], int]
# One tier of a compiled call as `run` reads it from ARGV, before its key is known.
_Typed = tuple[str, int, int, int, int, str, str]
_new = tuple.__new__
# The clients whose keys a typed selection keeps: the k-th typed on a store keeps
# 16,384 // k, at least 256 (dynamic limits and costs type many selections: together they
# keep about 16,384 × ln k, not 16,384 × k). Emptied whole when full, as encode_short's cache.
_KEYS_KEPT, _KEYS_LEAST = 16_384, 256


class MemoryBackend(_Script):
    """In-process state; thread-safe, usable from sync and async code alike."""

    is_cluster = False
    in_process = True  # no round trip: give-backs go in place, not batched per loop turn

    def __init__(self) -> None:
        super().__init__()
        self._typed = 0  # selections typed on this store (`_bound`)

    def __repr__(self) -> str:
        return f"MemoryBackend(keys={len(self._data)})"

    def _bound(self) -> int:
        """How many clients' keys the next selection typed here keeps (`_KEYS_KEPT`)."""
        self._typed += 1
        return max(_KEYS_LEAST, _KEYS_KEPT // self._typed)

    # -- the I/O surface the limiters use -----------------------------------------------------
    def run(self, call: ScriptCall, deadline: float | None = None) -> list[int]:
        """One call, as lua/main.lua answers it. Hit (H), peek (P) or book (B): phase 1 asks
        every tier's check, writing nothing; phase 2 stores what the checks computed if every
        tier admits (a log once, by the first of its tiers, for the longest period reading
        it). A refusal goes on to `_refused`."""
        keys: Sequence[str] = call.keys
        argv: Sequence[Any] = call.args  # ints from the core, text from a raw caller
        if type(argv[4]) is not int:
            argv = _from_text(argv)
        op = argv[0]
        now_us = argv[1]
        # Not `with`: its __enter__/__exit__ lookups cost more than the lock itself.
        lock = self._lock
        lock.acquire()
        try:
            # The call's clock ("" for this process's, as Redis's TIME), and the sweep every
            # call makes before it reads anything.
            now_us = self._tick(now_us if type(now_us) is int
                                else None if now_us == "" else int(now_us))
            now = now_us // 1000
            n = argv[4]
            if op in _UPKEEP:
                return [self._upkeep(op, keys, _read_tiers(keys, argv, n), argv[2], now,
                                     now_us, charges_of(argv[3]) if op == "R" else ())]
            if op == "Z":
                return [1, self._pause(keys[n:], now + int(argv[3]), now)]
            # Anything else decides, as main.lua. A booking in the past is a booking now.
            at = max(int(argv[3]), now) if op == "B" else now
            tiers = _read_tiers(keys, argv, n)
            admitted, results, logs, bans = self._check_all(keys, tiers, at, now, now_us)
            if not admitted and op != "F":  # F: charged whether or not admitted
                return self._refused(op, keys, tiers, results, bans, at, now, now_us)
            if op == "P":
                self._cc_resets(tiers, results, now)
                reply = [1]
                for ok, before, retry, reset_now, _, _, _ in results:
                    reply += (1 if ok else 0, before, retry, reset_now, 0)
                reply.append(now_us)
                return reply
            self._commit(keys, tiers, results, logs, argv[2], at, now)
            if op == "F":
                return [1]
            reply = [1]
            for (_, before, retry, _, reset_hit, _, _), tier in zip(results, tiers, strict=True):
                reply += (1, before - tier[3], retry, reset_hit, 0)
            reply.append(now_us)  # admitted: the store's clock, as main.lua
            return reply
        finally:
            lock.release()
    # -- the typed hit: a Compiled's tiers read once, each hit straight to its Decision ------
    def hitter(self, compiled: Compiled, clock_us: ClockUs | None = None) -> Hitter | None:
        """The hit of `compiled` on this store, ``hit(identities, token)``, for the limiter
        to build once per (Compiled, store, clock, metrics hook): the same checks and writes
        as `run` (`_check_all`, `_commit`), its tiers typed once here, on `clock_us` (µs,
        read before the store's lock is taken; None: this process's, as Redis's TIME). Its
        answer is the hit's `Decision`, as `codec.decoded` reads main.lua's reply. None
        where the arguments vary per request (a penalty's end, a calendar's schedule)
        or a policy is named twice: then the limiter builds the call and `run` answers it,
        as it does for a subclass with a `run` or `arun` of its own."""
        tiers = self._tiers_of(compiled)
        if tiers is None:
            return None
        # Per tier: which identity it reads, its policy and rate (the Decision's layout).
        owners = [(i, policy, rate) for i, policy in enumerate(compiled.policies)
                  for rate in policy.rates]
        if len(tiers) == 1:
            return self._one_tier(compiled, tiers[0], owners[0][1], owners[0][2], clock_us)
        lock = self._lock
        log = compiled.log
        policies = compiled.policies
        kept, keyed = self._keyed(compiled, tiers, self._bound())
        fixed = governing_tier([policy.algorithm for _, policy, _ in owners])
        # Slots go into the set their check read unless two slot tiers write to one key.
        suffixes = [suffix for each in compiled.key_suffixes for suffix in each]
        sets = [suffixes[j] for j, tier in enumerate(tiers) if tier[0] == "cc"]
        shared = len(set(sets)) < len(sets)
        # The tiers reading each sliding log (its suffix), all of one policy where the log's
        # key is known now: then it is written once, by the first of them, for the longest
        # period reading it, as `_commit` finds at run time.
        readers: dict[str, list[int]] = {}
        for j, tier in enumerate(tiers):
            if tier[0] == "sl":
                readers.setdefault(suffixes[j], []).append(j)
        # Without a ban, and with each log read by one policy, each tier's check and write
        # is its own: `_check_all` and `_commit` unrolled, over the checks found now.
        plain = (all(not tier[4] for tier in tiers)
                 and all(len({owners[j][0] for j in js}) == 1 for js in readers.values()))
        if plain and compiled.slotted:
            return self._rate_and_slots(compiled, tiers, owners, kept, keyed, clock_us)
        # Per tier: its check and arguments, what it writes (0: its value, if any; 1: its
        # slots; 2: its log, for the longest period reading it; 3: nothing, another tier
        # writes its log) and that period; its TierState's identity, policy and rate; its
        # index, and whether it may govern (where the layout does not fix the tier that
        # does: a rate's, or any among slots alone), ranked as `admitted_decision` ranks.
        rated = any(tier[0] != "cc" for tier in tiers)
        steps = []
        for j, (algo, limit, period, cost, _, _, cal) in enumerate(tiers):
            js = readers.get(suffixes[j], ()) if algo == "sl" else ()
            write = 1 if algo == "cc" else 0 if not js else 2 if js[0] == j else 3
            steps.append((self._checks[algo], limit, period, cost, cal, write,
                          max(tiers[k][2] for k in js) if write == 2 else 0, *owners[j], j,
                          fixed is None and (algo != "cc" or not rated)))
        data, expires, scheduled = self._data, self._expires, self._scheduled
        due_times = self._due_times

        def hit(identities: Sequence[str], token: str | None) -> Decision:
            if log and not token:
                token = new_token()
            found = kept.get(identities) if type(identities) is tuple else None
            keys, typed = found if found is not None else keyed(identities)
            stamp = None if clock_us is None else clock_us()  # the app's clock, not locked
            states = []
            # The governing tier: fixed, else found as the states are built (`ranked`).
            governs, least, latest = fixed, inf, 0.0
            lock.acquire()
            try:
                # `_tick`, written out: every request
                now_us = time_ns() // 1000 if stamp is None else stamp
                now = now_us // 1000
                if due_times[0] <= now:
                    self._sweep(now, now - self._called_at)
                self._called_at = now
                if plain:
                    results = []
                    admitted = True
                    # zip without a keyword: a keyword sends zip through its slower
                    # argument parser. `steps` and `keys` are one per tier.
                    for step, key in zip(steps, keys):  # noqa: B905
                        result = step[0](key, step[1], step[2], step[3], step[4], now, now,
                                         now_us)
                        if not result[0]:
                            admitted = False
                        results.append(result)
                    if admitted:
                        mine = token or ""
                        # Each tier's write, as `_commit`'s, and its state.
                        for result, (_, _, period, cost, _, write, longest, i, policy, rate, j,
                                     ranked), key in zip(results, steps, keys):  # noqa: B905
                            if px := result[6]:  # SET value PX px
                                data[key] = result[5]
                                expires[key] = until = now + px
                                if key not in scheduled:
                                    self._schedule(key, until)
                            elif write == 1:
                                self._cc_take(key, self._cc_live(key, now) if shared
                                              else result[5], period, cost, mine, now)
                            elif write == 2:
                                self._sl_commit(key, result[5], now, cost, mine, longest, now)
                            left = result[1] - cost
                            if left < 0:
                                left = 0
                            reset = result[4] / 1000
                            states.append(_new(TierState, (
                                policy, rate, identities[i], True, left, 0.0, reset, False)))
                            if ranked and (left < least or (left == least and reset > latest)):
                                governs, least, latest = j, left, reset
                else:
                    admitted, results, logs, _ = self._check_all(keys, typed, now, now, now_us)
                    if admitted:
                        self._commit(keys, typed, results, logs, token or "", now, now)
                if not admitted:  # a peek's reply: a hit's adds the figures a deny cache keeps
                    reply = self._refused("P", keys, typed, results, None, now, now, now_us)
            finally:
                lock.release()
            if not admitted:  # read as `codec.decoded` reads main.lua's
                return decode_generic(tuple(zip(policies, identities, strict=True)), reply,
                                      None)
            if not states:  # `_commit` wrote them: their states, as the loop's
                for result, (_, _, _, cost, _, _, _, i, policy, rate, _, _) in zip(  # noqa: B905
                        results, steps):
                    left = result[1] - cost
                    states.append(_new(TierState, (policy, rate, identities[i], True,
                                                   left if left > 0 else 0, 0.0,
                                                   result[4] / 1000, False)))
            return admitted_decision(states, now_us, None, governs)

        return hit

    def releaser(self, compiled: Compiled, slots_only: bool = False
                 ) -> Callable[[Sequence[str], str, int | None, int], None] | None:
        """The give-back of what a hit of `compiled` recorded, by its token, on this store:
        `run`'s refund (R) with the tiers typed once; ``release(identities, token, now_us,
        charged_us)``, `charged_us` when the hit was charged (0: not known), each tier then
        giving back only within the window it was charged in. `slots_only`: its in-flight
        slots alone (what a holder gives back when its response ends), for the identities
        of the whole hit. None where `hitter` is None."""
        tiers = self._tiers_of(compiled)
        if tiers is None:
            return None
        lock = self._lock
        kept, keyed = self._keyed(compiled, tiers, self._bound())
        # Slots (most responses' give-back) have no window to keep to: each given back alone.
        held = [(j, tier[3]) for j, tier in enumerate(tiers) if tier[0] == "cc"]
        windowed = len(held) < len(tiers)
        if slots_only or not windowed:
            due_times = self._due_times
            one = len(held) == 1  # one in-flight limit: nearly every holder
            j0, cost0 = held[0] if held else (0, 0)

            def release_slots(identities: Sequence[str], token: str, now_us: int | None,
                              charged_us: int) -> None:
                found = kept.get(identities) if type(identities) is tuple else None
                keys = (found if found is not None else keyed(identities))[0]
                lock.acquire()
                try:
                    now = time_ns() // 1_000_000 if now_us is None else now_us // 1000
                    if due_times[0] <= now:  # `_tick`, written out
                        self._sweep(now, now - self._called_at)
                    self._called_at = now
                    if one:
                        self._cc_release(keys[j0], cost0, token, now)
                        return
                    # One give-back per set, the largest cost's (as main.lua's R).
                    most: dict[str, int] = {}
                    for j, cost in held:
                        if most.get(keys[j], 0) < cost:
                            most[keys[j]] = cost
                    for key, cost in most.items():
                        self._cc_release(key, cost, token, now)
                finally:
                    lock.release()

            return release_slots

        def release(identities: Sequence[str], token: str, now_us: int | None,
                    charged_us: int) -> None:
            found = kept.get(identities) if type(identities) is tuple else None
            keys, typed = found if found is not None else keyed(identities)
            lock.acquire()
            try:
                now_us = self._tick(now_us)
                self._upkeep("R", keys, typed, token, now_us // 1000, now_us,
                             ((charged_us, None),) if charged_us else ())
            finally:
                lock.release()

        return release

    def _tiers_of(self, compiled: Compiled) -> list[_Typed] | None:
        """`compiled`'s tiers as `run` reads them from ARGV, read once; None where the
        arguments vary per request (a penalty's end, a calendar's schedule) or for a
        subclass with a `run` or `arun` of its own (one watching its calls)."""
        cls = type(self)
        if (not compiled.static or cls.run is not MemoryBackend.run
                or cls.arun is not MemoryBackend.arun):
            return None
        tail = compiled.tail
        return [tuple(tail[1 + 7 * i: 8 + 7 * i])  # type: ignore[misc]
                for i in range(int(tail[0]))]

    @staticmethod
    def _keyed(compiled: Compiled, tiers: list[_Typed], bound: int
               ) -> tuple[dict[tuple[str, ...], tuple[list[str], list[_Tier]]],
                          Callable[[Sequence[str]], tuple[list[str], list[_Tier]]]]:
        """The keys and typed tiers of a call of `compiled` for some identities, kept per
        identities as `_one_tier` keeps its keys (`bound` of them): the kept ones, for a
        hit to look up in place, and the function that finds them."""
        prefix, suffixes = compiled.prefix, compiled.key_suffixes
        kept: dict[tuple[str, ...], tuple[list[str], list[_Tier]]] = {}

        def keyed(identities: Sequence[str]) -> tuple[list[str], list[_Tier]]:
            if type(identities) is not tuple:
                identities = tuple(identities)
            found = kept.get(identities)
            if found is not None:
                return found
            if len(identities) == 1:
                identity = identities[0]
                # encode_identity, its cache asked here: the same clients come back.
                encoded = (encode_short(identity) if len(identity) <= CACHED_LENGTH
                           else encode_identity(identity))
                head = f"{prefix}:{{{encoded}}}:"
                keys = [head + suffix for suffix in suffixes[0]]
            else:
                keys = [f"{prefix}:{{{encode_identity(identity)}}}:{suffix}"
                        for identity, each in zip(identities, suffixes, strict=True)
                        for suffix in each]
            typed = [(*tier, key) for tier, key in zip(tiers, keys, strict=True)]
            if all(len(identity) <= CACHED_LENGTH for identity in identities):
                if len(kept) >= bound:
                    kept.clear()
                kept[identities] = (keys, typed)
            return keys, typed

        return kept, keyed

    def _one_tier(self, compiled: Compiled, tier: tuple[str, int, int, int, int, str, str],
                  policy: Policy, rate: Rate, clock_us: ClockUs | None) -> Hitter:
        """`hitter` for one policy of one rate (most routes): the same check and writes, the
        loops over tiers unrolled."""
        prefix = compiled.prefix
        suffix = compiled.key_suffixes[0][0]
        algo, limit, period, cost, _, _, cal = tier
        check = self._checks[algo]
        lock = self._lock
        data, expires, scheduled = self._data, self._expires, self._scheduled
        due_times = self._due_times
        log = compiled.log
        rate_limit = rate.limit

        # Each identity's key, kept as encode_short keeps its encoding: the same clients
        # come back (`_bound`, emptied whole when full).
        keys: dict[str, str] = {}
        bound = self._bound()

        def hit(identities: Sequence[str], token: str | None) -> Decision:
            identity = identities[0]
            key = keys.get(identity)
            if key is None:
                if len(identity) > CACHED_LENGTH:
                    key = f"{prefix}:{{{encode_identity(identity)}}}:{suffix}"
                else:
                    if len(keys) >= bound:
                        keys.clear()
                    key = keys[identity] = f"{prefix}:{{{encode_short(identity)}}}:{suffix}"
            if log and not token:
                token = new_token()
            if clock_us is None:  # the store's clock, read under its lock as Redis's TIME
                lock.acquire()
                now_us = time_ns() // 1000
            else:  # the app's, read before it
                now_us = clock_us()
                lock.acquire()
            try:
                now = now_us // 1000
                if due_times[0] <= now:  # `_tick`, written out: every request
                    self._sweep(now, now - self._called_at)
                self._called_at = now
                ok, before, retry, reset_now, reset_ms, value, px = check(
                    key, limit, period, cost, cal, now, now, now_us)
                if ok:  # recorded as `_commit` records it (a refusal records nothing)
                    if px:  # a value with a time to live
                        data[key] = value
                        expires[key] = until = now + px
                        if key not in scheduled:
                            self._schedule(key, until)
                    elif algo == "sl":  # a log, kept for its one period
                        self._sl_commit(key, value, now, cost, token or "", period, now)
                    else:  # slots, into the set the check read
                        self._cc_take(key, value, period, cost, token or "", now)
            finally:
                lock.release()
            if not ok:  # as `codec.decoded` reads one refused tier's reply (its reset its own)
                left = before if before > 0 else 0
                wait = inf if retry < 0 else retry / 1000
                reset = reset_now / 1000
                return _new(Decision, (False, rate_limit, left, wait, reset, policy, rate,
                                       identity, False, (_new(TierState, (
                                           policy, rate, identity, False, left, wait, reset,
                                           False)),), None, 0))
            left = before - cost
            if left < 0:
                left = 0
            reset = reset_ms / 1000
            return _new(Decision, (True, rate_limit, left, 0.0, reset, policy, rate, identity,
                                   False, (_new(TierState, (policy, rate, identity, True, left,
                                                            0.0, reset, False)),),
                                   None, now_us))

        return hit

    def _rate_and_slots(self, compiled: Compiled, tiers: list[_Typed],
                        owners: list[tuple[int, Policy, Rate]],
                        kept: dict[tuple[str, ...], tuple[list[str], list[_Tier]]],
                        keyed: Callable[[Sequence[str]], tuple[list[str], list[_Tier]]],
                        clock_us: ClockUs | None) -> Hitter:
        """`hitter` for a rate and then an in-flight limit (slots held while each response
        runs), the rate governing: the same checks and writes, the loops unrolled."""
        (algo, limit, period, cost, _, _, cal), (_, most, lease, held, _, _, _) = tiers
        (i, policy, rate), (k, slot_policy, slot_rate) = owners
        check, cc_check = self._checks[algo], self._cc_check
        lock = self._lock
        data, expires, scheduled = self._data, self._expires, self._scheduled
        due_times = self._due_times
        policies = compiled.policies
        rate_limit = rate.limit

        def hit(identities: Sequence[str], token: str | None) -> Decision:
            if not token:
                token = new_token()
            found = kept.get(identities) if type(identities) is tuple else None
            keys, typed = found if found is not None else keyed(identities)
            key, slots_key = keys
            stamp = None if clock_us is None else clock_us()  # the app's clock, not locked
            lock.acquire()
            try:
                now_us = time_ns() // 1000 if stamp is None else stamp
                now = now_us // 1000
                if due_times[0] <= now:  # `_tick`, written out: every request
                    self._sweep(now, now - self._called_at)
                self._called_at = now
                result = check(key, limit, period, cost, cal, now, now, now_us)
                slots = cc_check(slots_key, most, lease, held, "", now, now, now_us)
                admitted = result[0] and slots[0]
                if admitted:  # each tier's write, as `_commit`'s
                    if px := result[6]:
                        data[key] = result[5]
                        expires[key] = until = now + px
                        if key not in scheduled:
                            self._schedule(key, until)
                    elif algo == "sl":
                        self._sl_commit(key, result[5], now, cost, token, period, now)
                    self._cc_take(slots_key, slots[5], lease, held, token, now)
                else:
                    reply = self._refused("P", keys, typed, [result, slots], None, now, now,
                                          now_us)
            finally:
                lock.release()
            if not admitted:
                return decode_generic(tuple(zip(policies, identities, strict=True)), reply,
                                      None)
            left = result[1] - cost
            if left < 0:
                left = 0
            free = slots[1] - held
            if free < 0:
                free = 0
            reset, identity = result[4] / 1000, identities[i]
            return _new(Decision, (True, rate_limit, left, 0.0, reset, policy, rate, identity,
                                   False, (_new(TierState, (policy, rate, identity, True, left,
                                                            0.0, reset, False)),
                                           _new(TierState, (slot_policy, slot_rate,
                                                            identities[k], True, free, 0.0,
                                                            slots[4] / 1000, False))),
                                   None, now_us))

        return hit

    async def arun(self, call: ScriptCall, deadline: float | None = None) -> list[int]:
        # Pure CPU for a few microseconds under a lock held only by such calls: no await needed.
        return self.run(call)
    # -- the start-up check (``Limiter.ping``), the same answer as the Redis backends' --------
    def ping(self) -> dict[str, Any]:
        """Always reachable: this process. No script is loaded, so ``script_sha`` is empty."""
        return {"backend": "memory", "server": None, "version": None, "cluster": False,
                "nodes": 1, "rtt_ms": 0.0, "script_sha": ""}

    async def aping(self) -> dict[str, Any]:
        return self.ping()
