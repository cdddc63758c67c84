"""Limiter and AsyncLimiter: thin shells that move a ScriptCall to a backend and back.

Every decision is made by the pure core (`ratelimit_mw.core.plans`); the shells add only the I/O
(a backend call, a sleep). The two share everything through `_Shared` and differ only in
`run`/`await run` and `sleep`/`await asyncio.sleep`.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import functools
import random
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

from ratelimit_mw.backends.base import AsyncBackend, SyncBackend, bounded
from ratelimit_mw.backends.memory import MemoryBackend
from ratelimit_mw.core import plans
from ratelimit_mw.core.decision import Booking, Decision
from ratelimit_mw.core.deny_cache import DEFAULT_MAX_AGE, LAPSED, DenyCache, Lapsed
from ratelimit_mw.core.errors import BackendError, ConfigurationError
from ratelimit_mw.core.identity import encode_identity
from ratelimit_mw.core.lane import Lane
from ratelimit_mw.core.plans import Check, ScriptCall
from ratelimit_mw.core.policy import Policy, SharedLogs, as_policy
from ratelimit_mw.core.wire import Wire, wire
from ratelimit_mw.http.hooks import refuse_async
from ratelimit_mw.http.log import ThrottledLog
from ratelimit_mw.http.routing import RouteLimit, exempt, limit_decorator
from ratelimit_mw.metrics import ADMITTED, BACKEND_ERROR, REFUSED, Event, MetricsHook

if TYPE_CHECKING:  # annotations only (they are strings at run time): no dependency on 3.10
    from typing_extensions import Unpack

F = TypeVar("F", bound=Callable[..., Any])

_PREFIX_RE = re.compile(r"[A-Za-z0-9_.:\-]{1,32}")
_MEMORY_RUN = MemoryBackend.run
_MEMORY_ARUN = MemoryBackend.arun


def _accepts_parts(backend: object) -> bool:
    """Whether `backend` is MemoryBackend itself, with no `run` set on the instance: then a
    hit may go to its `hit_one` or `hit_tiers` as the call's parts. A subclass, or a `run`
    set on the instance (a test injecting a failure), is given whole calls: it may run or
    record them its own way. Asked on every hit, so that a backend replaced or patched after
    the limiter was built is honoured. (Through the bound method, not the instance's
    ``__dict__``: reading that makes CPython drop the object's inline attribute storage,
    which slows every later call of the backend.)"""
    return (type(backend) is MemoryBackend
            and getattr(backend.run, "__func__", None) is _MEMORY_RUN)


def _own_arun(backend: MemoryBackend) -> bool:
    """Whether `backend`'s `arun` is MemoryBackend's, which calls `run` and answers without
    yielding (not a subclass's, nor one set on the instance: that one must be awaited)."""
    return getattr(backend.arun, "__func__", None) is _MEMORY_ARUN


def _at_ms(at: _dt.datetime) -> int:
    if not isinstance(at, _dt.datetime) or at.tzinfo is None or at.utcoffset() is None:
        raise ConfigurationError(
            f"reserve(at=...) needs an aware datetime, got {at!r}; e.g. "
            "datetime(2026, 5, 1, 9, 30, tzinfo=ZoneInfo('Europe/Paris'))"
        )
    return int(at.timestamp() * 1000)


def _metrics_hook(metrics: Any) -> MetricsHook | None:
    if metrics is not None and not callable(getattr(metrics, "observe", None)):
        raise ConfigurationError(
            f"metrics must have a method observe(event, policy, seconds), got {metrics!r}; "
            "e.g. metrics=ratelimit_mw.metrics adapters, or any object with such a method"
        )
    return metrics  # type: ignore[no-any-return]


class LimiterOptions(TypedDict, total=False):
    """The keyword options Limiter and AsyncLimiter share (written once, typed for both)."""

    clock: Callable[[], float] | None
    deny_cache: int
    deny_cache_max_age: float
    metrics: MetricsHook | None


class _Shared:
    """Configuration and call building shared by Limiter and AsyncLimiter."""

    # The hit of one policy without penalty or calendar skips the generic machinery (see
    # `_fast_form`); `_build` and `_decide` are the core's, each with its own shortcut. A
    # subclass setting the plain ones (tests/test_fast_path.py) takes the generic path
    # everywhere, which the differential test holds the fast one to.
    _fast = True
    _build = staticmethod(plans.build)
    _decide = staticmethod(plans.decide)

    def __init__(
        self,
        backend: Any,
        prefix: str,
        *,
        clock: Callable[[], float] | None = None,
        deny_cache: int = 10_000,
        deny_cache_max_age: float = DEFAULT_MAX_AGE,
        metrics: MetricsHook | None = None,
    ) -> None:
        if not isinstance(prefix, str) or not _PREFIX_RE.fullmatch(prefix):
            raise ConfigurationError(
                f"prefix must be 1-32 characters of letters, digits, '_', '.', ':' or '-', "
                f"got {prefix!r}; e.g. prefix=\"rl\""
            )
        self.backend = backend
        self.prefix = prefix
        self.clock = clock
        self.metrics = _metrics_hook(metrics)
        self._metrics_failed = ThrottledLog()
        # Sliding-log policies of one name share one log in the store: every policy
        # configured on this limiter (decorators, a middleware's) must keep it as long.
        self._shared_logs = SharedLogs()
        self._rng = random.Random()
        if isinstance(deny_cache, bool) or not isinstance(deny_cache, int) or deny_cache < 0:
            raise ConfigurationError(
                f"deny_cache is the number of refusals remembered in process (0 turns it off), "
                f"got {deny_cache!r}; e.g. deny_cache=10_000"
            )
        deny = DenyCache(deny_cache, deny_cache_max_age)  # validates the age even when off
        self._deny = deny if deny_cache else None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.backend!r}, prefix={self.prefix!r})"

    # -- decorators (metadata only; the middleware enforces) -----------------------------
    def limit(
        self,
        rates: Policy | str | Callable[[Any], str | None],
        *,
        key: Callable[[Any], str | None] | None = None,
        cost: int | Callable[[Any], int] = 1,
        name: str | None = None,
        methods: Sequence[str] | None = None,
        exempt_when: Callable[[Any], bool] | None = None,
    ) -> Callable[[F], F]:
        """Limit one route: ``@limiter.limit("5/minute")`` on a view or endpoint. A sync
        Limiter's routes are WSGI or Flask views, which cannot await an async hook."""
        if not isinstance(self, AsyncLimiter):
            refuse_async("a Limiter's routes (WSGI, Flask)", [
                ("key", key), ("exempt_when", exempt_when),
                ("cost", cost if callable(cost) else None),
                ("rates", rates if callable(rates) and not isinstance(rates, Policy) else None)])
        return limit_decorator(RouteLimit.make(rates, key=key, cost=cost, name=name,
                                               methods=methods, exempt_when=exempt_when),
                               self._shared_logs)

    def exempt(self, func: F) -> F:
        """Exempt one route from the middleware's default limits."""
        return exempt(func)

    # -- building calls --------------------------------------------------------------------
    def _now_us(self) -> int | None:
        return None if self.clock is None else round(self.clock() * 1_000_000)

    def _clock_ms(self) -> int:
        return int((self.clock or time.time)() * 1000)

    def _calls(self, op: str, checks: Sequence[Check], at_ms: int | None = None,
               token: str | None = None) -> list[ScriptCall]:
        now_us = self._now_us()
        groups: Sequence[Sequence[Check]] = [checks]
        if self.backend.is_cluster:
            groups = plans.group_by_slot(checks)
        return [
            self._build(op, group, self.prefix, now_us=now_us, at_ms=at_ms, token=token,
                       clock_ms=self._clock_ms)
            for group in groups
        ]

    def _monotonic(self) -> float:
        return time.monotonic() if self.clock is None else self.clock()

    def _cache_now(self) -> int:
        """The deny cache's clock in µs: the test clock (then exactly the `now` the store is
        given), else a monotonic one (only differences matter: the store's answer is counted
        down from the moment its call was sent, so it never outlives the store's own)."""
        return time.monotonic_ns() // 1000 if self.clock is None else round(self.clock() * 1e6)

    def _first_step(self, checks: Sequence[Check]) -> Decision | ScriptCall | None:
        """The common case of `check` without a plan: the store's answer, replayed by the
        deny cache (a Decision), or the one call that decides (a ScriptCall). None: follow
        the plan (a cluster, where one request may need a call per slot)."""
        deny = self._deny
        if deny is not None and len(deny):
            cached = deny.lookup(checks, self._cache_now())
            if cached is not None:
                return cached
        if self.backend.is_cluster:
            return None
        return self._build(plans.HIT, checks, self.prefix, now_us=self._now_us(),
                           clock_ms=self._clock_ms)

    def _fast_form(self, policy: Policy | str, identity: str, cost: int) -> Wire | None:
        """The policy's wire form if this hit is the common one, else None: take `check`.
        Common: one policy object without penalty or calendar (its arguments depend on the
        cost alone), valid arguments, one store (no cluster), no metrics hook, and a deny
        cache holding nothing (so it has nothing to answer or forget)."""
        if (type(cost) is not int or cost < 1 or not isinstance(policy, Policy)
                or not isinstance(identity, str) or self.metrics is not None or not self._fast):
            return None
        form = wire(policy)
        deny = self._deny
        if not form.static or self.backend.is_cluster or (deny is not None and len(deny)):
            return None
        return form

    def _fast_decided(self, policy: Policy, identity: str, cost: int, call: ScriptCall,
                      reply: list[int], sent: int) -> Decision:
        """`_decided` for the common hit (`_fast_form`): an admitted hit leaves the (empty)
        deny cache as it is, so its Check is built only for a refusal, which the cache
        records."""
        deny = self._deny
        if deny is not None and (reply[0] != 1 or deny.watching):
            # Asked after the reply: a refusal recorded while the call was out is forgotten.
            deny.record((Check(policy, identity, cost),), call, reply, sent)
        rates = policy.rates
        if len(rates) == 1:
            return plans.decode_one(policy, rates[0], identity, reply[0] == 1, reply, None)
        return plans.decide(call, reply)

    def _takes_parts(self) -> bool:
        """Whether hits go to the backend's `hit_one` or `hit_tiers` (see `_accepts_parts`);
        never for a limiter that takes no shortcut."""
        return self._fast and _accepts_parts(self.backend)

    def _in_process(self, backend: MemoryBackend, form: Wire, identity: str, cost: int
                    ) -> Decision:
        """The common hit (`_fast_form`) on MemoryBackend itself: the call's parts, as
        `plans.build_static` puts them in the call (the keys, the tiers' arguments, a sliding
        log's fresh token, the clock), go to `hit_one` (one tier) or `hit_tiers`, which
        answer as `run` of that call. tests/backends/test_memory_perf_equivalence.py holds
        both to `run`; tests/test_fast_path.py holds these parts to the call's."""
        policy = form.policy
        now_us = self._now_us()
        sent = self._sent()
        head = f"{self.prefix}:{{{encode_identity(identity)}}}:"  # identity_head, one frame less
        suffixes = form.suffixes
        tiers = form.by_cost.get(cost) or form.static_args(cost)
        token = plans.new_token() if form.code == "sl" else ""
        clock = "" if now_us is None else now_us
        if len(suffixes) == 1:
            reply = backend.hit_one(head + suffixes[0], tiers, token, clock)
        else:
            # map, not a comprehension: before Python 3.12 a comprehension is one call more.
            reply = backend.hit_tiers(list(map(head.__add__, suffixes)), tiers, token, clock)
        deny = self._deny
        if deny is None or (reply[0] == 1 and not deny.watching):
            if len(suffixes) == 1:
                return plans.decode_one(policy, policy.rates[0], identity, reply[0] == 1,
                                        reply, None)
            return plans.decode_generic(((policy, identity),), reply, None)
        # The deny cache records the call: built only now (its record reads the layout).
        call = plans.build_static(plans.HIT, policy, identity, cost, self.prefix, now_us, form)
        return self._fast_decided(policy, identity, cost, call, reply, sent)

    def _lane_run(self, lane: Lane, identity: str, run: Callable[[ScriptCall], list[int]]
                  ) -> list[int]:
        """`run(lane.call(identity, clock))` on an in-process backend: on MemoryBackend
        itself as the call's parts (see `_in_process`)."""
        now_us = self._now_us()
        if self._takes_parts():
            backend: MemoryBackend = self.backend
            clock = "" if now_us is None else now_us
            tier = lane.tier
            if tier is not None:
                return backend.hit_one(lane.key(identity), tier, lane.token() or "", clock)
            return backend.hit_tiers(lane.keys(identity), lane.tiers, lane.token() or "",
                                     clock)
        return run(lane.call(identity, now_us))

    def _sent(self) -> int:
        return 0 if self._deny is None else self._cache_now()

    def _decided(self, checks: Sequence[Check], call: ScriptCall, reply: list[int],
                 sent: int) -> Decision:
        if self._deny is not None:
            self._deny.record(checks, call, reply, sent)
        return self._decide(call, reply)

    # -- lanes (core.lane): `check` of one precompiled check, fewer steps ------------------
    def _lane_plain(self) -> bool:
        """Whether lanes take the plain path here: a metrics hook reports per call, and a
        cluster may split a call over slots (both belong to `check`)."""
        return self.metrics is not None or self.backend.is_cluster

    def _lane_replay(self, lane: Lane, identity: str
                     ) -> tuple[Decision | Lapsed | None, tuple[Check, ...] | None]:
        """`replay` for a lane: the deny cache's answer (a Decision, LAPSED, None) and the
        call's checks, built only when the cache holds anything (else None, None)."""
        deny = self._deny
        if deny is None or not len(deny):
            return None, None
        checks = (lane.check(identity),)
        return deny.find(checks, self._cache_now()), checks

    def _lane_decided(self, lane: Lane, identity: str, checks: tuple[Check, ...] | None,
                      reply: list[int], sent: int) -> Decision:
        """`_decided` for a lane's reply: the deny cache records a refusal, and an admitted
        hit forgets what the cache holds for its (policy, identity), as `record` does. The
        cache is asked after the reply: a refusal another request recorded while this call
        was out is forgotten too."""
        deny = self._deny
        if deny is not None and (reply[0] != 1 or deny.watching):
            # The record reads the call's layout alone: no token drawn for it.
            deny.record(checks or (lane.check(identity),), lane.call(identity, token=""),
                        reply, sent)
        return lane.decide(identity, reply)

    def _check_plan(self, checks: Sequence[Check], cached: bool = True) -> plans.Plan:
        return plans.plan_check(checks, lambda: self._calls(plans.HIT, checks),
                                self._deny if cached else None, self._cache_now)

    def _attempt(self, checks: Sequence[Check], cached: bool = True) -> plans.Plan:
        """`_check_plan`, reporting to the metrics hook when one is set; `cached` False:
        the store answers, the deny cache is neither asked nor told (`probe`)."""
        if self.metrics is None:
            return (yield from self._check_plan(checks, cached))
        deny = self._deny if cached else None
        if deny is not None:
            found = deny.lookup(checks, self._cache_now())
            if found is not None:
                self._report(checks, REFUSED, 0.0)
                return found
        started = time.perf_counter()
        try:
            decision = yield from self._check_plan(checks, cached)
        except BackendError:
            self._report(checks, BACKEND_ERROR, time.perf_counter() - started)
            raise
        self._report(checks, ADMITTED if decision.allowed else REFUSED,
                     time.perf_counter() - started)
        return decision

    def _report(self, checks: Sequence[Check], event: Event, seconds: float) -> None:
        """One event per policy of the call (a refused call is refused under each)."""
        metrics = self.metrics
        if metrics is None:
            return
        names: list[str] = []
        try:
            for check in checks:
                name = check.policy.name
                if name not in names:
                    names.append(name)
                    metrics.observe(event, name, seconds)
        except Exception as exc:
            # A metrics bug must not change the answer: raised from here it would reach the
            # middleware as a store failure, and on_backend_error="allow" would admit
            # everyone (the hit was recorded already).
            self._metrics_failed("ratelimit_mw metrics hook raised", exc)

    def _acquire_plan(self, policy: Policy | str, identity: str, cost: int,
                      timeout: float | None) -> plans.Plan:
        checks = (_check(policy, identity, cost),)
        return plans.plan_acquire(lambda: self._attempt(checks), self._monotonic,
                                 timeout, self._rng)

    def _forget(self, checks: Sequence[Check]) -> None:
        if self._deny is not None:
            self._deny.forget(checks)

    def _single(self, op: str, policy: Policy | str, identity: str, cost: int = 1) -> ScriptCall:
        check = _check(policy, identity, cost)
        self._forget((check,))  # peek, reset, refund: the store is asked, never the cache
        return self._build(op, (check,), self.prefix, now_us=self._now_us(),
                           clock_ms=self._clock_ms)

    def _booking_call(self, policy: Policy | str, identity: str, at: _dt.datetime,
                      cost: int) -> ScriptCall:
        check = _check(policy, identity, cost)
        if check.policy.algorithm != "sliding-log":
            raise ConfigurationError(
                f"reserve needs a sliding-log policy (it checks every window around the "
                f"booked time), got algorithm={check.policy.algorithm!r}; write "
                f'Policy("1/minute;5/hour;10/day", algorithm="sliding-log")'
            )
        self._forget((check,))
        return self._build(plans.BOOK, (check,), self.prefix, now_us=self._now_us(),
                           at_ms=_at_ms(at), clock_ms=self._clock_ms)

    def _cancel_call(self, booking: Booking) -> ScriptCall:
        check = Check(booking.policy, booking.identity, booking.cost)
        self._forget((check,))
        return self._build(plans.CANCEL, (check,), self.prefix, now_us=self._now_us(),
                           token=booking.token, clock_ms=self._clock_ms)


