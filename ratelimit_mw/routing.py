"""Per-route limits: what `@limiter.limit(...)` and `@limiter.exempt` attach to an endpoint.

Decorators only attach metadata to the function; the middleware finds the endpoint a request
routes to and enforces. The decorator works above or below the framework's route decorator,
because the frameworks register the function object itself.

Counter names hold the endpoint's full dotted module name, so two modules of one last name
(every Django app's ``views.py``) count apart, and the same however the app is started:
``report`` in ``pkg/app.py`` is ``route pkg.app.report 5/minute`` under
``uvicorn pkg.app:app``, ``python -m pkg.app`` and ``python pkg/app.py`` alike (never
``__main__``). Give ``name=`` to share a quota between routes.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, TypeAlias, TypeVar

from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.core.policy import Policy, SharedLogs
from ratelimit_mw.keys import KeyFunc

F = TypeVar("F", bound=Callable[..., Any])
Cost: TypeAlias = int | Callable[[Any], int]
Predicate: TypeAlias = Callable[[Any], bool]

ATTRIBUTE = "__ratelimit_mw__"
EXEMPT = "exempt"

# RFC 9110 token characters: what a method name may be made of.
_TOKEN_CHARS = frozenset("!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
                         "abcdefghijklmnopqrstuvwxyz")
_DYNAMIC_CACHE_SIZE = 1024


def validate_methods(methods: Iterable[str] | None) -> frozenset[str] | None:
    """The methods a rule or a route limit applies to, upper-cased (None: every method).
    HEAD is served by the GET handler, so a GET limit covers it."""
    if methods is None:
        return None
    if isinstance(methods, str):
        raise ConfigurationError(
            f'methods takes a list, e.g. methods=["POST"], not the string {methods!r}'
        )
    out: set[str] = set()
    for method in methods:
        if not isinstance(method, str) or not method or not _TOKEN_CHARS.issuperset(method):
            raise ConfigurationError(
                f"methods takes HTTP method names such as \"POST\" or \"PROPFIND\", got "
                f'{method!r}; e.g. methods=["POST"]'
            )
        out.add(method.upper())
    if not out:
        # An empty list would be a limit that never applies.
        raise ConfigurationError('methods must name at least one method, e.g. methods=["GET"]'
                                 " (leave it out for every method)")
    return frozenset(out | {"HEAD"} if "GET" in out else out)


def validate_key(key: object) -> KeyFunc | None:
    if key is not None and not callable(key):
        raise ConfigurationError(
            f"key must be a key function, got {key!r}; e.g. key=keys.header('X-API-Key')"
        )
    return key


def validate_predicate(name: str, value: object) -> Predicate | None:
    if value is not None and not callable(value):
        raise ConfigurationError(
            f"{name} must be a callable (request) -> bool, e.g. {name}=lambda request: "
            f"request.client.host == '127.0.0.1'; got {value!r}"
        )
    return value


def validate_count_when(value: object) -> Callable[[int], bool] | None:
    if value is not None and not callable(value):
        raise ConfigurationError(
            f"count_when must be a callable (status) -> bool, e.g. count_when=lambda status: "
            f"status >= 400; got {value!r}"
        )
    return value


def validate_cost(cost: Cost, policy: Policy | None) -> Cost:
    """A cost is a whole number >= 1 no larger than any limit, or a callable (request) -> int."""
    if callable(cost):
        return cost
    if isinstance(cost, bool) or not isinstance(cost, int) or cost < 1:
        raise ConfigurationError(
            f"cost must be a whole number >= 1 or a callable, got {cost!r}; e.g. cost=2"
        )
    if policy is not None:
        for rate in policy.rates:
            if cost > rate.limit:
                raise ConfigurationError(
                    f"cost={cost} exceeds the limit of {rate} in {policy.name!r}: such a "
                    "request could never be admitted"
                )
    return cost


def in_flight_policy(concurrency: object) -> Policy | None:
    """What ``concurrency=`` says: None, a number of slots (the default lease) or a
    `Policy.in_flight` (a lease of its own), checked at configuration time."""
    if concurrency is None:
        return None
    if isinstance(concurrency, Policy):
        if concurrency.algorithm != "concurrency":
            raise ConfigurationError(
                f"concurrency takes a number of slots or a Policy.in_flight(...), got "
                f"{concurrency!r}; write concurrency=4 or concurrency=Policy.in_flight(4, "
                "lease=300) (a rate goes in the rates)")
        return concurrency
    if type(concurrency) is not int or concurrency < 1:
        raise ConfigurationError(
            f"concurrency is the number of requests in flight at once (a whole number >= 1) "
            f"or a Policy.in_flight(...), got {concurrency!r}; e.g. concurrency=4")
    return Policy.in_flight(concurrency)


def named_in_flight(policy: Policy, base: str, name: str | None = None) -> Policy:
    """`policy` with its slots named after `base` (a route, a rule, the default), so that
    every place counts its own, or `name` (the limit's ``name=``: shared on purpose, as a
    named rate is); a Policy.in_flight given a name of its own keeps it."""
    slots = policy.rates[0].limit
    if policy.name != f"{slots} in flight":
        return policy
    return Policy.in_flight(slots, lease=policy.rates[0].period_ms / 1000,
                            name=name or f"{base} {slots} in flight")


def checked_cost(cost: Callable[[Any], int], value: object) -> int:
    """What the cost callable `cost` said (`value`) as a cost (at least 1). A float or any
    other type is the app's bug, reported as such rather than truncated (an exception inside
    the callable, e.g. it parsed hostile input, is the caller's to handle: it counts 1)."""
    if type(value) is not int:
        raise ConfigurationError(
            f"the cost callable {getattr(cost, '__qualname__', cost)!r} returned {value!r}; "
            "a cost is a whole number (int), e.g. cost=lambda request: len(items) or "
            "math.ceil(size / 1024)"
        )
    return max(1, value)


