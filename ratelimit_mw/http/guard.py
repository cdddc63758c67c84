"""The request guard: which limits apply to a request, and what to make of the store's answer.

Every adapter (ASGI, WSGI, Flask, FastAPI, Litestar, Django) reads the request, asks the
guard which limits apply, and runs their handler (`ratelimit_mw._async.handler`; the sync
one is generated from it), rendering the verdict in its own protocol::

    selection = guard.select(method, path, route)    # which limits apply (cached per shape)
    verdict = await handler_async(guard, limiter, selection)(request, method, preflight)

The selection (`http.selection`) is made once per method and route: its hit compiled
(`core.compiled.Compiled`) when its limits are fixed, whether its keys need a framework
Request, and how its admitted decisions become headers (`admitter`). The guard keeps what
the handlers share: the planner for requests whose keys, hooks, dynamic limits or costs
pick their own checks (`plan`), the refusal (`refused`), the failure policy (`failed`: the
breaker, the memory stand-in, on_backend_error) and what a response gives back when it ends.
A verdict is `Admit` (headers to add, checks to give back if the response's status says
so), `Refuse` (429: status, headers, body) or `Unavailable` (503). Nothing here raises for
anything a client sends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ratelimit_mw import keys as _keys
from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.core.policy import CONCURRENCY, Policy, SharedLogs
from ratelimit_mw.hooks import (
    Answers,
    ask,
    is_async,
    refuse_async,
)
from ratelimit_mw.http import slots as _slots
from ratelimit_mw.http.after import AfterResponse
from ratelimit_mw.http.config import Config
from ratelimit_mw.http.outcome import Outcomes
from ratelimit_mw.http.rules import Rule
from ratelimit_mw.http.selection import (
    METHODS,
    VERBS,
    Applied,
    Selection,
    kept_defaults,
    other_verb,
)
from ratelimit_mw.http.verdict import Plan
from ratelimit_mw.keys import KeyFunc
from ratelimit_mw.limiter import SWITCH
from ratelimit_mw.log import ThrottledLog, logger
from ratelimit_mw.routing import (
    EXEMPT,
    DynamicLimit,
    RouteLimit,
    checked_cost,
)

#: Where the adapters leave the `Decision` in a WSGI ``environ`` (ASGI: ``scope["state"]``).
DECISION_KEY = "ratelimit_mw.decision"

_PATH_CACHE_SIZE = 4096
_NO_STORE = ("Cache-Control", "no-store")
_JSON = ("Content-Type", "application/json")
_FALLBACK_KEY = _keys.client_ip()


def _kept(applied: tuple[Applied, ...]) -> list[Applied]:
    """The limits a request's plan keeps so far, as its headers name them."""
    return [Applied(a.policy, a.key, a.cost, a.label) for a in applied]


def _fallback_identity(request: Any) -> str:
    try:
        return _FALLBACK_KEY(request) or "ip:unknown"
    except Exception:
        return "ip:unknown"


