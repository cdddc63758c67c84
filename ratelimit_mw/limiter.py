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
import secrets
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

from ratelimit_mw.backends.base import AsyncBackend, SyncBackend, bounded
from ratelimit_mw.backends.memory import MemoryBackend
from ratelimit_mw.core import plans
from ratelimit_mw.core.compiled import Compiled
from ratelimit_mw.core.decision import Booking, Decision
from ratelimit_mw.core.deny_cache import DEFAULT_MAX_AGE, DenyCache, Lapsed
from ratelimit_mw.core.errors import BackendError, ConfigurationError
from ratelimit_mw.core.plans import Check, ScriptCall
from ratelimit_mw.core.policy import Policy, SharedLogs, as_policy
from ratelimit_mw.hooks import refuse_async
from ratelimit_mw.log import ThrottledLog
from ratelimit_mw.metrics import ADMITTED, BACKEND_ERROR, REFUSED, Event, MetricsHook
from ratelimit_mw.routing import RouteLimit, exempt, limit_decorator

if TYPE_CHECKING:  # annotations only (they are strings at run time): no dependency on 3.10
    from typing_extensions import Unpack

F = TypeVar("F", bound=Callable[..., Any])

# Distinct (policy, cost) sets compiled and kept: the middleware's selections, plus those
# that dynamic limits and costs make per request; cleared whole when full.
_COMPILED_CACHE_SIZE = 1024
_PREFIX_RE = re.compile(r"[A-Za-z0-9_.:\-]{1,32}")
_MEMORY_ARUN = MemoryBackend.arun


# Every limiter made in this process, for `ratelimit_mw.testing` (weak: never kept alive),
# and what each new one is handed to as its construction ends: the isolations active then,
# so that a limiter an app builds during a test is isolated too.
_LIVE: weakref.WeakSet[_Shared] = weakref.WeakSet()
_ON_NEW: list[Callable[[Any], None]] = []


class _Switch:
    """Limiting on or off for every middleware, decorator and dependency of the process
    (`Guard.plan` reads it per request); only `ratelimit_mw.testing` turns it off."""

    __slots__ = ("off",)

    def __init__(self) -> None:
        self.off = False


SWITCH = _Switch()


def live_limiters() -> list[Limiter | AsyncLimiter]:
    """The limiters alive in this process."""
    return [limiter for limiter in list(_LIVE)
            if isinstance(limiter, (Limiter, AsyncLimiter))]


def validate_prefix(prefix: object) -> str:
    """The keys' prefix, checked: ConfigurationError says what to write."""
    if not isinstance(prefix, str) or not _PREFIX_RE.fullmatch(prefix):
        raise ConfigurationError(
            f"prefix must be 1-32 characters of letters, digits, '_', '.', ':' or '-', "
            f"got {prefix!r}; e.g. prefix=\"rl\""
        )
    return prefix