class DynamicLimit:
    """A limit whose rate is chosen per request: ``(request) -> rate text`` (or None).

    Each distinct text is parsed once into a Policy named ``"<base> <text>"`` (so each rate
    counts apart, as rules of different rates do), in a bounded map dropped whole when full.
    None means no limit of this kind for the request. A text that is not a rate is the app's
    bug: `ConfigurationError`, naming it.
    """

    __slots__ = ("_cache", "base", "func")

    def __init__(self, func: Callable[[Any], str | None], base: str) -> None:
        self.func = func
        self.base = base
        self._cache: dict[str, Policy] = {}

    def policy_of(self, text: object) -> Policy | None:
        """The policy for what `func` answered for a request."""
        if text is None:
            return None
        if not isinstance(text, str):
            raise ConfigurationError(
                f"the dynamic limit {getattr(self.func, '__qualname__', self.func)!r} "
                f'returned {text!r}; it must return rate text such as "100/hour" or None'
            )
        found = self._cache.get(text)
        if found is None:
            found = Policy(text, name=f"{self.base} {text}")
            if len(self._cache) >= _DYNAMIC_CACHE_SIZE:
                self._cache.clear()
            self._cache[text] = found
        return found


def stable_module(func: object) -> str:
    """The module part of a counter name: the module's full dotted name, also when it runs
    as ``__main__`` (the name an import would give it, e.g. ``uvicorn pkg.app:app``)."""
    module = str(getattr(func, "__module__", None) or "?")
    if module != "__main__":
        return module
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and getattr(spec, "name", None):  # python -m pkg.app
        return str(spec.name)
    path = getattr(main, "__file__", None)
    if not path:
        return "__main__"
    # python pkg/app.py: the script's dotted name, up through the packages that hold it.
    directory, filename = os.path.split(os.path.abspath(path))
    parts = [os.path.splitext(filename)[0]]
    while os.path.isfile(os.path.join(directory, "__init__.py")):
        directory, package = os.path.split(directory)
        if not package:
            break
        parts.append(package)
    return ".".join(reversed(parts))


