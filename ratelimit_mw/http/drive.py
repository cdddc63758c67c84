"""The guard's one I/O step, written once for a sync `Limiter` and once for an `AsyncLimiter`.

Both take a request's selection and return the verdict: the guard plans the hit, the
breaker decides whether the backend is called
at all (closed, or the cool-down's single probe), any exception from the call becomes the
failure policy, and the async half bounds the call by the guard's deadline.
"""

from __future__ import annotations

from collections.abc import Sequence
from time import perf_counter
from typing import Any

from ratelimit_mw.backends.base import bounded
from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.core.plans import Check
from ratelimit_mw.hooks import answer_all
from ratelimit_mw.http.guard import Admit, Guard, Refuse, Selection, Unavailable
from ratelimit_mw.limiter import AsyncLimiter, Limiter

Verdict = Admit | Refuse | Unavailable


def decide_sync(guard: Guard, limiter: Limiter, selection: Selection, request: Any,
                method: str, preflight: bool, *, peek: bool = False) -> Verdict | None:
    """The verdict on one request that `selection` applies to; None: no limit applies to it
    (its keys said None, a preflight not charged, exempt_when). `peek`: ask about the plan's
    first check without counting (Django's ``is_ratelimited(increment=False)``)."""
    plan = guard.plan(selection, request, method, preflight)
    if plan is None:
        return None
    breaker = guard.breaker  # closed (open_until 0.0) on nearly every request: no call
    if breaker.open_until and not breaker.may_call():  # skips the backend: the policy
        return guard.failed(request, plan, None, peek=peek)
    # Timed only where an event reports it (a shadow refusal); a clock read costs otherwise.
    start = perf_counter() if guard.shadow else 0.0
    try:
        # The breaker's probe (it is still open) must reach the store: the deny cache's
        # answer would close it on a store nobody asked.
        decision = (limiter.peek(*plan.checks[0][:2]) if peek
                    else limiter.decide(plan.compiled, plan.identities,
                                        cached=not breaker.open_until))
    except Exception as exc:  # anything from the backend call: never a 500
        return guard.failed(request, plan, exc, peek=peek)
    return guard.decided(request, plan, decision, start)


async def decide_async(guard: Guard, limiter: AsyncLimiter, selection: Selection,
                       request: Any, method: str, preflight: bool, *,
                       peek: bool = False) -> Verdict | None:
    """`decide_sync`, the async hooks awaited first and the store's answer bounded by the
    guard's deadline."""
    answers = None
    if selection.hooks or guard.exempt_hooks:
        hooks = guard.hooks(selection, preflight)
        answers = await answer_all(hooks, request) if hooks else None
    plan = guard.plan(selection, request, method, preflight, answers)
    if plan is None:
        return None
    breaker = guard.breaker
    if breaker.open_until and not breaker.may_call():
        return guard.failed(request, plan, None, peek=peek)
    start = perf_counter() if guard.shadow else 0.0
    try:
        decision = await (bounded(limiter.peek(*plan.checks[0][:2]), guard.timeout) if peek
                          else limiter.decide(plan.compiled, plan.identities, guard.timeout,
                                              cached=not breaker.open_until))
    except Exception as exc:  # "never a 500" covers whatever a backend raises
        return guard.failed(request, plan, exc, peek=peek)
    return guard.decided(request, plan, decision, start)


def refund_sync(guard: Guard, limiter: Limiter, checks: Sequence[Check]) -> None:
    """After the response: give back the hits its status gives back
    (`Guard.given_back`, asked by the caller: most responses give nothing back, and then
    nothing is called); never raises."""
    if not checks or not guard.may_refund():
        return
    try:
        limiter.uncheck(checks)
    except Exception as exc:
        guard.refund_failed(exc)


async def refund_async(guard: Guard, limiter: AsyncLimiter, checks: Sequence[Check]) -> None:
    if not checks or not guard.may_refund():
        return
    try:
        await bounded(limiter.uncheck(checks), guard.timeout)
    except Exception as exc:
        guard.refund_failed(exc)


def async_timeout(limiter: Any, timeout: float) -> float | None:
    """The deadline for calls on `limiter`: none for an in-process backend, which answers
    without yielding to the loop (a deadline could not interrupt it and costs a timer)."""
    return None if getattr(limiter.backend, "in_process", False) else timeout


def require_sync_limiter(limiter: object, where: str) -> Limiter:
    if not isinstance(limiter, Limiter):
        hint = (
            "an AsyncLimiter belongs to the ASGI middleware (ratelimit_mw.asgi)"
            if isinstance(limiter, AsyncLimiter)
            else "build one with Limiter(RedisBackend.from_url(url)) or Limiter() for memory"
        )
        raise ConfigurationError(f"{where} needs a sync Limiter, got {limiter!r}; {hint}")
    return limiter


def require_async_limiter(limiter: object, where: str) -> AsyncLimiter:
    if isinstance(limiter, AsyncLimiter):
        return limiter
    hint = ("a sync Limiter would block the event loop; " if isinstance(limiter, Limiter)
            else "")
    raise ConfigurationError(
        f"{where} needs an AsyncLimiter, got {limiter!r}; {hint}write "
        "limiter=AsyncLimiter(AsyncRedisBackend.from_url(\"redis://localhost:6379/0\")) "
        "or AsyncLimiter() for the in-process memory backend"
    )
