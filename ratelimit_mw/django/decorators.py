"""Per-view limits for Django: ``@limit(...)`` and ``@exempt`` on function views, on
class-based views (the class itself) and through ``method_decorator`` (``dispatch`` or one
handler such as ``post``). They only attach metadata; the middleware enforces."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ratelimit_mw.core.policy import Policy
from ratelimit_mw.django.conf import SHARED_LOGS
from ratelimit_mw.django.legacy import check_key, check_rates
from ratelimit_mw.keys import KeyFunc
from ratelimit_mw.routing import EXEMPT, Cost, RouteLimit, limit_decorator, route_limits
from ratelimit_mw.routing import exempt as _exempt

F = TypeVar("F", bound=Callable[..., Any])

# The limits as written, before `bound_to` named their counters after what they decorate:
# method_decorator applies a decorator to a throw-away function of Django's, whose name every
# such method shares, so the middleware names them after the view class and method instead.
_WRITTEN = "__ratelimit_mw_written__"


def limit(rates: Policy | str | Callable[[Any], str | None] | None = None, *,
          key: KeyFunc | None = None, cost: Cost = 1, name: str | None = None,
          methods: Sequence[str] | None = None,
          exempt_when: Callable[[Any], Any] | None = None,
          count_when: Callable[[int], bool] | None = None,
          concurrency: Policy | int | None = None) -> Callable[[F], F]:
    """Limit one view: ``@limit("5/minute")``; ``key``, ``cost``, ``methods``,
    ``exempt_when``, ``count_when``, ``concurrency`` (requests in flight at once) and a
    callable ``rates`` (a dynamic limit) as on the other adapters. Under ASGI Django the
    key, cost, condition and dynamic limit may be coroutines. django-ratelimit's string
    keys and ``(group, request)`` callables are refused here, saying what to write
    (`legacy`): they would only fail on a request."""
    check_key(key)
    check_rates(rates)
    written = RouteLimit.make(rates, key=key, cost=cost, name=name, methods=methods,
                              exempt_when=exempt_when, count_when=count_when,
                              concurrency=concurrency)
    bind = limit_decorator(written, SHARED_LOGS)

    def decorate(view: F) -> F:
        bind(view)
        setattr(view, _WRITTEN, (*getattr(view, _WRITTEN, ()), written))
        return view

    return decorate


def exempt(view: F) -> F:
    """Exempt one view from the default limits (path rules still apply)."""
    return _exempt(view)


class _Named:
    """What a limit on ``Class.method`` is named after (`RouteLimit.bound_to` reads these)."""

    def __init__(self, cls: type, method: str) -> None:
        self.__module__ = cls.__module__
        self.__qualname__ = f"{cls.__qualname__}.{method}"


def _handler(cls: type, method: str) -> str | None:
    """The name of the class's handler for `method` (HEAD falls back to ``get``, as in
    Django's View); None: Django answers 405."""
    verb = method.lower()
    if verb not in getattr(cls, "http_method_names", ()):
        return None
    if hasattr(cls, verb):
        return verb
    return "get" if verb == "head" and hasattr(cls, "get") else None


def handles(view: Any, method: str) -> bool:
    """Whether `view` is a class-based view with a handler for `method`: what makes its
    `view_limits` for that method differ from an unhandled method's."""
    cls = getattr(view, "view_class", None)
    return isinstance(cls, type) and _handler(cls, method) is not None


def view_limits(view: Any, method: str) -> object:
    """What a resolved view carries: its limits, EXEMPT or None. A class-based view's are on
    the class, on ``dispatch``, on the method's handler (``get``, ``post``) or on the
    function ``as_view()`` made; a method the class has no handler for is answered 405 by
    Django, as a router would: the view's limits do not apply to it (the default and rules
    do)."""
    cls = getattr(view, "view_class", None)
    if not isinstance(cls, type):
        return route_limits(view)
    handler = _handler(cls, method)
    if handler is None:
        return None
    # as_view() copies what decorators set on dispatch onto the view function: those are
    # read from dispatch, where the class and method name them; the rest was put on the
    # function itself (limit(...)(View.as_view()) in urls.py).
    dispatched = route_limits(getattr(cls, "dispatch", None))
    own = route_limits(view)
    if isinstance(own, tuple) and isinstance(dispatched, tuple):
        own = tuple(item for item in own if item not in dispatched) or None
    elif own == dispatched:
        own = None
    # Every place's limits add up, as stacked decorators do elsewhere: the class's, those on
    # dispatch and on the method's handler (named after the class and method), and those on
    # the function as_view() made. @exempt on the handler exempts that method; anywhere
    # else it only drops the default where no limit is written.
    if route_limits(getattr(cls, handler, None)) == EXEMPT:
        return EXEMPT
    parts = [route_limits(cls), own]
    for attribute in ("dispatch", handler):
        written = getattr(getattr(cls, attribute, None), _WRITTEN, None)
        parts.append(tuple(item.bound_to(_Named(cls, attribute)) for item in written)
                     if written else route_limits(getattr(cls, attribute, None)))
    limits = tuple(item for part in parts if isinstance(part, tuple) for item in part)
    if limits:
        return limits
    return EXEMPT if EXEMPT in parts else None