@dataclass(frozen=True, slots=True)
class RouteLimit:
    """One decorator's limit: policy, key (None: the middleware's), cost, methods, label;
    ``in_flight``: its in-flight slots (``concurrency=``), beside the rate or alone (then
    ``rates`` is None)."""

    policy: Policy | None
    rates: str | Policy | Callable[[Any], str | None] | None
    key: KeyFunc | None
    cost: Cost
    name: str | None
    methods: frozenset[str] | None = None
    exempt_when: Predicate | None = None
    label: str = "route"
    dynamic: DynamicLimit | None = None
    count_when: Callable[[int], bool] | None = None
    concurrency: Policy | None = None  # the in-flight limit as written
    in_flight: Policy | None = None  # ... named after what it decorates (`bound_to`)

    @classmethod
    def make(cls, rates: Policy | str | Callable[[Any], str | None] | None, *,
             key: KeyFunc | None, cost: Cost, name: str | None,
             methods: Iterable[str] | None = None, exempt_when: Predicate | None = None,
             count_when: Callable[[int], bool] | None = None,
             concurrency: Policy | int | None = None) -> RouteLimit:
        validate_key(key)
        validate_predicate("exempt_when", exempt_when)
        validate_count_when(count_when)
        in_flight = in_flight_policy(concurrency)
        if isinstance(rates, Policy) and rates.algorithm == "concurrency":
            raise ConfigurationError(
                f"an in-flight limit goes in concurrency=, got it as the rates: {rates!r}; "
                f'write limit(concurrency={rates!r}) or limit("5/minute", concurrency=...)')
        policy = rates if isinstance(rates, Policy) else None
        if isinstance(rates, str):
            Policy(rates)  # validate now: a typo must fail at import time, not on a request
        elif rates is None and in_flight is None:
            raise ConfigurationError(
                'limit() needs a rate, an in-flight limit or both: limit("5/minute"), '
                'limit(concurrency=4) or limit("5/minute", concurrency=4)')
        elif policy is None and rates is not None and not callable(rates):
            raise ConfigurationError(
                f'limit() takes a rate string such as "5/minute", a Policy or a callable '
                f"(request) -> rate text, got {rates!r}"
            )
        label = policy.name if policy is not None else (name or "route")
        return cls(policy, rates, key, validate_cost(cost, policy), name,
                   validate_methods(methods), exempt_when, label, None, count_when, in_flight)

    def bound_to(self, target: object) -> RouteLimit:
        """The limit with its policy (and its in-flight slots) named after the endpoint, so
        each route counts apart."""
        qualname = getattr(target, "__qualname__", None) or getattr(target, "name", "?")
        base = self.name or f"route {stable_module(target)}.{qualname}"
        bound = self
        if self.concurrency is not None and self.in_flight is None:
            bound = replace(self, in_flight=named_in_flight(self.concurrency, base, self.name))
            if self.rates is None:
                return replace(bound, label=str(self.name or qualname))
        if self.policy is not None or self.dynamic is not None or self.rates is None:
            return bound
        label = str(self.name or qualname)
        if not isinstance(self.rates, str):
            return replace(bound, label=label, dynamic=DynamicLimit(self.rates, base))  # type: ignore[arg-type]
        policy = Policy(self.rates, name=self.name or f"{base} {self.rates}")
        return replace(bound, policy=policy, cost=validate_cost(self.cost, policy), label=label)

    def applies_to(self, method: str) -> bool:
        return self.methods is None or method in self.methods


def _both(func: object) -> ConfigurationError:
    return ConfigurationError(
        f"{getattr(func, '__qualname__', func)!r} is both exempt and limited; keep one")


def _function_of(endpoint: object) -> object:
    """What a limit is named after: the endpoint, or the function a framework's route object
    keeps as ``fn`` when the decorator sits above its route decorator (Litestar's ``@get``)."""
    fn = getattr(endpoint, "fn", None)
    plain = isinstance(endpoint, type) or inspect.isroutine(endpoint)
    return fn if callable(fn) and not plain else endpoint


def limit_decorator(route_limit: RouteLimit,
                    logs: SharedLogs | None = None) -> Callable[[F], F]:
    """The decorator attaching `route_limit` to an endpoint; `logs`: the limiter's record of
    sliding-log names, which the bound policy must agree with (checked as it decorates)."""
    def decorate(func: F) -> F:
        current = getattr(func, ATTRIBUTE, ())
        if current == EXEMPT:
            raise _both(func)
        bound = route_limit.bound_to(_function_of(func))
        if logs is not None and bound.policy is not None:
            logs.add((bound.policy,))
        setattr(func, ATTRIBUTE, (*current, bound))
        return func

    return decorate


def exempt(func: F) -> F:
    if getattr(func, ATTRIBUTE, ()) not in ((), EXEMPT):
        raise _both(func)
    setattr(func, ATTRIBUTE, EXEMPT)
    return func


def route_limits(endpoint: Any) -> tuple[RouteLimit, ...] | str | None:
    """What the endpoint carries: its limits, EXEMPT, or None (undecorated). Only the two
    shapes the decorators write are believed: a mock or proxy may answer any attribute."""
    value = getattr(endpoint, ATTRIBUTE, None)
    return value if value == EXEMPT or isinstance(value, tuple) else None