def _answers_inline(backend: Any) -> bool:
    """Whether `backend` is a MemoryBackend whose `arun` is MemoryBackend's, which calls `run`
    and answers without yielding: the async limiter then calls its `run` directly. Not where
    a subclass has an `arun` of its own, which must be awaited."""
    return (isinstance(backend, MemoryBackend)
            and getattr(backend.arun, "__func__", None) is _MEMORY_ARUN)


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

    def __init__(
        self,
        backend: Any,
        prefix: str,
        *,
        sleep: Callable[[float], Any],
        clock: Callable[[], float] | None = None,
        deny_cache: int = 10_000,
        deny_cache_max_age: float = DEFAULT_MAX_AGE,
        metrics: MetricsHook | None = None,
    ) -> None:
        self._attach(backend)
        self.prefix = validate_prefix(prefix)
        self.clock = clock
        self._sleep = sleep
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
        self._compiled: dict[tuple[tuple[Policy, int], ...], Compiled] = {}
        # Last: everything an isolation saves and replaces is set by now.
        _LIVE.add(self)
        for isolate in list(_ON_NEW):  # noqa: PERF101 - a copy: one may end meanwhile
            isolate(self)

    @property
    def backend(self) -> Any:
        """The store. Assigning another one routes every later call to it (what the async
        side derives from it is derived again: `_attach`)."""
        return self._backend

    @backend.setter
    def backend(self, backend: Any) -> None:
        self._attach(backend)

    def _attach(self, backend: Any) -> None:
        self._backend = backend

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
        count_when: Callable[[int], bool] | None = None,
    ) -> Callable[[F], F]:
        """Limit one route: ``@limiter.limit("5/minute")`` on a view or endpoint;
        ``count_when(status) -> bool``: a response for which it is False gives this limit's
        hit back. A sync Limiter's routes are WSGI or Flask views, which cannot await an
        async hook."""
        if not isinstance(self, AsyncLimiter):
            refuse_async("a Limiter's routes (WSGI, Flask)", [
                ("key", key), ("exempt_when", exempt_when),
                ("cost", cost if callable(cost) else None),
                ("rates", rates if callable(rates) and not isinstance(rates, Policy) else None)])
        return limit_decorator(RouteLimit.make(rates, key=key, cost=cost, name=name,
                                               methods=methods, exempt_when=exempt_when,
                                               count_when=count_when),
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
        if self._backend.is_cluster:
            groups = plans.group_by_slot(checks)
        return [
            plans.build(op, group, self.prefix, now_us=now_us, at_ms=at_ms, token=token,
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

    def compile(self, items: Sequence[tuple[Policy, int]]) -> Compiled:
        """The `Compiled` hit of these (policy, cost) pairs under this limiter's prefix, built
        once per distinct set (a bounded cache: dynamic limits and costs make new sets)."""
        key = tuple(items)
        found = self._compiled.get(key)
        if found is None:
            found = Compiled(key, self.prefix)
            if len(self._compiled) >= _COMPILED_CACHE_SIZE:
                self._compiled.clear()
            self._compiled[key] = found
        return found

    def _compiled_hit(self, policy: Policy | str, identity: str, cost: int) -> Compiled:
        """`hit`'s compiled call, its arguments checked as `_check` does: a Check is built
        only to raise, or to parse a policy given as text."""
        if (type(policy) is not Policy or type(identity) is not str or type(cost) is not int
                or cost < 1):
            policy = _check(policy, identity, cost).policy
        return self.compile(((policy, cost),))

    def _compiled_checks(self, checks: Sequence[Check]) -> tuple[Compiled, tuple[str, ...]]:
        """`checks` as the compiled hit and its identities (`check`'s way in)."""
        return (self.compile([(check.policy, check.cost) for check in checks]),
                tuple(check.identity for check in checks))

    def _held(self, compiled: Compiled, identities: Sequence[str]
              ) -> tuple[Decision | Lapsed | None, tuple[Check, ...] | None]:
        """The deny cache's answer to this hit (a Decision, LAPSED, None) and its checks,
        built only when the cache holds anything (else None, None)."""
        deny = self._deny
        if deny is None or not len(deny):
            return None, None
        checks = compiled.checks(identities)
        found = deny.find(checks, self._cache_now())
        if isinstance(found, Decision) and self.metrics is not None:
            self._report(checks, REFUSED, 0.0)
        return found, checks

    def _settled(self, compiled: Compiled, identities: Sequence[str],
                 checks: tuple[Check, ...] | None, reply: list[int], sent: int,
                 cached: bool, started: float) -> Decision:
        """The store's reply as a Decision. The deny cache keeps a refusal, and an admitted
        hit drops what it held for the same (policy, identity) pairs; it is asked after the
        reply, so a refusal recorded while the call was out is forgotten too."""
        deny = self._deny
        if reply[0] == 1 and self.metrics is None and (deny is None or not deny.watching):
            return compiled.decide(identities, reply)  # admitted, nothing held to forget
        if cached and deny is not None and (reply[0] != 1 or deny.watching):
            if checks is None:
                checks = compiled.checks(identities)
            deny.record(checks, compiled.layout(identities), reply, sent)
        decision = compiled.decide(identities, reply)
        if self.metrics is not None:
            self._report(checks or compiled.checks(identities),
                         ADMITTED if decision.allowed else REFUSED, time.perf_counter() - started)
        return decision

    def _ran(self, compiled: Compiled, identities: Sequence[str],
             checks: tuple[Check, ...] | None, cached: bool) -> Decision:
        """The answer of a store that answers at once (`run`: the sync side's, and
        MemoryBackend's on the async side, which never yields)."""
        token = compiled.token() if compiled.log else None
        # Read before the write: a refusal is counted down from the moment its call was
        # sent, so a pause after the write cannot make the deny cache outlive the store.
        sent = 0 if self._deny is None else self._cache_now()
        started = time.perf_counter() if self.metrics is not None else 0.0
        clock = self.clock
        call = compiled.call(identities, None if clock is None else round(clock() * 1_000_000),
                             token, 0 if compiled.static else self._clock_ms())
        try:
            reply = self._backend.run(call)
        except BackendError:
            self._failed(compiled, identities, started)
            raise
        return self._settled(compiled, identities, checks, reply, sent, cached, started)

    def _failed(self, compiled: Compiled, identities: Sequence[str], started: float) -> None:
        if self.metrics is not None:
            self._report(compiled.checks(identities), BACKEND_ERROR, time.perf_counter() - started)

    def _check_plan(self, checks: Sequence[Check], cached: bool = True) -> plans.Steps:
        return plans.plan_check(checks, lambda: self._calls(plans.HIT, checks),
                                self._deny if cached else None, self._cache_now)

    def _attempt(self, checks: Sequence[Check], cached: bool = True) -> plans.Steps:
        """`_check_plan`, reporting to the metrics hook when one is set (`acquire`, and a
        cluster's hit of several slots); `cached` False: the store answers, the deny cache
        is neither asked nor told (`probe`)."""
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
                      timeout: float | None) -> plans.Steps:
        checks = (_check(policy, identity, cost),)
        return plans.plan_acquire(lambda: self._attempt(checks), self._monotonic,
                                 timeout, self._rng)

    def _forget(self, checks: Sequence[Check]) -> None:
        if self._deny is not None:
            self._deny.forget(checks)

    def _single(self, op: str, policy: Policy | str, identity: str, cost: int = 1) -> ScriptCall:
        check = _check(policy, identity, cost)
        self._forget((check,))  # peek, reset, refund: the store is asked, never the cache
        return plans.build(op, (check,), self.prefix, now_us=self._now_us(),
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
        return plans.build(plans.BOOK, (check,), self.prefix, now_us=self._now_us(),
                           at_ms=_at_ms(at), clock_ms=self._clock_ms)

    def _cancel_call(self, booking: Booking) -> ScriptCall:
        check = Check(booking.policy, booking.identity, booking.cost)
        self._forget((check,))
        return plans.build(plans.CANCEL, (check,), self.prefix, now_us=self._now_us(),
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
        super().__init__(backend, prefix, sleep=sleep or time.sleep, **options)

    def _drive(self, plan: plans.Steps) -> Decision:
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

    def decide(self, compiled: Compiled, identities: Sequence[str], *,
               cached: bool = True) -> Decision:
        """The hit of `compiled` (`compile`) for these identities, one per check, all or
        nothing: the deny cache's answer, else the store's. Every hit takes this way.
        `cached` False: the store answers, and the cache is neither asked nor told (the
        middleware's breaker probes so: a cached answer would close it on a store that was
        never asked)."""
        checks = None
        deny = self._deny
        if cached and deny is not None and len(deny):
            found, checks = self._held(compiled, identities)
            if isinstance(found, Decision):
                return found
        if self._backend.is_cluster and compiled.spans_slots(identities):
            return self._drive(self._attempt(checks or compiled.checks(identities), cached))
        return self._ran(compiled, identities, checks, cached)

    def check(self, checks: Sequence[Check]) -> Decision:
        """Hit several policies at once, all or nothing."""
        return self.decide(*self._compiled_checks(checks))

    def probe(self, checks: Sequence[Check]) -> Decision:
        """`check`, answered by the store, never by the deny cache."""
        return self.decide(*self._compiled_checks(checks), cached=False)

    def hit(self, policy: Policy | str, identity: str, cost: int = 1) -> Decision:
        """Check and record one hit of `cost`; nothing is recorded when refused."""
        return self.decide(self._compiled_hit(policy, identity, cost), (identity,))

    def uncheck(self, checks: Sequence[Check]) -> None:
        """Give back what an admitted `check` recorded (the middleware's count_when)."""
        self._forget(checks)
        for call in self._calls(plans.REFUND, checks):
            self.backend.run(call)

    def peek(self, policy: Policy | str, identity: str) -> Decision:
        """The state as it stands: would a hit of cost 1 be admitted? Records nothing."""
        call = self._single(plans.PEEK, policy, identity)
        return plans.decide(call, self.backend.run(call))

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
        return plans.decide(call, self.backend.run(call))

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
        super().__init__(backend, prefix, sleep=sleep or asyncio.sleep, **options)
        # The checks whose lapsed refusal one call is asking the store about again, and the
        # future that call's end resolves: True if it got no answer (see `_refresh`). Empty
        # but during such a call.
        self._flights: dict[tuple[Check, ...], asyncio.Future[bool]] = {}

    def _attach(self, backend: Any) -> None:
        super()._attach(backend)
        self._inline = _answers_inline(backend)
        # `arun_within(call, seconds)`: the backend keeps a deadline itself (see `_asked`);
        # not for a cluster, where one request may need a call per slot.
        within = getattr(backend, "arun_within", None)
        self._within: Callable[[ScriptCall, float], Awaitable[list[int]]] | None = (
            None if backend.is_cluster or not callable(within) else within)
        # `post(packed, give_up)` and `settle(outcome)`: a backend that queues a packed call
        # and hands back its connection's future (see `_asked`).
        post, settle = getattr(backend, "post", None), getattr(backend, "settle", None)
        self._post: Callable[[bytes, float], asyncio.Future[Any] | None] | None = (
            post if self._within is not None and callable(post) and callable(settle) else None)

    async def _drive(self, plan: plans.Steps) -> Decision:
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

    async def decide(self, compiled: Compiled, identities: Sequence[str],
                     timeout: float | None = None, *, cached: bool = True) -> Decision:
        """The hit of `compiled` (`compile`) for these identities, one per check, all or
        nothing: the deny cache's answer (no I/O, no deadline), else the store's within
        `timeout` seconds (TimeoutError after it: the middleware's deadline). Every hit
        takes this way. `cached` False: see `Limiter.decide`.

        A refusal of this very hit that has just lapsed is asked about once for every
        request that comes while the question is out (`_refresh`)."""
        checks = None
        if cached:
            deny = self._deny
            found, checks = (self._held(compiled, identities)
                             if deny is not None and len(deny) else (None, None))
            if found is not None:
                if isinstance(found, Decision):
                    return found
                return await bounded(self._refresh(compiled, identities, checks), timeout)  # type: ignore[arg-type]
            if self._flights:
                checks = compiled.checks(identities)
                leader = self._flights.get(checks)
                if leader is not None:
                    return await bounded(self._follow(leader, compiled, identities, checks),
                                         timeout)
        if self._backend.is_cluster and compiled.spans_slots(identities):
            return await bounded(
                self._drive(self._attempt(checks or compiled.checks(identities), cached)),
                timeout)
        if self._inline:
            return self._ran(compiled, identities, checks, cached)
        return await self._asked(compiled, identities, checks, cached, timeout)

    async def _asked(self, compiled: Compiled, identities: Sequence[str],
                     checks: tuple[Check, ...] | None, cached: bool,
                     timeout: float | None) -> Decision:
        """The store's answer, in one call, within `timeout` (`_ran` for a store that
        answers at once). A backend that can `post` packed bytes gets the compiled ones and
        its connection's future is awaited here; one that keeps a deadline itself
        (`arun_within`) gets the call; any other runs under a timer."""
        if self._inline:
            return self._ran(compiled, identities, checks, cached)
        backend = self._backend
        token = compiled.token() if compiled.log else None
        sent = 0 if self._deny is None else self._cache_now()  # before the write (`_ran`)
        started = time.perf_counter() if self.metrics is not None else 0.0
        now_us = self._now_us()
        app_ms = 0 if compiled.static else self._clock_ms()
        reply: list[int] | None = None
        try:
            post = self._post
            if post is not None and timeout is not None:
                loop = asyncio.get_running_loop()
                give_up = loop.time() + timeout
                waiter = post(compiled.packed(identities, now_us, token, app_ms), give_up)
                if waiter is not None:  # else no open connection yet: `arun_within` connects
                    try:
                        reply = await waiter
                    except Exception as exc:
                        reply = backend.settle(exc)
                    else:
                        if type(reply) is not list:
                            reply = backend.settle(reply)
                    if reply is None:
                        # Dropped, or NOSCRIPT: the very same call again (token and clock)
                        # in the time left, as the connection resends its bytes: if the
                        # first copy reached Redis, a sliding log gets the same members.
                        timeout = give_up - loop.time()
                        if timeout <= 0:
                            raise asyncio.TimeoutError()
            if reply is None:
                call = compiled.call(identities, now_us, token, app_ms)
                within = self._within
                if timeout is None:
                    reply = await backend.arun(call)
                elif within is not None:
                    reply = await within(call, timeout)
                else:
                    reply = await bounded(backend.arun(call), timeout)
        except BackendError:
            self._failed(compiled, identities, started)
            raise
        return self._settled(compiled, identities, checks, reply, sent, cached, started)  # type: ignore[arg-type]

    async def _refresh(self, compiled: Compiled, identities: Sequence[str],
                       checks: tuple[Check, ...]) -> Decision:
        """A refusal of this very hit has just lapsed (the age bound, or its numbers'
        validity): ask the store once for every request of the same hit that comes while
        the question is out. A flood from one refused client, spread over many connections,
        would otherwise send one call per connection each time the refusal lapses."""
        flights = self._flights
        leader = flights.get(checks)
        if leader is not None:
            return await self._follow(leader, compiled, identities, checks)
        leader = flights[checks] = asyncio.get_running_loop().create_future()
        answered = False
        try:
            decision = await self._asked(compiled, identities, checks, True, None)
            answered = True
            return decision
        finally:
            del flights[checks]
            leader.set_result(not answered)

    async def _follow(self, leader: asyncio.Future[bool], compiled: Compiled,
                      identities: Sequence[str], checks: tuple[Check, ...]) -> Decision:
        """Wait for the call another request sent for the same hit, then decide as if this
        request came just after it: the store's refusal from the deny cache, or, if that
        call was admitted (nothing to replay), a call of its own. If it failed or was
        cancelled, the waiting requests ask again together: the first to wake sends the
        call. Shielded: a follower's deadline must not cancel the leader's future."""
        if await asyncio.shield(leader):
            return await self._refresh(compiled, identities, checks)
        found, _ = self._held(compiled, identities)
        if isinstance(found, Decision):
            return found
        return await self._asked(compiled, identities, checks, True, None)

    async def check(self, checks: Sequence[Check]) -> Decision:
        """Hit several policies at once, all or nothing."""
        return await self.decide(*self._compiled_checks(checks))

    async def probe(self, checks: Sequence[Check], timeout: float | None = None) -> Decision:
        """`check`, answered by the store, never by the deny cache; TimeoutError after
        `timeout` seconds."""
        return await self.decide(*self._compiled_checks(checks), timeout, cached=False)

    async def hit(self, policy: Policy | str, identity: str, cost: int = 1) -> Decision:
        """Check and record one hit of `cost`; nothing is recorded when refused."""
        return await self.decide(self._compiled_hit(policy, identity, cost), (identity,))

    def messages(self, policy: Policy | str) -> Messages:
        """A budget for the messages of one connection (a WebSocket, a stream), counted
        apart from every other: ``messages = limiter.messages("10/second")`` when it opens,
        then ``if not await messages.hit(): ...`` per message (a Decision: False when
        refused, with its ``retry_after``)."""
        return Messages(self, _check(policy, "conn", 1).policy,
                        "conn:" + secrets.token_hex(8))

    async def uncheck(self, checks: Sequence[Check]) -> None:
        """Give back what an admitted `check` recorded (the middleware's count_when)."""
        self._forget(checks)
        for call in self._calls(plans.REFUND, checks):
            await self.backend.arun(call)

    async def peek(self, policy: Policy | str, identity: str) -> Decision:
        """The state as it stands: would a hit of cost 1 be admitted? Records nothing."""
        call = self._single(plans.PEEK, policy, identity)
        return plans.decide(call, await self.backend.arun(call))

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
        return plans.decide(call, await self.backend.arun(call))

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


class Messages:
    """One connection's message budget (`AsyncLimiter.messages`); its counters expire with
    the policy's window once the connection is quiet."""

    __slots__ = ("identity", "limiter", "policy")

    def __init__(self, limiter: AsyncLimiter, policy: Policy, identity: str) -> None:
        self.limiter = limiter
        self.policy = policy
        self.identity = identity

    def __repr__(self) -> str:
        return f"Messages({self.policy!r}, identity={self.identity!r})"

    async def hit(self, cost: int = 1) -> Decision:
        """Count one message (of `cost`); nothing is counted when refused."""
        return await self.limiter.hit(self.policy, self.identity, cost)


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
