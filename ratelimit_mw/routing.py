"""Per-route limits: what `@limiter.limit(...)` and `@limiter.exempt` attach to an endpoint.

Decorators only attach metadata to the function; the middleware finds the endpoint a request
routes to and enforces. Applying the decorator above or below the framework's route decorator
both work, because the frameworks register the function object itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

from ratelimit_mw._errors import ConfigurationError
from ratelimit_mw.policy import Policy

F = TypeVar("F", bound=Callable[..., Any])
KeyFunc: TypeAlias = Callable[[Any], str | None]
Cost: TypeAlias = int | Callable[[Any], int]

ATTRIBUTE = "__ratelimit_mw__"
EXEMPT = "exempt"


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


@dataclass(frozen=True, slots=True)
class RouteLimit:
    """One decorator's limit: the policy, the key function (None: the middleware's), the cost."""

    policy: Policy | None
    rates: str | Policy
    key: KeyFunc | None
    cost: Cost
    name: str | None

    @classmethod
    def make(cls, rates: Policy | str, *, key: KeyFunc | None, cost: Cost,
             name: str | None) -> RouteLimit:
        if key is not None and not callable(key):
            raise ConfigurationError(
                f"key must be a key function, got {key!r}; e.g. key=keys.header('X-API-Key')"
            )
        policy: Policy | None = None
        if isinstance(rates, Policy):
            policy = rates
        elif isinstance(rates, str):
            Policy(rates)  # validate now: a typo must fail at import time, not on a request
        else:
            raise ConfigurationError(
                f'limit() takes a rate string such as "5/minute" or a Policy, got {rates!r}'
            )
        return cls(policy, rates, key, validate_cost(cost, policy), name)

    def bound_to(self, func: Callable[..., Any]) -> RouteLimit:
        """The limit with its policy named after the endpoint, so each route counts apart."""
        if self.policy is not None:
            return self
        module = getattr(func, "__module__", "?")
        name = self.name or f"{module}.{getattr(func, '__qualname__', '?')}"
        policy = Policy(str(self.rates), name=name)
        return RouteLimit(policy, self.rates, self.key, validate_cost(self.cost, policy), name)


def limit_decorator(route_limit: RouteLimit) -> Callable[[F], F]:
    def decorate(func: F) -> F:
        current = getattr(func, ATTRIBUTE, ())
        if current == EXEMPT:
            raise ConfigurationError(
                f"{getattr(func, '__qualname__', func)!r} is both exempt and limited; keep one"
            )
        bound = route_limit.bound_to(func)
        setattr(func, ATTRIBUTE, (*current, bound))
        return func

    return decorate


def exempt(func: F) -> F:
    if getattr(func, ATTRIBUTE, ()) not in ((), EXEMPT):
        raise ConfigurationError(
            f"{getattr(func, '__qualname__', func)!r} is both exempt and limited; keep one"
        )
    setattr(func, ATTRIBUTE, EXEMPT)
    return func


def route_limits(endpoint: Any) -> tuple[RouteLimit, ...] | str | None:
    """What the endpoint carries: its limits, EXEMPT, or None (undecorated)."""
    value = getattr(endpoint, ATTRIBUTE, None)
    if value is None:
        return None
    return value  # type: ignore[no-any-return]
