"""A selection's handler: the verdict on one request, built once per selection and limiter.

Every adapter asks for a request's verdict the same way::

    handle = handler_async(guard, limiter, selection)  # built once, kept on the selection
    verdict = await handle(request, method, preflight)  # None: no limit applies

What is fixed for the selection is settled when its handler is built: whether its one key
is asked directly or the guard's planner runs (the app's async hooks, exempt_when, dynamic
limits, per-method counts, several keys), the compiled hit and, for a store in this
process, the limiter's own decision of it (`in_process`: no coroutine, no call encoded),
how an admitted decision becomes its `Admit`, whether the response's status is watched. A
request runs that one closure: its identities, the breaker, the one store call, the
verdict. Any exception from the store is the guard's failure policy, never a 500.

This module is the async source; ``_sync/handler.py`` is generated from it
(``python scripts/unasync.py``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from math import ceil
from time import perf_counter
from typing import Any

from ratelimit_mw._async import slots as slots_async
from ratelimit_mw._async.hooks import answer_all_async
from ratelimit_mw.core.compiled import Compiled
from ratelimit_mw.engine import SWITCH
from ratelimit_mw.hooks import Raised
from ratelimit_mw.http.guard import Guard
from ratelimit_mw.http.selection import Selection
from ratelimit_mw.http.verdict import Admit, Plan, Verdict, keep
from ratelimit_mw.limiter import AsyncLimiter

Decided = Verdict | None  # None: no limit applies to the request
Handler = Callable[..., Awaitable[Decided]]


def handler_async(guard: Guard, limiter: AsyncLimiter, selection: Selection) -> Handler:
    """The handler of `selection` on `limiter`, built on first use and kept on the selection
    until the limiter's store, clock or metrics hook is replaced (``limiter.generation``)."""
    kept = selection.handler_async
    generation = limiter.generation  # read first: one replaced while building is seen next
    if kept is not None and kept[0] is limiter and kept[1] == generation:
        return kept[2]
    handle = _built_async(guard, limiter, selection, generation)
    selection.handler_async = (limiter, generation, handle)
    return handle


