"""Per-route limits: what `@limiter.limit(...)` and `@limiter.exempt` attach to an endpoint.

Decorators only attach metadata to the function; the middleware finds the endpoint a request
routes to and enforces. Applying the decorator above or below the framework's route decorator
both work, because the frameworks register the function object itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, Union

from ratelimit_mw._errors import ConfigurationError
from ratelimit_mw.policy import Policy

F = TypeVar("F", bound=Callable[..., Any])
KeyFunc = Callable[[Any], Union[str, None]]
Cost = Union[int, Callable[[Any], int]]

ATTRIBUTE = "__ratelimit_mw__"
EXEMPT = "exempt"


@dataclass(frozen=True, slots=True)
class RouteLimit:
    """One decorator's limit: the policy, the key function (None: the middleware's), the cost."""

    policy: Policy | None
    rates: Policy | str
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
        if callable(cost):
            pass
        elif isinstance(cost, bool) or not isinstance(cost, int) or cost < 1:
            raise ConfigurationError(f"cost must be a whole number >= 1 or a callable, got {cost!r}")
        policy: Policy | None = None
        if isinstance(rates, Policy):
            policy = rates
        elif isinstance(rates, str):
            Policy(rates)  # validate now: a typo must fail at import time, not on a request
        else:
            raise ConfigurationError(
                f'limit() takes a rate string such as "5/minute" or a Policy, got {rates!r}'
            )
        if policy is not None and isinstance(cost, int):
            too_big = [r for r in policy.rates if r.limit < cost]
            if too_big:
                raise ConfigurationError(
                    f"cost={cost} exceeds the limit of {too_big[0]}: such a request could never "
                    "be admitted"
                )
        return cls(policy, rates, key, cost, name)

    def bound_to(self, func: Callable[..., Any]) -> RouteLimit:
        """The limit with its policy named after the endpoint, so each route counts apart."""
        if self.policy is not None:
            return self
        name = self.name or f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', '?')}"
        policy = Policy(self.rates, name=name)  # type: ignore[arg-type]
        if isinstance(self.cost, int):
            too_big = [r for r in policy.rates if r.limit < self.cost]
            if too_big:
                raise ConfigurationError(
                    f"cost={self.cost} exceeds the limit of {too_big[0]}: such a request could "
                    "never be admitted"
                )
        return RouteLimit(policy, self.rates, self.key, self.cost, name)


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
