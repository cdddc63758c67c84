# Generated from ratelimit_mw/_async/limiter.py by scripts/unasync.py: do not edit.
"""The limiter's I/O, one way through for every operation.

A call is built by the core (`Compiled.call`), run by the backend (``await
backend.run(call, deadline)``: the backend keeps the deadline, cold or warm) and read back by
the core (`codec.decoded`); a store in process answers a hit by its own typed hit instead
(`in_process`: the memory backend's, straight to the Decision, no call). A hit asks the
deny cache first, once. The one source of
both limiters is `ratelimit_mw/_async/limiter.py`: `_sync/limiter.py` (`Limiter`) is generated
from it by ``python scripts/unasync.py``, which the suite checks is current.
"""

from __future__ import annotations

import datetime as _dt
import math
import secrets
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ratelimit_mw._sync import handles
from ratelimit_mw._synchronization import Flights, bounded_sync, side_sync, sleep_sync
from ratelimit_mw.arguments import checked
from ratelimit_mw.backends.base import SyncBackend
from ratelimit_mw.backends.memory import MemoryBackend
from ratelimit_mw.backends.ping import ping_failed, pinger
from ratelimit_mw.core import codec
from ratelimit_mw.core.codec import Check, GiveBack
from ratelimit_mw.core.compiled import Compiled
from ratelimit_mw.core.decision import Booking, Decision
from ratelimit_mw.core.deny_cache import Lapsed
from ratelimit_mw.core.errors import BackendError, ConfigurationError, RateLimitExceeded
from ratelimit_mw.core.policy import DEFAULT_LEASE, Policy
from ratelimit_mw.engine import LimiterOptions, _Shared
from ratelimit_mw.metrics import ADMITTED, REFUSED

_ONE = 1

if TYPE_CHECKING:  # annotations only (they are strings at run time): no dependency on 3.10
    from typing_extensions import Unpack


