"""Limiter and AsyncLimiter: thin shells that move a ScriptCall to a backend and back.

Every decision is made by the pure core (`ratelimit_mw.core`); the shells add only the I/O
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
from typing import Any, Protocol, TypeVar

from ratelimit_mw import core
from ratelimit_mw._deny_cache import DenyCache
from ratelimit_mw._errors import ConfigurationError
from ratelimit_mw.backends.memory import MemoryBackend
from ratelimit_mw.core import Check, ScriptCall
from ratelimit_mw.decision import Booking, Decision
from ratelimit_mw.policy import Policy, as_policy
from ratelimit_mw.routing import RouteLimit, exempt, limit_decorator

F = TypeVar("F", bound=Callable[..., Any])

_PREFIX_RE = re.compile(r"[A-Za-z0-9_.:\-]{1,32}")


class SyncBackend(Protocol):
    is_cluster: bool

    def run(self, call: ScriptCall) -> list[int]: ...


class AsyncBackend(Protocol):
    is_cluster: bool

    async def arun(self, call: ScriptCall) -> list[int]: ...


def _at_ms(at: _dt.datetime) -> int:
    if not isinstance(at, _dt.datetime) or at.tzinfo is None or at.utcoffset() is None:
        raise ConfigurationError(
            f"reserve(at=...) needs an aware datetime, got {at!r}; e.g. "
            "datetime(2026, 5, 1, 9, 30, tzinfo=ZoneInfo('Europe/Paris'))"
        )
    return int(at.timestamp() * 1000)


class _Shared:
    """Configuration and call building shared by Limiter and AsyncLimiter."""

    def __init__(
        self,
        backend: Any,
        prefix: str,
        clock: Callable[[], float] | None,
        deny_cache: int,
    ) -> None:
        if not isinstance(prefix, str) or not _PREFIX_RE.fullmatch(prefix):
            raise ConfigurationError(
                f"prefix must be 1-32 characters of letters, digits, '_', '.', ':' or '-', "
                f"got {prefix!r}; e.g. prefix=\"rl\""
            )
        self.backend = backend
        self.prefix = prefix
        self.clock = clock
        self._rng = random.Random()
        if isinstance(deny_cache, bool) or not isinstance(deny_cache, int) or deny_cache < 0:
            raise ConfigurationError(
                f"deny_cache is the number of refusals remembered in process (0 turns it off), "
                f"got {deny_cache!r}; e.g. deny_cache=10_000"
            )
        self._deny = DenyCache(deny_cache) if deny_cache else None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.backend!r}, prefix={self.prefix!r})"

    # -- decorators (metadata only; the middleware enforces) -----------------------------
    def limit(
        self,
        rates: Policy | str,
        *,
        key: Callable[[Any], str | None] | None = None,
        cost: int | Callable[[Any], int] = 1,
        name: str | None = None,
    ) -> Callable[[F], F]:
        """Limit one route: ``@limiter.limit("5/minute")`` on a view or endpoint."""
        return limit_decorator(RouteLimit.make(rates, key=key, cost=cost, name=name))

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
            groups = core.group_by_slot(checks)
        return [
            core.build(op, group, self.prefix, now_us=now_us, at_ms=at_ms, token=token,
                       clock_ms=self._clock_ms)
            for group in groups
        ]

    def _monotonic(self) -> float:
        return time.monotonic() if self.clock is None else self.clock()

    def _first_step(self, checks: Sequence[Check]) -> Decision | ScriptCall | None:
        """The common case of `check` without a plan: a refusal the deny cache still holds
        (a Decision), or the one call that decides (a ScriptCall). None: follow the plan
        (a cluster, where one request may need a call per slot)."""
        if self.backend.is_cluster:
            return None
        deny = self._deny
        if deny is not None and len(deny):
            cached = deny.lookup(checks, self._monotonic())
            if cached is not None:
                return cached
        return core.build(core.HIT, checks, self.prefix, now_us=self._now_us(),
                          clock_ms=self._clock_ms)

    def _after(self, checks: Sequence[Check], decision: Decision) -> Decision:
        if self._deny is not None and not decision.allowed:
            self._deny.remember(checks, decision, self._monotonic())
        return decision

    def _check_plan(self, checks: Sequence[Check]) -> core.Plan:
        return core.plan_check(checks, lambda: self._calls(core.HIT, checks), self._deny,
                               self._monotonic)

    def _acquire_plan(self, policy: Policy | str, identity: str, cost: int,
                      timeout: float | None) -> core.Plan:
        checks = (_check(policy, identity, cost),)
        return core.plan_acquire(lambda: self._check_plan(checks), self._monotonic,
                                 timeout, self._rng)

    def _forget(self, checks: Sequence[Check]) -> None:
        if self._deny is not None:
            for check in checks:
                self._deny.forget(check.policy, check.identity)

    def _single(self, op: str, policy: Policy | str, identity: str, cost: int = 1) -> ScriptCall:
        check = _check(policy, identity, cost)
        if op in (core.RESET, core.REFUND):
            self._forget((check,))
        return core.build(op, (check,), self.prefix, now_us=self._now_us(),
                          clock_ms=self._clock_ms)

    def _booking_call(self, policy: Policy | str, identity: str, at: _dt.datetime,
                      cost: int) -> ScriptCall:
        check = _check(policy, identity, cost)
        if check.policy.code != "sl":
            raise ConfigurationError(
                f"reserve needs a sliding-log policy (it checks every window around the "
                f"booked time), got algorithm={check.policy.algorithm!r}; write "
                f'Policy("1/minute;5/hour;10/day", algorithm="sliding-log")'
            )
        return core.build(core.BOOK, (check,), self.prefix, now_us=self._now_us(),
                          at_ms=_at_ms(at), clock_ms=self._clock_ms)

    def _cancel_call(self, booking: Booking) -> ScriptCall:
        check = Check(booking.policy, booking.identity, booking.cost)
        self._forget((check,))
        return core.build(core.CANCEL, (check,), self.prefix, now_us=self._now_us(),
                          token=booking.token, clock_ms=self._clock_ms)


def _check(policy: Policy | str, identity: str, cost: int) -> Check:
    if not isinstance(identity, str):
        raise ConfigurationError(
            f"identity must be a string, got {type(identity).__name__}; e.g. \"user:42\""
        )
    core.validate_cost(cost)
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
    are remembered in process until their retry_after (0 turns the cache off).
    """

    def __init__(
        self,
        backend: SyncBackend | None = None,
        prefix: str = "rl",
        *,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], None] | None = None,
        deny_cache: int = 10_000,
    ) -> None:
        if backend is None:
            backend = MemoryBackend()
        if not callable(getattr(backend, "run", None)):
            raise ConfigurationError(
                f"Limiter needs a sync backend (MemoryBackend or RedisBackend), got {backend!r}; "
                "for redis.asyncio use AsyncLimiter(AsyncRedisBackend(...))"
            )
        super().__init__(backend, prefix, clock, deny_cache)
        self._sleep = sleep or time.sleep

    def _drive(self, plan: core.Plan) -> Decision:
        try:
            step = next(plan)
        except StopIteration as done:  # answered without I/O (the deny cache)
            return done.value  # type: ignore[no-any-return]
        while True:
            if isinstance(step, ScriptCall):
                reply: list[int] | None = self.backend.run(step)
            else:
                self._sleep(step)
                reply = None
            try:
                step = plan.send(reply)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]

    def check(self, checks: Sequence[Check]) -> Decision:
        """Hit several policies at once, all or nothing (what the middleware calls)."""
        step = self._first_step(checks)
        if isinstance(step, ScriptCall):
            return self._after(checks, core.decide(step, self.backend.run(step)))
        if step is not None:
            return step
        return self._drive(self._check_plan(checks))

    def hit(self, policy: Policy | str, identity: str, cost: int = 1) -> Decision:
        """Check and record one hit of `cost`; nothing is recorded when refused."""
        return self.check((_check(policy, identity, cost),))

    def uncheck(self, checks: Sequence[Check]) -> None:
        """Give back what an admitted `check` recorded (the middleware's count_when)."""
        self._forget(checks)
        for call in self._calls(core.REFUND, checks):
            self.backend.run(call)

    def peek(self, policy: Policy | str, identity: str) -> Decision:
        """The state as it stands: would a hit of cost 1 be admitted? Records nothing."""
        call = self._single(core.PEEK, policy, identity)
        return core.decide(call, self.backend.run(call))

    def reset(self, policy: Policy | str, identity: str) -> None:
        """Forget every counter and any ban of this identity under this policy."""
        self.backend.run(self._single(core.RESET, policy, identity))

    def refund(self, policy: Policy | str, identity: str, cost: int = 1) -> None:
        """Give back an admitted hit of `cost` (e.g. a login that turned out to succeed)."""
        self.backend.run(self._single(core.REFUND, policy, identity, cost))

    def acquire(self, policy: Policy | str, identity: str, cost: int = 1,
                timeout: float | None = None) -> Decision:
        """Wait until a hit is admitted; RateLimitExceeded if it cannot be within `timeout`."""
        return self._drive(self._acquire_plan(policy, identity, cost, timeout))

    def reserve(self, policy: Policy | str, identity: str, at: _dt.datetime,
                cost: int = 1) -> Decision:
        """Book `cost` at time `at` if every window containing `at` stays within its limit."""
        call = self._booking_call(policy, identity, at, cost)
        return core.decide(call, self.backend.run(call))

    def cancel(self, booking: Booking) -> None:
        """Take back an admitted reservation (``decision.booking``)."""
        self.backend.run(self._cancel_call(booking))