def _built_async(guard: Guard, limiter: AsyncLimiter, selection: Selection,
                 generation: int) -> Handler:
    compiled = selection.compiled
    applied = selection.applied
    key = applied[0].key
    count = len(applied)
    # The one key answers directly where nothing else of the app is asked first or instead.
    direct = (compiled is not None and not selection.hooks and not guard.exempt_hooks
              and guard.exempt_when is None and not selection.dynamic
              and all(item.key is key and item.exempt_when is None and not item.per_method
                      for item in applied))
    # A built-in key asked as the adapter's kind of request reads it directly.
    for_kind = getattr(key, "for_kind", None) if guard.requests is not None else None
    ask = key if for_kind is None else for_kind(guard.requests)
    whens = tuple(item.count_when for item in applied) if selection.counts else None
    holds = selection.holds
    # Responses whose status may give something back are watched: they carry their plan.
    watched = guard.watch_status or whens is not None or holds
    # Such a plan is the same for every request of one identity unless it holds slots (a
    # token each): kept per identity, as the store keeps its keys (bounded likewise).
    kept: dict[str, Plan] | None = {} if watched and not holds else None
    here = None if compiled is None else limiter.in_process(compiled)
    admit = guard.admitter(selection)
    # The RateLimit fields without the legacy ones, as `PolicyHeader.admitter` renders
    # them, written out: the policy pair and each tier's name rendered once, one format.
    header, raw = selection.policy_header, guard.raw
    rendered = guard.headers and not guard.legacy
    fields: Any = header.raw_item if raw else header.item
    names: dict[tuple[int, int], Any] = header.raw_names if raw else header.names
    field, form, unnamed = ((b"ratelimit", b"%s;r=%d;t=%d", b'"limit"') if raw
                            else ("RateLimit", "%s;r=%d;t=%d", '"limit"'))
    # One tier (most selections): it governs every decision of its own checks, named now.
    single = applied[0].policy if count == 1 else None
    one: Any = (len(names) == 1 and single is not None and len(single.rates) == 1
                and next(iter(names.values())))
    switch, charge_preflight = SWITCH, guard.charge_preflight
    breaker, nodes, slots = guard.breaker, guard.nodes, guard.slots
    timeout, shadow = guard.timeout, guard.shadow

    def whole(hit: Compiled, identities: tuple[str, ...], token: str | None) -> Plan:
        """The plan of a request the selection's own checks apply to, under its identity."""
        return Plan(hit, identities, selection, whens, token)

    async def handle(request: Any, method: str, preflight: bool, peek: bool = False
                     ) -> Verdict | None:
        if limiter.generation != generation:  # its store, clock or metrics replaced: rebuilt
            return await handler_async(guard, limiter, selection)(request, method, preflight,
                                                                  peek)
        if switch.off:  # `ratelimit_mw.testing` switched limiting off (read per request)
            return None
        if preflight and not charge_preflight:
            return None
        plan: Plan | None = None
        identity: Any
        if direct:
            try:
                identity = ask(request)
            except Exception as exc:  # the planner logs it and counts the client IP
                identity = Raised(exc)
            if type(identity) is not str:  # None (a fallback, or no limit), or not a string
                plan = guard.plan(selection, request, method, preflight, {id(key): identity})
                if plan is None:
                    return None
        else:
            answers = None
            if selection.hooks or guard.exempt_hooks:
                answers = await answer_all_async(guard.hooks(selection, preflight), request)
            plan = guard.plan(selection, request, method, preflight, answers)
            if plan is None:
                return None
        if plan is None:  # the selection's own checks, under the one identity
            hit: Compiled = compiled  # type: ignore[assignment]
            identities: tuple[str, ...]
            chosen, watching = selection, watched
            if kept is not None:
                plan = kept.get(identity)
                if plan is None:
                    plan = keep(kept, identity, whole(hit, (identity,) * count, None))
                identities, token = plan.identities, None
            else:
                identities = (identity,) if count == 1 else (identity,) * count
                token = hit.token() if holds else None
                if watched:  # `whole`, written out: most requests carry their plan
                    plan = Plan(hit, identities, selection, whens, token)
        else:
            hit, identities, token, chosen = (plan.compiled, plan.identities, plan.token,
                                              plan.selection)
            watching = (guard.watch_status or plan.whens is not None
                        or plan.token is not None)
        # Closed (open_until 0.0) on nearly every request: no call. A cluster's: its node's.
        node = breaker if nodes is None else nodes.of(identities)
        if node.open_until and not node.may_call():  # skips the store: the failure policy
            return guard.failed(request, plan or whole(hit, identities, token), None,
                                peek=peek)
        # Timed only where an event reports it (a shadow refusal): a clock read costs.
        start = perf_counter() if shadow else 0.0
        try:
            if slots.owed:  # give-backs the store missed while it was out go first
                await slots_async.settle_owed_async(guard, limiter)
            if peek:  # Django's increment=False: the first check, asked without counting
                first = hit.items[0]
                decision = await limiter.peek(first[0], identities[0], timeout)
            elif here is not None and hit is compiled:  # the store in this process decides
                decision = here(identities, token)
            else:
                # The breaker's probe (it is still open) must reach the store: the deny
                # cache's answer would close it on a store nobody asked.
                decision = await limiter.hit_compiled(hit, identities, timeout,
                                                      cached=not node.open_until, token=token)
        except Exception as exc:  # anything from the store: never a 500
            return guard.failed(request, plan or whole(hit, identities, token), exc,
                                peek=peek)
        # An admission is the store's answer (the deny cache holds only refusals): it ends a
        # row of timeouts; an open breaker's probe is always the store's.
        # The decision's fields by index (0 allowed, 2 remaining, 4 reset_after): a
        # NamedTuple's field name is a descriptor call, its index is not.
        if node.open_until or (node.timeouts and decision[0]):
            node.succeeded()
        if decision[0]:
            if chosen is selection and rendered:  # the RateLimit fields (`admitter`)
                if one and hit is compiled:
                    name = one
                else:
                    rate = decision.rate
                    name = names.get((id(decision.policy), rate.period_ms if rate else 0),
                                     unnamed)
                pair = [fields, (field, form % (name, decision[2], ceil(decision[4])))]
                verdict = Admit()  # `admitted`, written out
                verdict.decision = decision
                verdict.headers = None if raw else pair
                verdict.plan = plan if watching else None
                verdict.raw = pair if raw else None
                return verdict
            return (admit if chosen is selection else guard.admitter(chosen))(
                decision, plan if watching else None)
        return guard.refused(request, plan or whole(hit, identities, token), decision, start,
                             watching)

    return handle