def _check(policy: Policy | str, identity: str, cost: int) -> Check:
    if not isinstance(identity, str):
        raise ConfigurationError(
            f"identity must be a string, got {type(identity).__name__}; e.g. \"user:42\""
        )
    plans.validate_cost(cost)
    return Check(policy if isinstance(policy, Policy) else _policy_from_text(policy), identity,
                 cost)


@functools.lru_cache(maxsize=256)
def _policy_from_text(text: str) -> Policy:
    # limiter.hit("10/minute", ...) with a string: one Policy per text, not one per call, so
    # parsing stays off the hot path and the deny cache recognises the policy.
    return as_policy(text)


class Limiter(_Shared):
    """The sync limiter: ``Limiter(RedisBackend.from_url(...))`` or ``Limiter()`` (memory).

    ``clock`` (tests only) replaces Redis's clock with a callable returning seconds;
    ``sleep`` replaces ``time.sleep`` for ``acquire``; ``deny_cache`` is how many refusals
    are answered in process, exactly as the store would, for at most ``deny_cache_max_age``
    seconds (0 turns the cache off); ``metrics`` is a hook with ``observe(event, policy,
    seconds)`` (see `ratelimit_mw.metrics`).
    """

    def __init__(self, backend: SyncBackend | None = None, prefix: str = "rl", *,
                 sleep: Callable[[float], None] | None = None,
                 **options: Unpack[LimiterOptions]) -> None:
        if backend is None:
            backend = MemoryBackend()
        if not callable(getattr(backend, "run", None)):
            raise ConfigurationError(
                f"Limiter needs a sync backend (MemoryBackend or RedisBackend), got {backend!r}; "
                "for redis.asyncio use AsyncLimiter(AsyncRedisBackend(...))"
            )
        super().__init__(backend, prefix, **options)
        self._sleep = sleep or time.sleep

    def _drive(self, plan: plans.Plan) -> Decision:
        try:
            step = next(plan)
            while True:
                if isinstance(step, ScriptCall):
                    try:
                        reply: list[int] | None = self.backend.run(step)
                    except BackendError as exc:  # the plan decides: retry (acquire) or raise
                        step = plan.throw(exc)
                        continue
                else:
                    self._sleep(step)
                    reply = None
                step = plan.send(reply)
        except StopIteration as done:  # also: answered without I/O (the deny cache)
            return done.value  # type: ignore[no-any-return]

    def check(self, checks: Sequence[Check]) -> Decision:
        """Hit several policies at once, all or nothing (what the middleware calls)."""
        if self.metrics is None:  # the common case, without a generator
            step = self._first_step(checks)
            if isinstance(step, ScriptCall):
                sent = self._sent()
                return self._decided(checks, step, self.backend.run(step), sent)
            if step is not None:
                return step
        return self._drive(self._attempt(checks))

    def probe(self, checks: Sequence[Check]) -> Decision:
        """`check`, answered by the store, never by the deny cache: the middleware's
        breaker probes with it (a cached answer would close the breaker on a store that
        was never asked)."""
        return self._drive(self._attempt(checks, cached=False))

    def hit(self, policy: Policy | str, identity: str, cost: int = 1) -> Decision:
        """Check and record one hit of `cost`; nothing is recorded when refused."""
        form = self._fast_form(policy, identity, cost)
        if form is not None:
            policy = form.policy  # the very object, typed
            backend = self.backend
            if _accepts_parts(backend):
                return self._in_process(backend, form, identity, cost)
            call = plans.build_static(plans.HIT, policy, identity, cost, self.prefix,
                                      self._now_us(), form)
            sent = self._sent()
            return self._fast_decided(policy, identity, cost, call, self.backend.run(call), sent)
        return self.check((_check(policy, identity, cost),))

    def lane_hit(self, lane: Lane, identity: str) -> Decision:
        """``check([lane.check(identity)])``: the same Decision and deny-cache records, from
        the lane's precomputed call (what the WSGI middleware and Flask call for their
        common request; tests/test_lane.py holds the two to the same answers)."""
        if self._lane_plain():
            return self.check((lane.check(identity),))
        found, checks = self._lane_replay(lane, identity)
        if found is not None:
            # A refusal held (a Decision), or one that has just lapsed: `find` dropped it, so
            # `check` asks the store, as it would have.
            return found if isinstance(found, Decision) else self.check(checks)  # type: ignore[arg-type]
        sent = self._sent()
        reply = self._lane_run(lane, identity, self.backend.run)
        return self._lane_decided(lane, identity, checks, reply, sent)

    def uncheck(self, checks: Sequence[Check]) -> None:
        """Give back what an admitted `check` recorded (the middleware's count_when)."""
        self._forget(checks)
        for call in self._calls(plans.REFUND, checks):
            self.backend.run(call)

    def peek(self, policy: Policy | str, identity: str) -> Decision:
        """The state as it stands: would a hit of cost 1 be admitted? Records nothing."""
        call = self._single(plans.PEEK, policy, identity)
        return self._decide(call, self.backend.run(call))

    def reset(self, policy: Policy | str, identity: str) -> None:
        """Forget every counter and any ban of this identity under this policy."""
        self.backend.run(self._single(plans.RESET, policy, identity))

    def refund(self, policy: Policy | str, identity: str, cost: int = 1) -> None:
        """Give back an admitted hit of `cost` (e.g. a login that turned out to succeed)."""
        self.backend.run(self._single(plans.REFUND, policy, identity, cost))

    def acquire(self, policy: Policy | str, identity: str, cost: int = 1,
                timeout: float | None = None) -> Decision:
        """Wait until a hit is admitted; RateLimitExceeded if it cannot be within `timeout`.

        Backend errors are retried with backoff while `timeout` leaves time, then raised as
        BackendError (at once when no timeout is given)."""
        return self._drive(self._acquire_plan(policy, identity, cost, timeout))

    def reserve(self, policy: Policy | str, identity: str, at: _dt.datetime,
                cost: int = 1) -> Decision:
        """Book `cost` at time `at` if every window containing `at` stays within its limit."""
        call = self._booking_call(policy, identity, at, cost)
        return self._decide(call, self.backend.run(call))

    def cancel(self, booking: Booking) -> None:
        """Take back an admitted reservation (``decision.booking``)."""
        self.backend.run(self._cancel_call(booking))

    def ping(self) -> dict[str, Any]:
        """Ask the store whether it is there (a start-up check): the backend's own report.

        Raises BackendError when it cannot answer."""
        ping = _pinger(self.backend, "ping")
        try:
            return ping()  # type: ignore[no-any-return]
        except BackendError:
            raise
        except Exception as exc:
            raise _ping_failed(exc) from exc