class AsyncLimiter(_Shared):
    """The async twin of Limiter: the same methods, awaited."""

    def __init__(
        self,
        backend: AsyncBackend | None = None,
        prefix: str = "rl",
        *,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], Awaitable[None]] | None = None,
        deny_cache: int = 10_000,
    ) -> None:
        if backend is None:
            backend = MemoryBackend()
        if not callable(getattr(backend, "arun", None)):
            raise ConfigurationError(
                f"AsyncLimiter needs an async backend (MemoryBackend or AsyncRedisBackend), "
                f"got {backend!r}; a sync redis.Redis would block the event loop: use "
                "AsyncRedisBackend(redis.asyncio.Redis(...))"
            )
        super().__init__(backend, prefix, clock, deny_cache)
        self._sleep = sleep or asyncio.sleep

    async def _drive(self, plan: core.Plan) -> Decision:
        try:
            step = next(plan)
        except StopIteration as done:  # answered without I/O (the deny cache)
            return done.value  # type: ignore[no-any-return]
        while True:
            if isinstance(step, ScriptCall):
                reply: list[int] | None = await self.backend.arun(step)
            else:
                await self._sleep(step)
                reply = None
            try:
                step = plan.send(reply)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]

    async def check(self, checks: Sequence[Check]) -> Decision:
        """Hit several policies at once, all or nothing (what the middleware calls)."""
        step = self._first_step(checks)
        if isinstance(step, ScriptCall):
            return self._after(checks, core.decide(step, await self.backend.arun(step)))
        if step is not None:
            return step
        return await self._drive(self._check_plan(checks))

    async def hit(self, policy: Policy | str, identity: str, cost: int = 1) -> Decision:
        """Check and record one hit of `cost`; nothing is recorded when refused."""
        return await self.check((_check(policy, identity, cost),))

    async def uncheck(self, checks: Sequence[Check]) -> None:
        """Give back what an admitted `check` recorded (the middleware's count_when)."""
        self._forget(checks)
        for call in self._calls(core.REFUND, checks):
            await self.backend.arun(call)

    async def peek(self, policy: Policy | str, identity: str) -> Decision:
        """The state as it stands: would a hit of cost 1 be admitted? Records nothing."""
        call = self._single(core.PEEK, policy, identity)
        return core.decide(call, await self.backend.arun(call))

    async def reset(self, policy: Policy | str, identity: str) -> None:
        """Forget every counter and any ban of this identity under this policy."""
        await self.backend.arun(self._single(core.RESET, policy, identity))

    async def refund(self, policy: Policy | str, identity: str, cost: int = 1) -> None:
        """Give back an admitted hit of `cost`."""
        await self.backend.arun(self._single(core.REFUND, policy, identity, cost))

    async def acquire(self, policy: Policy | str, identity: str, cost: int = 1,
                      timeout: float | None = None) -> Decision:
        """Wait until a hit is admitted; RateLimitExceeded if it cannot be within `timeout`."""
        return await self._drive(self._acquire_plan(policy, identity, cost, timeout))

    async def reserve(self, policy: Policy | str, identity: str, at: _dt.datetime,
                      cost: int = 1) -> Decision:
        """Book `cost` at time `at` if every window containing `at` stays within its limit."""
        call = self._booking_call(policy, identity, at, cost)
        return core.decide(call, await self.backend.arun(call))

    async def cancel(self, booking: Booking) -> None:
        """Take back an admitted reservation (``decision.booking``)."""
        await self.backend.arun(self._cancel_call(booking))
