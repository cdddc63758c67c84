"""For view code that decides itself: `is_ratelimited` and its async twin.

    from ratelimit_mw.django import is_ratelimited

    def login(request):
        if is_ratelimited(request, "5/minute", key=keys.client_ip(), name="login",
                          increment=True):
            return HttpResponse("slow down", status=429)

``name`` names the counter: calls with the same name (and algorithm) count together, so give
each use its own. ``key`` is by default the settings' key, as for a decorator. By default
they only ask (``increment=False``, as django-ratelimit's): limited when a hit now would be
refused; ``increment=True`` counts the request.

They take the middleware's way (a selection's handler, `_async/handler.py`) through the
guard the settings make (`conf.Limiters`), shared with the middleware: its breaker, its
deadline under ASGI (``backend_timeout``), ``on_backend_error`` (``"allow"`` says not
limited, ``"deny"`` limited, ``"memory"`` decides in memory, a callable decides),
``mode="shadow"`` (never limited), ``on_refusal`` and the metrics. The Decision is left on
``request.ratelimit`` (None when nothing was decided); with the settings' ``enabled`` off
nothing is limited.
"""

from __future__ import annotations

import functools
from typing import Any

from ratelimit_mw._async.handler import handler_async
from ratelimit_mw._sync.handler import handler_sync
from ratelimit_mw.core.policy import Policy, as_policy
from ratelimit_mw.django import conf
from ratelimit_mw.django.legacy import check_key, check_rates
from ratelimit_mw.hooks import refuse_async
from ratelimit_mw.http.guard import Guard
from ratelimit_mw.http.selection import Applied, Selection
from ratelimit_mw.http.verdict import Refuse, Unavailable, Verdict
from ratelimit_mw.keys import KeyFunc, reads
from ratelimit_mw.routing import Cost, validate_cost


@functools.lru_cache(maxsize=256)
def _policy(rates: str, name: str | None) -> Policy:
    check_rates(rates)
    return as_policy(rates) if name is None else Policy(rates, name=name)


def _make_selection(policy: Policy, key: KeyFunc, cost: Cost) -> Selection:
    """What one call applies, checked: the middleware's `Selection` of one limit."""
    check_key(key)
    validate_cost(cost, policy)
    return Selection((Applied(policy, key, cost, policy.name),))


_cached_selection = functools.lru_cache(maxsize=1024, typed=True)(_make_selection)


def _selection(guard: Guard, rates: Policy | str, key: KeyFunc | None, cost: Cost,
               name: str | None) -> Selection:
    """What the call applies; its key by default the settings' (as a decorator's)."""
    policy = rates if isinstance(rates, Policy) else _policy(rates, name)
    key = key or guard.config.key_func
    try:
        return _cached_selection(policy, key, cost)
    except TypeError:  # an unhashable key (a callable dataclass): checked on every call
        return _make_selection(policy, key, cost)


def _limited(request: Any, verdict: Verdict | None) -> bool:
    """The verdict as the answer: a refusal, or the store down under "deny", is limited."""
    request.ratelimit = None if verdict is None else getattr(verdict, "decision", None)
    return isinstance(verdict, (Refuse, Unavailable))


def is_ratelimited(request: Any, rates: Policy | str, *, key: KeyFunc | None = None,
                   cost: Cost = 1, name: str | None = None, increment: bool = False) -> bool:
    """Whether this request is over `rates` for its key (default: the settings' key, the
    client IP unless it says otherwise); a key that says None is never limited. Counts
    only with ``increment=True``."""
    limiters = conf.current()
    guard = limiters.sync_guard()
    selection = _selection(guard, rates, key, cost, name)
    if selection.hooks:  # nothing here could await them
        refuse_async("is_ratelimited", [("key", key), ("cost", cost)])
    if not guard.enabled:
        return _limited(request, None)
    handle = handler_sync(guard, limiters.sync(), selection)
    return _limited(request, handle(request, request.method or "GET", False, not increment))


async def ais_ratelimited(request: Any, rates: Policy | str, *, key: KeyFunc | None = None,
                          cost: Cost = 1, name: str | None = None,
                          increment: bool = False) -> bool:
    """`is_ratelimited` for async views, on the settings' AsyncLimiter: its key and cost
    may be coroutines."""
    limiters = conf.current()
    guard = limiters.async_guard()
    selection = _selection(guard, rates, key, cost, name)
    if not guard.enabled:
        return _limited(request, None)
    if hasattr(request, "auser") and "user" in reads(selection.applied[0].key):
        request.user = await request.auser()  # the lazy user cannot load on the loop
    handle = handler_async(guard, limiters.asynchronous(), selection)
    return _limited(request, await handle(request, request.method or "GET", False,
                                          not increment))