class AsyncLimiter(_Shared):
    """The async twin of Limiter: the same methods, awaited."""

    def __init__(self, backend: AsyncBackend | None = None, prefix: str = "rl", *,
                 sleep: Callable[[float], Awaitable[None]] | None = None,
                 **options: Unpack[LimiterOptions]) -> None:
        if backend is None:
            backend = MemoryBackend()
        if not callable(getattr(backend, "arun", None)):
            raise ConfigurationError(
                f"AsyncLimiter needs an async backend (MemoryBackend or AsyncRedisBackend), "
                f"got {backend!r}; a sync redis.Redis would block the event loop: use "
                "AsyncRedisBackend(redis.asyncio.Redis(...))"
            )
        super().__init__(backend, prefix, **options)
        self._sleep = sleep or asyncio.sleep
        # The checks whose lapsed refusal one call is asking the store about again, and the
        # future that call's end resolves: True if it got no answer (see `_refresh`). Empty
        # but during such a call.
        self._flights: dict[tuple[Check, ...], asyncio.Future[bool]] = {}
        # `arun_within(call, seconds)`: the backend keeps a deadline itself (see `ask`); not
        # for a cluster, where one request may need a call per slot.
        within = getattr(backend, "arun_within", None)
        self._within: Callable[[ScriptCall, float], Awaitable[list[int]]] | None = (
            None if backend.is_cluster or not callable(within) else within)
        # `post(packed, give_up)` and `settle(outcome)`: a backend that queues a packed call
        # and hands back its connection's future (see `lane_hit`).
        post, settle = getattr(backend, "post", None), getattr(backend, "settle", None)
        self._post: Callable[[bytes, float], asyncio.Future[Any] | None] | None = (
            post if self._within is not None and callable(post) and callable(settle) else None)

    def _inline(self) -> Callable[[ScriptCall], list[int]] | None:
        """The backend's sync `run` if its `arun` is MemoryBackend's, which calls it and
        answers without yielding: lanes call it directly. Not where an `arun` of its own (a
        subclass's, or one set on the instance) must be asked; looked up on every call, so
        that a `run` set on the instance later is the one called."""
        backend = self.backend
        return backend.run if isinstance(backend, MemoryBackend) and _own_arun(backend) else None

    async def _drive(self, plan: plans.Plan) -> Decision:
        try:
            step = next(plan)
            while True:
                if isinstance(step, ScriptCall):
                    try:
                        reply: list[int] | None = await self.backend.arun(step)
                    except BackendError as exc:  # the plan decides: retry (acquire) or raise
                        step = plan.throw(exc)
                        continue
                else:
                    await self._sleep(step)
                    reply = None
                step = plan.send(reply)
        except StopIteration as done:  # also: answered without I/O (the deny cache)
            return done.value  # type: ignore[no-any-return]

    async def check(self, checks: Sequence[Check]) -> Decision:
        """Hit several policies at once, all or nothing (what the middleware calls)."""
        found = self.replay(checks)
        if isinstance(found, Decision):
            return found
        return await self.ask(checks, found is LAPSED)

    async def probe(self, checks: Sequence[Check], timeout: float | None = None) -> Decision:
        """`check`, answered by the store, never by the deny cache (see `Limiter.probe`);
        TimeoutError after `timeout` seconds."""
        return await bounded(self._drive(self._attempt(checks, cached=False)), timeout)

    def replay(self, checks: Sequence[Check]) -> Decision | Lapsed | None:
        """The first half of `check`, without I/O: the deny cache's answer to this very call
        (a Decision), LAPSED when a refusal it held for the call has just lapsed, else None.
        The middleware bounds only the second half, `ask`, by its deadline: an answer from
        the cache needs no timer."""
        deny = self._deny
        if deny is None or not len(deny):
            return None
        found = deny.find(checks, self._cache_now())
        if self.metrics is not None and isinstance(found, Decision):
            self._report(checks, REFUSED, 0.0)
        return found

    async def ask(self, checks: Sequence[Check], lapsed: bool = False,
                  timeout: float | None = None) -> Decision:
        """The second half of `check`, after `replay` found no answer (`lapsed`: it said
        LAPSED): the store's answer, shared with the requests of the same call that come
        while it is asked when a refusal lapsed (see `_refresh`); TimeoutError after
        `timeout` seconds (the middleware's deadline).

        The common call (one store call, no metrics hook, nothing being refreshed) gives the
        deadline to a backend that can keep it without a timer of its own (`arun_within`:
        the pipelined connection's give-up time); anything else runs under one."""
        if timeout is not None:
            within = self._within
            if within is None or lapsed or self._flights or self.metrics is not None:
                return await bounded(self.ask(checks, lapsed), timeout)
            call = self._build(plans.HIT, checks, self.prefix, now_us=self._now_us(),
                               clock_ms=self._clock_ms)
            sent = self._sent()
            return self._decided(checks, call, await within(call, timeout), sent)
        if lapsed:
            return await self._refresh(checks)
        if self._flights:
            leader = self._flights.get(tuple(checks))
            if leader is not None:
                return await self._follow(leader, checks)
        return await self._ask(checks)

    async def lane_hit(self, lane: Lane, identity: str, timeout: float | None = None
                       ) -> Decision:
        """``check([lane.check(identity)])`` with the deadline of `ask`: the same Decision,
        from the deny cache or the store, the same deny-cache records and the same errors,
        in fewer steps (what the ASGI middleware calls for its common request).

        The fewer steps: an in-process backend runs the lane's call at once; a backend that
        can `post` a packed call gets the lane's precomputed bytes (no argument list, no
        packing per argument) and its connection's future is awaited here, with no
        coroutine of the backend's in between. Anything else (a metrics hook, a cluster, a
        refusal being asked about again, no open connection, a reply that is not a plain
        one) takes `replay` and `ask`, the plain path; tests/test_lane.py holds the two to
        the same answers."""
        post, inline = self._post, self._inline()
        if self._lane_plain() or not (inline is not None
                                      or (post is not None and timeout is not None)):
            return await self._replay_ask((lane.check(identity),), timeout)
        checks = None
        deny = self._deny
        if deny is not None and len(deny):
            found, checks = self._lane_replay(lane, identity)
            if found is not None:
                if isinstance(found, Decision):
                    return found
                return await self.ask(checks, True, timeout)  # type: ignore[arg-type]
        if self._flights:
            return await self.ask(checks or (lane.check(identity),), False, timeout)
        if inline is not None:
            sent = self._sent()
            reply = self._lane_run(lane, identity, inline)
            return self._lane_decided(lane, identity, checks, reply, sent)
        loop = asyncio.get_running_loop()
        give_up = loop.time() + timeout  # type: ignore[operator]
        now_us = self._now_us()
        token = lane.token() if lane.log else None
        # Read before the write, as every path does: a refusal is counted down from the
        # moment its call was sent, so a pause after the write cannot make the deny cache
        # outlive the store's answer.
        sent = self._sent()
        waiter = post(lane.packed(identity, now_us, token), give_up)  # type: ignore[misc]
        if waiter is None:  # no open connection on this loop: the plain path connects
            return await self.ask(checks or (lane.check(identity),), False, timeout)
        try:
            reply = await waiter
        except Exception as exc:
            reply = self.backend.settle(exc)
        else:
            if type(reply) is not list:
                reply = self.backend.settle(reply)
        if reply is None:
            # Dropped or NOSCRIPT: the very same call again (token and clock), the complete
            # way, in the time that is left, as the pipelined connection resends its bytes:
            # if the first copy reached Redis, a sliding log gets the same members again.
            left = give_up - loop.time()
            if left <= 0:
                raise asyncio.TimeoutError()
            reply = await self._within(lane.call(identity, now_us, token), left)  # type: ignore[misc]
        if reply[0] == 1 and (deny is None or not deny.watching):
            return lane.decide(identity, reply)  # admitted, nothing held to forget
        return self._lane_decided(lane, identity, checks, reply, sent)

    async def _replay_ask(self, checks: Sequence[Check], timeout: float | None) -> Decision:
        """`check` with the deadline of `ask`: the deny cache's answer, else the store's."""
        found = self.replay(checks)
        if isinstance(found, Decision):
            return found
        return await self.ask(checks, found is LAPSED, timeout)

    async def _refresh(self, checks: Sequence[Check]) -> Decision:
        """A refusal of this very call has just lapsed (the age bound, or its numbers'
        validity): ask the store once for every request of the same call that comes while
        the question is out. A flood from one refused client, spread over many connections,
        would otherwise send one call per connection each time the refusal lapses."""
        key = tuple(checks)
        flights = self._flights
        leader = flights.get(key)
        if leader is not None:
            return await self._follow(leader, checks)
        leader = flights[key] = asyncio.get_running_loop().create_future()
        answered = False
        try:
            decision = await self._ask(checks)
            answered = True
            return decision
        finally:
            del flights[key]
            leader.set_result(not answered)

    async def _follow(self, leader: asyncio.Future[bool], checks: Sequence[Check]) -> Decision:
        """Wait for the call another request sent for the same checks, then decide as if
        this request came just after it: the store's refusal from the deny cache, or, if
        that call was admitted (nothing to replay), a call of its own. If it failed or was
        cancelled, the waiting requests ask again together: the first to wake sends the
        call. Shielded: a follower's deadline must not cancel the leader's future."""
        if await asyncio.shield(leader):
            return await self._refresh(checks)
        return await self._ask(checks)

    async def _ask(self, checks: Sequence[Check]) -> Decision:
        if self.metrics is None:  # the common case, without a generator
            step = self._first_step(checks)
            if isinstance(step, ScriptCall):
                sent = self._sent()
                return self._decided(checks, step, await self.backend.arun(step), sent)
            if step is not None:
                return step
        return await self._drive(self._attempt(checks))

    async def hit(self, policy: Policy | str, identity: str, cost: int = 1) -> Decision:
        """Check and record one hit of `cost`; nothing is recorded when refused."""
        # While a lapsed refusal is asked about again, a hit may be one that waits for it.
        form = None if self._flights else self._fast_form(policy, identity, cost)
        if form is not None:
            policy = form.policy  # the very object, typed
            backend = self.backend
            if _accepts_parts(backend) and _own_arun(backend):
                # MemoryBackend's `arun` is its `run`: it answers without yielding.
                return self._in_process(backend, form, identity, cost)
            call = plans.build_static(plans.HIT, policy, identity, cost, self.prefix,
                                      self._now_us(), form)
            sent = self._sent()
            return self._fast_decided(policy, identity, cost, call,
                                      await self.backend.arun(call), sent)
        return await self.check((_check(policy, identity, cost),))

    async def uncheck(self, checks: Sequence[Check]) -> None:
        """Give back what an admitted `check` recorded (the middleware's count_when)."""
        self._forget(checks)
        for call in self._calls(plans.REFUND, checks):
            await self.backend.arun(call)

    async def peek(self, policy: Policy | str, identity: str) -> Decision:
        """The state as it stands: would a hit of cost 1 be admitted? Records nothing."""
        call = self._single(plans.PEEK, policy, identity)
        return self._decide(call, await self.backend.arun(call))

    async def reset(self, policy: Policy | str, identity: str) -> None:
        """Forget every counter and any ban of this identity under this policy."""
        await self.backend.arun(self._single(plans.RESET, policy, identity))

    async def refund(self, policy: Policy | str, identity: str, cost: int = 1) -> None:
        """Give back an admitted hit of `cost`."""
        await self.backend.arun(self._single(plans.REFUND, policy, identity, cost))

    async def acquire(self, policy: Policy | str, identity: str, cost: int = 1,
                      timeout: float | None = None) -> Decision:
        """Wait until a hit is admitted; RateLimitExceeded if it cannot be within `timeout`.

        Backend errors are retried with backoff while `timeout` leaves time, then raised as
        BackendError (at once when no timeout is given)."""
        return await self._drive(self._acquire_plan(policy, identity, cost, timeout))

    async def reserve(self, policy: Policy | str, identity: str, at: _dt.datetime,
                      cost: int = 1) -> Decision:
        """Book `cost` at time `at` if every window containing `at` stays within its limit."""
        call = self._booking_call(policy, identity, at, cost)
        return self._decide(call, await self.backend.arun(call))

    async def cancel(self, booking: Booking) -> None:
        """Take back an admitted reservation (``decision.booking``)."""
        await self.backend.arun(self._cancel_call(booking))

    async def ping(self) -> dict[str, Any]:
        """Ask the store whether it is there (a start-up check, e.g. in a lifespan handler):
        the backend's own report. Raises BackendError when it cannot answer."""
        aping = _pinger(self.backend, "aping")
        try:
            return await aping()  # type: ignore[no-any-return]
        except BackendError:
            raise
        except Exception as exc:
            raise _ping_failed(exc) from exc


def _pinger(backend: Any, method: str) -> Callable[[], Any]:
    found = getattr(backend, method, None)
    if not callable(found):
        raise ConfigurationError(
            f"{backend!r} has no {method}(), so the limiter cannot check it; use "
            "MemoryBackend, RedisBackend or AsyncRedisBackend, or give yours that method"
        )
    return found  # type: ignore[no-any-return]


def _ping_failed(exc: BaseException) -> BackendError:
    return BackendError(f"the store did not answer a ping: {type(exc).__name__}: {exc}")