class Guard(Outcomes, AfterResponse):
    """The validated configuration plus the state one app's middleware keeps (caches, breaker).

    ``timeout`` is the deadline the async drivers put around a backend call (None for an
    in-process backend, which a deadline could not interrupt); ``limiter`` is only read for
    its metrics hook.
    """

    def __init__(self, config: Config, limiter: Any, *, timeout: float | None,
                 raw: bool = False, awaits: str | None = None,
                 requests: str | None = None) -> None:
        """`awaits`: None when the adapter awaits async hooks (ASGI), else the adapter's
        name for the ConfigurationError that an async hook is there. `requests`: the kind
        of request the adapter hands over (`keys.ASGI`, `WSGI`, `DJANGO`), for a built-in
        key to read it directly (``for_kind``); None: a key looks at each request."""
        if awaits is not None:
            refuse_async(awaits, [
                ("exempt_when", config.exempt_when), ("key", config.key_func),
                *((f"{option} of the rule {rule.pattern!r}", hook) for rule in config.rule_list
                  for option, hook in (("key", rule.key), ("exempt_when", rule.exempt_when),
                                       ("cost", rule.cost),
                                       ("the dynamic limit",
                                        rule.dynamic.func if rule.dynamic else None)))])
        self.config = config
        self.enabled = config.enabled  # False: nothing applies to any request
        # Admitted responses' headers as RawHeaders (the ASGI adapter's), else as Headers.
        self.raw = raw
        self.requests = requests
        self.limiter = limiter
        self.timeout = timeout
        self.shadow = config.shadow
        self.headers = config.headers
        self.legacy = config.legacy_headers
        self.count_when = config.count_when
        # Responses whose status may give the hit back: count_when, or 405s not charged.
        self.watch_status = config.count_when is not None or not config.charge_method_not_allowed
        self.charge_preflight = config.charge_preflight
        self.charge_405 = config.charge_method_not_allowed
        self.exempt_when = config.exempt_when
        # The app's callables outside the selections that are handed the request.
        self._request_hooks = any(hook is not None for hook in (
            config.exempt_when, config.on_blocked, config.on_refusal,
            config.on_backend_error if callable(config.on_backend_error) else None))
        exempt = config.exempt_when
        self.exempt_hooks: tuple[Callable[[Any], Any], ...] = (
            (exempt,) if exempt is not None and is_async(exempt) else ())
        self.log_failure = ThrottledLog()
        # The ASGI requests holding in-flight slots, renewed and given back together, per
        # event loop (asgi_send.Holders).
        self.holders: dict[Any, Any] = {}
        # Give-backs owed to a store that missed them, slots taken in the memory fallback.
        self.slots = _slots.Slots()
        self.set_up_outcomes(config, limiter, timeout)
        key = config.key_func
        self.defaults = tuple(
            Applied(p, key, 1, "default" if len(config.defaults) == 1 else p.name,
                    config.per_method)
            for p in config.defaults
        ) + (() if config.in_flight is None else (Applied(config.in_flight, key, 1, "default"),))
        self.rules: tuple[Rule, ...] = config.rule_list
        logs = getattr(limiter, "shared_logs", None)
        if isinstance(logs, SharedLogs):
            # The limiter's decorators, and any other middleware on it, count in the same
            # logs: config.py checked the default and rules among themselves only.
            logs.add([*config.defaults,
                      *(rule.policy for rule in self.rules if rule.policy is not None)])
        self._rule_cache: dict[tuple[str, str], tuple[Rule, ...]] = {}
        self._selection_cache: dict[tuple[object, ...], Selection | None] = {}
        self._dynamic_cache: dict[tuple[int, ...], Selection] = {}
        # (key id, name) -> the key of a named limit (`_route_key`); bounded by the app's
        # decorators.
        self._shared_keys: dict[tuple[int, str], KeyFunc] = {}
        if not self.defaults and not self.rules:
            logger.info("ratelimit_mw middleware has no default and no rules: only decorated "
                        "routes are limited")

    @property
    def keys_in_use(self) -> list[KeyFunc]:
        return [self.config.key_func, *(rule.key for rule in self.rules if rule.key)]

    # -- which limits apply ----------------------------------------------------------------
    def _matching_rules(self, method: str, path: str) -> tuple[Rule, ...]:
        if not self.rules:
            return ()
        cache_key = (method, path)
        found = self._rule_cache.get(cache_key)
        if found is None:
            found = tuple(rule for rule in self.rules if rule.matches(method, path))
            if len(self._rule_cache) >= _PATH_CACHE_SIZE:
                # Paths are client text: a bounded cache, dropped whole when full.
                self._rule_cache.clear()
            self._rule_cache[cache_key] = found
        return found

    def select(self, method: str, path: str, route: object) -> Selection | None:
        """The limits for one request; `route` is what its endpoint carries (or None).

        A decorated route replaces the defaults with its own limits (those whose ``methods``
        include the request's) part by part: its rates replace the default rates, its
        in-flight slots the default slots, and a part it does not set is kept (a
        ``limit(concurrency=2)`` keeps the default rate). An exempt route drops them, an
        undecorated route gets the defaults; rules always add.
        """
        if not self.enabled:
            return None
        verb = method if method in VERBS else other_verb(method, route)
        if self.rules:
            rules = self._matching_rules(method, path)
            cache_key: tuple[object, ...] = (id(route), verb, *map(id, rules))
        else:
            rules = ()
            cache_key = (id(route), verb)
        try:
            return self._selection_cache[cache_key]
        except KeyError:
            pass
        from_rules = tuple(
            applied for rule in rules for applied in (
                Applied(rule.policy, rule.key or self.config.key_func, rule.cost, rule.label,
                        exempt_when=rule.exempt_when, dynamic=rule.dynamic,
                        count_when=rule.count_when)
                if (rule.policy or rule.dynamic) is not None else None,
                Applied(rule.in_flight, rule.key or self.config.key_func, 1, rule.label,
                        exempt_when=rule.exempt_when)
                if rule.in_flight is not None else None)
            if applied is not None
        )
        plain = from_rules if route == EXEMPT else self.defaults + from_rules
        routed: tuple[Applied, ...] = ()
        if isinstance(route, tuple):
            limits: tuple[RouteLimit, ...] = route
            routed = tuple(
                applied for limit in limits if limit.applies_to(method) for applied in (
                    Applied(limit.policy, self._route_key(limit), limit.cost,
                            limit.label, exempt_when=limit.exempt_when, dynamic=limit.dynamic,
                            routed=True, count_when=limit.count_when)
                    if (limit.policy or limit.dynamic) is not None else None,
                    Applied(limit.in_flight, self._route_key(limit), 1, limit.label,
                            exempt_when=limit.exempt_when, routed=True)
                    if limit.in_flight is not None else None)
                if applied is not None
            )
        if routed:
            fallback = Selection(plain) if plain else None
            kept = kept_defaults(self.defaults, routed)
            selection: Selection | None = Selection(routed + kept + from_rules, len(routed),
                                                    fallback)
        else:
            selection = Selection(plain) if plain else None
        for made in (selection, selection.fallback if selection is not None else None):
            if made is None:
                continue
            if all(item.policy is not None and type(item.cost) is int for item in made.applied):
                made.compiled = self.limiter.compile([(item.policy, item.cost)
                                                      for item in made.applied])
            made.scope_only = made.scope_only and not self._request_hooks
        # The key holds ids of objects that live as long as the app (routes, rules).
        self._selection_cache[cache_key] = selection
        return selection

    def _route_key(self, limit: RouteLimit) -> KeyFunc:
        """A decorator's key; for a limit shared by ``name=``, one whose ``keys.route()``
        gives the name: shared means one counter across its routes, whatever the key."""
        key = limit.key or self.config.key_func
        if limit.name is None or "route" not in _keys.reads(key):
            return key
        found = self._shared_keys.get((id(key), limit.name))
        if found is None:
            found = self._shared_keys[(id(key), limit.name)] = _keys.shared_route(key,
                                                                                   limit.name)
        return found

    # -- the checks of one request ---------------------------------------------------------
    def hooks(self, selection: Selection, preflight: bool = False
              ) -> tuple[Callable[[Any], Any], ...]:
        """The async hooks planning `selection` asks: an ASGI adapter awaits them
        (`hooks.answer_all_async`) and hands their answers to `plan`. None for an uncharged
        preflight, which `plan` answers without them."""
        if preflight and not self.charge_preflight:
            return ()
        return self.exempt_hooks + selection.hooks if self.exempt_hooks else selection.hooks

    def plan(self, selection: Selection, request: Any, method: str,
             preflight: bool = False, answers: Answers | None = None) -> Plan | None:
        """Run the key functions and costs (`answers`: the async ones' answers, awaited
        already); None when nothing applies to this request. A route's limits whose keys
        all say None give way to its fallback (the defaults and rules)."""
        if SWITCH.off:  # `ratelimit_mw.testing` switched limiting off (read per request)
            return None
        if preflight and not self.charge_preflight:
            return None
        if self.exempt_when is not None and self._exempt(self.exempt_when, request, answers):
            return None
        while True:
            applied = selection.applied
            compiled = selection.compiled
            identities: list[str] = []
            # The (policy, cost) of each check, listed only once the request's set differs
            # from the selection's compiled one.
            items: list[tuple[Policy, int]] | None = None if compiled is not None else []
            chosen: list[Applied] | None = [] if selection.dynamic else None
            whens: list[Callable[[int], bool] | None] | None = [] if selection.counts else None
            keyed = False  # a routed limit applies (or is exempted on purpose): no fallback
            for item in applied:
                if item.exempt_when is not None and self._exempt(item.exempt_when, request,
                                                                 answers):
                    keyed = keyed or item.routed
                    if items is None:
                        items = [(a.policy, a.cost) for a in applied[:len(identities)]]  # type: ignore[misc]
                    if chosen is None:  # the headers name only the limits that apply
                        chosen = _kept(applied[:len(identities)])
                    continue
                policy = item.policy
                if item.dynamic is not None:
                    policy = self._dynamic_policy(item.dynamic, request, answers)
                identity = None
                if policy is not None:  # the identity it counts this request under
                    try:
                        identity = (item.key(request) if answers is None
                                    else ask(item.key, request, answers))
                    except Exception as exc:  # a key function's bug must not become a 500
                        self.log_failure("ratelimit_mw key function raised; using the client IP",
                                         exc)
                        identity = _fallback_identity(request)
                    if identity is not None and (item.per_method or type(identity) is not str):
                        identity = self._shaped(item, identity, request, method)
                if identity is None:
                    if items is None:
                        items = [(a.policy, a.cost) for a in applied[:len(identities)]]  # type: ignore[misc]
                    if chosen is None:
                        chosen = _kept(applied[:len(identities)])
                    continue
                keyed = keyed or item.routed
                identities.append(identity)
                if items is not None:
                    cost = item.cost
                    items.append((policy, cost if type(cost) is int
                                  else self._cost(cost, request, answers)))  # type: ignore[arg-type]
                if chosen is not None:
                    chosen.append(Applied(policy, item.key, item.cost, item.label))
                if whens is not None:
                    whens.append(item.count_when)
            if selection.routed and not keyed and selection.fallback is not None:
                selection = selection.fallback
                continue
            if not identities:
                return None
            if items is not None:
                compiled = self.limiter.compile(items)
            elif compiled is None:  # the items are listed wherever the selection compiled none
                raise ValueError("a plan has no compiled hit")
            token = None
            # Slots are named by a token, to give them back by it.
            if selection.holds and (items is None or any(policy.algorithm == CONCURRENCY
                                                         for policy in compiled.policies)):
                token = compiled.token()
            if chosen is not None:
                selection = self._chosen_selection(chosen)
            return Plan(compiled, tuple(identities), selection,
                        None if whens is None else tuple(whens), token)

    def _shaped(self, item: Applied, identity: object, request: Any, method: str) -> str:
        """A key's answer that is not yet an identity: not a string (the client IP stands
        in), or counted per method."""
        text = identity if type(identity) is str else self._not_a_string(item, identity, request)
        if item.per_method:
            verb = "GET" if method == "HEAD" else (method if method in METHODS else "OTHER")
            return f"{verb} {text}"
        return text

    def _cost(self, cost: Callable[[Any], Any], request: Any, answers: Answers | None) -> int:
        try:
            return checked_cost(cost, ask(cost, request, answers))
        except ConfigurationError:
            raise  # the app's cost callable returns a non-int: its bug, said so
        except Exception as exc:
            self.log_failure("ratelimit_mw cost function raised; counting 1", exc)
            return 1

    def _dynamic_policy(self, dynamic: DynamicLimit, request: Any,
                        answers: Answers | None) -> Policy | None:
        try:
            return dynamic.policy_of(ask(dynamic.func, request, answers))
        except Exception as exc:  # raised, or returned text that is not a rate: never a 500
            # The ConfigurationError of bad text names the callable and what to return; it
            # is logged (throttled, not per request) like any failure of the app's hooks.
            self.log_failure("ratelimit_mw dynamic limit failed; that limit is skipped", exc)
            return None

    def _chosen_selection(self, chosen: list[Applied]) -> Selection:
        """The header of a request whose dynamic limits picked these policies, once per set."""
        cache_key = tuple(id(item.policy) for item in chosen)
        found = self._dynamic_cache.get(cache_key)
        if found is None or [a.policy for a in found.applied] != [a.policy for a in chosen]:
            found = Selection(tuple(chosen))
            if len(self._dynamic_cache) >= _PATH_CACHE_SIZE:
                self._dynamic_cache.clear()
            self._dynamic_cache[cache_key] = found
        return found

    def _not_a_string(self, item: Applied, identity: object, request: Any) -> str:
        # Anything else would fail in the limiter and trip the breaker, leaving every client
        # unlimited for the cool-down.
        self.log_failure("ratelimit_mw key function returned a non-string; using the client IP",
                         TypeError(f"{item.key!r} returned {identity!r}"))
        return _fallback_identity(request)

    def _exempt(self, predicate: Callable[[Any], bool], request: Any,
                answers: Answers | None) -> bool:
        try:
            return bool(ask(predicate, request, answers))
        except Exception as exc:
            self.log_failure("ratelimit_mw exempt_when raised; limiting the request", exc)
            return False
