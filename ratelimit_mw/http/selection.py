"""Which limits apply to a request shape: `Applied` (one policy, its key, cost and
conditions) and `Selection` (the limits of one method and route, with what is fixed for
them worked out once: the RateLimit-Policy header, the compiled hit, whether a framework
Request is needed). `Guard.select` builds and caches them; nothing here runs per request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ratelimit_mw import keys as _keys
from ratelimit_mw.core.compiled import Compiled
from ratelimit_mw.core.policy import CONCURRENCY, Policy
from ratelimit_mw.hooks import is_async
from ratelimit_mw.http.headers import PolicyHeader
from ratelimit_mw.keys import KeyFunc
from ratelimit_mw.routing import Cost, DynamicLimit, Predicate

__all__ = ["METHODS", "VERBS", "Applied", "Selection", "kept_defaults", "other_verb"]

# Methods a per-method default counts apart; anything else a client invents shares "OTHER",
# so that a made-up method is not a fresh quota.
METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# The selections are cached per verb: these, and "OTHER" for the rest (a bounded cache),
# except a method that the route's own limits name (see other_verb).
VERBS = METHODS | {"HEAD"}


@dataclass(frozen=True, slots=True)
class Applied:
    """One policy applied to a request, with its key, cost, header label and conditions."""

    policy: Policy | None  # None: chosen per request by `dynamic`
    key: KeyFunc
    cost: Cost
    label: str
    per_method: bool = False
    exempt_when: Predicate | None = None
    dynamic: DynamicLimit | None = None
    routed: bool = False  # from the route's decorators (see Selection.routed)
    count_when: Callable[[int], bool] | None = None  # its own, over the middleware's


class Selection:
    """The policies that apply to a request shape, with their header rendered once.

    ``routed`` counts the leading items that come from the route's decorators; when every one
    of their keys says None, ``fallback`` (the defaults and rules) applies instead, so a
    decorated route is never left without a limit by a missing header.
    """

    __slots__ = ("admit", "applied", "compiled", "counts", "dynamic", "fallback",
                 "handler_async", "handler_sync", "holds", "hooks", "policy_header", "routed",
                 "scope_only")

    def __init__(self, applied: tuple[Applied, ...], routed: int = 0,
                 fallback: Selection | None = None) -> None:
        self.applied = applied
        self.routed = routed
        self.fallback = fallback
        self.policy_header = PolicyHeader([(item.policy, item.label) for item in applied
                                           if item.policy is not None])
        self.dynamic = any(item.dynamic is not None for item in applied)
        # Some limit has a count_when of its own: each check is given back by its own.
        self.counts = any(item.count_when is not None for item in applied)
        # Some limit is in flight: its slots are held while the response runs.
        self.holds = any(item.policy is not None and item.policy.algorithm == CONCURRENCY
                         for item in applied)
        # The async hooks the plan asks (fallback's included): an ASGI adapter awaits them
        # first (`ratelimit_mw._async.hooks.answer_all_async`).
        self.hooks: tuple[Callable[[Any], Any], ...] = tuple(dict.fromkeys(
            hook for item in applied
            for hook in (item.exempt_when, item.key,
                         item.dynamic.func if item.dynamic is not None else None,
                         item.cost if callable(item.cost) else None)
            if is_async(hook)
        )) + (fallback.hooks if fallback is not None else ())
        # The hit of every item, compiled by `Guard.select` when each has a fixed policy
        # and cost.
        self.compiled: Compiled | None = None
        # (the guard, how it turns an admitted decision into its Admit): `Guard._admitter`.
        self.admit: tuple[Any, Callable[..., Any]] | None = None
        # (the limiter, its generation, the handler built for them): `_async.handler`.
        self.handler_async: tuple[Any, int, Callable[..., Any]] | None = None
        self.handler_sync: tuple[Any, int, Callable[..., Any]] | None = None
        # Every key is a built-in one that reads only the scope, and no callable of the app
        # is asked: the ASGI adapter hands the keys the scope, not a framework Request
        # (`Guard.select` also clears it where the config's own hooks take the request).
        self.scope_only: bool = all(
            _keys.reads_scope(item.key) and item.exempt_when is None and item.dynamic is None
            and not callable(item.cost) for item in applied
        ) and (fallback is None or fallback.scope_only)


def kept_defaults(defaults: tuple[Applied, ...],
                   routed: tuple[Applied, ...]) -> tuple[Applied, ...]:
    """The defaults a decorated route keeps: the rates when its limits set none (only
    in-flight slots), the slots when they set none (only rates)."""
    def slots(item: Applied) -> bool:
        return item.policy is not None and item.policy.algorithm == CONCURRENCY

    sets_rates = any(not slots(item) for item in routed)
    sets_slots = any(slots(item) for item in routed)
    return tuple(item for item in defaults if not (sets_slots if slots(item) else sets_rates))


def other_verb(method: str, route: object) -> str:
    """The selection cache's verb for a method outside `VERBS`: "OTHER", shared by every
    such method, unless a limit of the route names this one (``methods=["PROPFIND"]``):
    its selection differs from the other methods', so it is cached apart. Rules need no
    verb: the rules a request matches, method included, are in the key themselves. The
    methods routes name are a set fixed by the code, so the cache stays bounded whatever
    methods clients invent."""
    if isinstance(route, tuple):
        for limit in route:
            if limit.methods is not None and method in limit.methods:
                return method
    return "OTHER"