class Limiter(_Shared):
    """``Limiter(RedisBackend.from_url(...))``, or ``Limiter()`` (memory).

    ``clock`` (tests only) replaces Redis's clock with a callable returning seconds;
    ``sleep`` replaces the sleep of ``acquire``; ``deny_cache`` is how many refusals are
    answered in process, exactly as the store would, for at most ``deny_cache_max_age``
    seconds (0 turns the cache off); ``metrics`` is a hook with ``observe(event, policy,
    seconds)`` (see `ratelimit_mw.metrics`).
    """

    asynchronous = side_sync

    def __init__(self, backend: SyncBackend | None = None, prefix: str = "rl", *,
                 sleep: Callable[[float], None] | None = None,
                 **options: Unpack[LimiterOptions]) -> None:
        super().__init__(MemoryBackend() if backend is None else backend, prefix,
                         needs="run", sleep=sleep or sleep_sync, **options)
        self._flights = Flights()

    def hit_compiled(self, compiled: Compiled, identities: Sequence[str],
                     timeout: float | None = None, *, cached: bool = True,
                     token: str | None = None, asked: bool = False) -> Decision:
        """The hit of `compiled` (`compile`) for these identities, one per check, all or
        nothing: a store in this process decides it there (`in_process`); else the deny
        cache's answer (no I/O, no deadline), else the store's within `timeout` seconds
        (TimeoutError after it: the middleware's deadline). Every hit takes this way (`hit`,
        the middleware's handler: its first step, in process, taken there). `cached` False:
        the store answers, and the cache is neither asked nor told (the middleware's breaker
        probes so: a cached answer would close it on a store that was never asked). `token`
        names what the hit holds (`Compiled.token`: a sliding log's entries, in-flight
        slots), to give them back by it later.

        A refusal of this very hit that has just lapsed is asked about once for every
        request that comes while the question is out (`_refresh`, which sends that one
        call with `asked`: the cache told, not asked)."""
        backend = self._backend
        kept = compiled.here  # in process: the store's own decision, no deny cache before it
        here = kept[1] if kept[0] is self._built else self._here(compiled)
        if here is not None:
            return here(identities, token)
        checks = None
        if cached and not asked:
            deny = self._deny
            if deny is not None and deny.entries:
                checks, found = self._cached(deny, compiled, identities)
                if type(found) is Decision:
                    return found
                if isinstance(found, Lapsed):
                    return bounded_sync(
                        self._refresh(compiled, identities, checks, token), timeout)
            if self._flights:
                checks = checks or compiled.checks(identities)
                if checks in self._flights:
                    return bounded_sync(
                        self._refresh(compiled, identities, checks, token), timeout)
        if backend.is_cluster and compiled.spans_slots(identities):
            return bounded_sync(
                self._across_slots(checks or compiled.checks(identities), cached, token),
                timeout)
        deny, metrics, clock = self._deny, self._metrics, self._clock
        now_us = None if clock is None else round(clock() * 1_000_000)
        # Read before the write: a refusal is counted down from the moment its call was
        # sent, so a pause after the write cannot make the deny cache outlive the store
        # (`_cache_now`: the test clock, else a monotonic one).
        sent = 0 if deny is None else (time.monotonic_ns() // 1000 if now_us is None
                                       else now_us)
        started = time.perf_counter() if metrics is not None else 0.0
        call = compiled.call(identities, now_us, token,
                             0 if compiled.static else self._clock_ms())
        try:
            reply = backend.run(call, timeout)
        except BackendError:
            self._failed(checks or compiled.checks(identities), started)
            raise
        if reply[0] == 1 and metrics is None and (deny is None or not deny.index):
            return codec.decoded(call, reply)  # admitted, nothing held to forget
        return self._settled(call, compiled, identities, checks, reply, sent, cached, started)

    def _refresh(self, compiled: Compiled, identities: Sequence[str],
                 checks: tuple[Check, ...], token: str | None = None) -> Decision:
        """A refusal of this hit has lapsed (its age bound, or its numbers' validity), or
        another request is asking about one: ask the store once for every request of the
        same hit that comes while the question is out, then decide as if this request came
        just after that call: the store's refusal from the deny cache, or, if it was
        admitted (nothing to replay), a call of its own. If it failed or was cancelled, the
        waiting requests ask again together: the first to wake sends the call."""
        flights = self._flights
        leader = flights.get(checks)
        if leader is None:
            leader = flights.lead(checks)
            answered = False
            try:
                decision = self.hit_compiled(compiled, identities, token=token,
                                                   asked=True)
                answered = True
                return decision
            finally:
                flights.land(checks, leader, answered)
        if flights.follow(leader):
            return self._refresh(compiled, identities, checks, token)
        deny = self._deny
        found = None if deny is None else deny.find(checks, self._cache_now())
        if type(found) is Decision:
            return found
        return self.hit_compiled(compiled, identities, token=token, asked=True)

    def _across_slots(self, checks: tuple[Check, ...], cached: bool,
                      token: str | None = None) -> Decision:
        """A hit whose checks live in several cluster slots: a call per slot, in order; if
        one refuses, what the earlier ones admitted is given back, so that a refused
        request consumes nothing as nearly as two slots allow.

        After a refusal the later slots are still asked, as one script asks every tier, but
        as peeks that record nothing: the Retry-After is the longest wait of them all, while
        a refused request never holds another slot's quota even for a moment. A later slot
        that refuses under a penalty is then hit, which records nothing on a refusal and
        starts its ban; if it admits after all (a race), that hit is given back too. Only a
        refusal that one call decided is remembered, so the deny cache forgets these
        checks."""
        started = time.perf_counter()
        backend = self._backend
        decisions: list[Decision] = []
        recorded: list[codec.ScriptCall] = []
        refused = False
        try:
            for call in self._slot_calls(codec.HIT, checks, token):
                if not refused:
                    decision = codec.decoded(call, backend.run(call))
                    if decision.allowed:
                        recorded.append(call)
                else:
                    decision = codec.decoded(call, backend.run(codec.peek_of(call)))
                    if not decision.allowed and any(policy.penalty is not None
                                                    for policy, _ in call.layout):
                        decision = codec.decoded(call, backend.run(call))
                        if decision.allowed:
                            recorded.append(call)
                decisions.append(decision)
                refused = refused or not decision.allowed
            if refused:
                for call in recorded:
                    backend.run(codec.refund_of(call))
        except BackendError:
            self._failed(checks, started)
            raise
        finally:
            if cached:
                self._forget(checks)
        decision = codec.merge(decisions)
        self._report(checks, ADMITTED if decision.allowed else REFUSED,
                     time.perf_counter() - started)
        return decision

    def check(self, checks: Sequence[Check]) -> Decision:
        """Hit several policies at once, all or nothing."""
        checks = [checked(*check) for check in checks]
        return self.hit_compiled(*self.compiled_checks(checks))

    def hit(self, policy: Policy | str, identity: str, cost: int = 1) -> Decision:
        """Check and record one hit of `cost`; nothing is recorded when refused."""
        # The usual hit, a cost of one: in CPython every int 1 is this one object (a bool or
        # a float is not), and any other takes the checked way below.
        if cost is _ONE and type(identity) is str:
            try:  # in process: its decision, kept by its policy
                here = self._hits_here[policy]
            except (KeyError, TypeError):  # not kept yet; unhashable: `_compiled_hit` says
                pass
            else:  # outside the try: what the hit raises is the caller's
                return here((identity,), None)
        compiled = self._compiled_hit(policy, identity, cost)
        built = self._here_of(compiled, policy, cost)  # `hit_compiled`'s first step, taken here
        if built is not None:
            return built((identity,), None)
        return self.hit_compiled(compiled, (identity,))

    def messages(self, policy: Policy | str) -> handles.Messages:
        """A budget for the messages of one connection (a WebSocket, a stream), counted
        apart from every other: ``messages = limiter.messages("10/second")`` when it opens,
        then ``if not messages.hit(): ...`` per message (a Decision: False when
        refused, with its ``retry_after``)."""
        return handles.Messages(self, checked(policy, "conn", 1).policy,
                        "conn:" + secrets.token_hex(8))

    def _give_back(self, checks: Sequence[Check], timeout: float | None = None,
                   token: str | None = None, charge: str | None = None) -> None:
        """Give back what an admitted `check` recorded (the middleware's count_when, the
        slots a response held), each call within `timeout`; by the hit's `token`, exactly
        what it recorded; `charge` (a settle's): only within the window it was charged in."""
        self.give_back_all(((checks, token, 0),), timeout, charge)

    def give_back_all(self, hits: Sequence[GiveBack], timeout: float | None = None,
                      charge: str | None = None) -> None:
        """`_give_back` of several admitted hits (the responses that ended in one turn of
        the event loop) in one call, or on a cluster one per identity's slot, each only
        within the window it was charged in: every call is sent, a node that fails one does
        not keep the others; then the first error."""
        if charge is None and self.local_store and self.give_back_here(hits):  # in process
            return
        failed: Exception | None = None
        for call in self._release_calls(hits, charge):
            try:
                self._backend.run(call, timeout)
            except Exception as exc:  # noqa: PERF203 (each call is tried; 3.11's try is free)
                failed = failed or exc
        if failed is not None:
            raise failed

    def renew(self, checks: Sequence[Check], token: str,
               timeout: float | None = None) -> bool:
        """Push the leases of the in-flight slots that the hit named `token` holds; False
        when one had ended and its slot has gone to someone else meanwhile (one that ended
        and is still free is taken again)."""
        held = True
        for call in self._slot_calls(codec.RENEW, checks, token):
            reply = self._backend.run(call, timeout)
            held = held and bool(reply[0])
        return held

    def peek(self, policy: Policy | str, identity: str,
             timeout: float | None = None) -> Decision:
        """The state as it stands: would a hit of cost 1 be admitted? Records nothing."""
        call = self._single(codec.PEEK, policy, identity)
        return codec.decoded(call, self._backend.run(call, timeout))

    def reset(self, policy: Policy | str, identity: str) -> None:
        """Forget every counter and any ban of this identity under this policy."""
        self._backend.run(self._single(codec.RESET, policy, identity))

    def pause(self, policy: Policy | str, identity: str, seconds: float) -> float:
        """Refuse this identity under this policy for `seconds` from now, on every limiter
        sharing the store (an upstream's 429 with Retry-After): the ban of a penalty, started
        without a refusal, and ended by itself; a ban that ends later stays. It binds the
        policies of this name and algorithm that have a penalty (``penalty=lambda: None``
        obeys pauses and starts no ban of its own). Returns when the pause ends, in seconds
        since the epoch on the store's clock."""
        if (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                or not 0 < seconds < math.inf):
            raise ConfigurationError(f"a pause lasts a number of seconds > 0, got {seconds!r}; "
                                     "e.g. limiter.pause(policy, identity, 2.5)")
        check = checked(policy, identity, 1)
        self._forget((check,))
        reply = self._backend.run(self._call(
            self.compile(((check.policy, 1),)), (identity,), codec.PAUSE,
            math.ceil(seconds * 1000)))
        return int(reply[1]) / 1000

    def refund(self, policy: Policy | str, identity: str, cost: int = 1) -> None:
        """Give back an admitted hit of `cost` (e.g. a login that turned out to succeed)."""
        self._backend.run(self._single(codec.REFUND, policy, identity, cost))

    def acquire(self, policy: Policy | str, identity: str, cost: int = 1,
                timeout: float | None = None, wait_out: bool = False) -> Decision:
        """Wait until a hit is admitted; RateLimitExceeded if it cannot be within `timeout`.

        A refusal whose wait would end past the timeout raises at once (its
        ``retry_after`` says how long the quota is away), unless `wait_out`: then the rest
        of the timeout is slept and the hit tried once more before raising. The wait is
        each refusal's retry_after with jitter (`codec.acquire_wait`). Backend
        errors are retried with backoff while `timeout` leaves time (`codec.backoff_wait`),
        then raised as BackendError; at once when no timeout is given, since waiting for
        quota must not turn into waiting forever for a store that is down."""
        return self._wait(self._compiled_hit(policy, identity, cost), (identity,),
                                timeout, wait_out=wait_out)

    def _wait(self, compiled: Compiled, identities: Sequence[str],
              timeout: float | None, token: str | None = None, *,
              wait_out: bool = False) -> Decision:
        """`acquire`'s loop for any compiled hit (every try under the same `token`). A
        refusal for a slot in flight is asked about again soon, 10 ms then twice as late up
        to 200 ms: a holder may give its slot back at any moment."""
        if timeout is not None and (isinstance(timeout, bool) or not timeout >= 0):
            raise ConfigurationError(f"timeout must be None or >= 0 seconds, got {timeout!r}")
        started = self.monotonic()
        failures = 0
        poll = 0.01
        while True:
            try:
                decision = self.hit_compiled(compiled, identities, token=token)
            except BackendError:
                failures += 1
                left = None if timeout is None else timeout - (self.monotonic() - started)
                backoff = codec.backoff_wait(failures, left, self._rng)
                if backoff is None:
                    raise
                self._sleep(backoff)
                continue
            failures = 0
            if decision.allowed:
                return decision
            cap = None
            if decision.policy is not None and decision.policy.algorithm == "concurrency":
                cap, poll = poll, min(poll * 2, 0.2)
            wait = codec.acquire_wait(decision, self.monotonic() - started, timeout, self._rng,
                                      cap, wait_out)
            if wait is None:
                raise RateLimitExceeded(decision)
            self._sleep(wait)

    def reserve(self, policy: Policy | str, identity: str, at: _dt.datetime,
                cost: int = 1) -> Decision:
        """Book `cost` at time `at` if every window containing `at` stays within its limit."""
        call = self._single(codec.BOOK, policy, identity, cost, at)
        return codec.decoded(call, self._backend.run(call))

    def cancel(self, booking: Booking) -> None:
        """Take back an admitted reservation (``decision.booking``)."""
        self._backend.run(self._cancel_call(booking))

    def concurrent(self, name: str, slots: int, *, lease: float = DEFAULT_LEASE,
                   timeout: float | None = None) -> handles.Slot:
        """A semaphore shared by every process on the store: ``with
        limiter.concurrent("vendor", 50):`` runs the block holding one of `slots`, waiting
        up to `timeout` seconds for one (None: as long as it takes; RateLimitExceeded
        after it). A holder that dies loses its slot when its `lease` (seconds) ends; a
        live one renews it every third of the lease."""
        return handles.Slot(self, self._in_flight(name, slots, lease), timeout)

    def charge(self, policy: Policy | str, identity: str, estimate: int, *,
               calls: Policy | str | None = None,
               concurrency: Policy | int | None = None,
               timeout: float | None = None, wait_out: bool = False) -> handles.Ticket:
        """Reserve an `estimate` of a cost known only afterwards (an LLM call's tokens),
        waiting as `acquire` does; settle it with ``ticket.settle(actual)``. In the
        same atomic call, `calls` counts the call itself (e.g. "500/minute" requests beside
        "90000/minute" tokens) and `concurrency` takes a slot of this identity's in-flight
        limit (N, or `Policy.in_flight`), held until the ticket is settled or released.
        `timeout` and `wait_out` are `acquire`'s: a wait longer than the timeout raises
        RateLimitExceeded at once (with its ``retry_after``) unless `wait_out`."""
        check = checked(policy, identity, estimate)
        items = [(check.policy, estimate)]
        if calls is not None:
            items.append((checked(calls, identity, 1).policy, 1))
        held: tuple[Check, ...] = ()
        if concurrency is not None:
            slots = concurrency if isinstance(concurrency, Policy) else self._in_flight(
                f"{check.policy.name} in flight", concurrency, DEFAULT_LEASE)
            if slots.algorithm != "concurrency":
                raise ConfigurationError(f"concurrency is a number of slots or a "
                                         f"Policy.in_flight(...), got {concurrency!r}")
            held = (Check(slots, identity, 1),)
            items.append((slots, 1))
        compiled = self.compile(items)
        token = compiled.token() or ""
        decision = self._wait(compiled, (identity,) * len(items), timeout, token,
                                    wait_out=wait_out)
        return handles.Ticket(self, check, token, decision, held)

    def ping(self) -> dict[str, Any]:
        """Ask the store whether it is there (a start-up check, e.g. in a lifespan handler):
        the backend's own report. Raises BackendError when it cannot answer."""
        check = pinger(self._backend, "ping")
        try:
            return check()  # type: ignore[no-any-return]
        except BackendError:
            raise
        except Exception as exc:
            raise ping_failed(exc) from exc
