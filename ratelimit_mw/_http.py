"""The request-independent half of the middleware, shared by ASGI and WSGI.

Which policies apply to a request (default, path rules, route decorators), the identities and
costs their key functions give, the failure policy with its cool-down, and the headers. The
ASGI and WSGI middleware only adapt this to their protocol; nothing here does I/O.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from ratelimit_mw import keys as _keys
from ratelimit_mw._errors import ConfigurationError
from ratelimit_mw.core import Check
from ratelimit_mw.decision import Decision
from ratelimit_mw.headers import PolicyHeader, rate_limit_headers
from ratelimit_mw.policy import Policy, as_policy
from ratelimit_mw.routing import EXEMPT, Cost, KeyFunc, RouteLimit, validate_cost

logger = logging.getLogger("ratelimit_mw")

ErrorPolicy: TypeAlias = str | Callable[[Any, BaseException], bool]

MODES = ("enforce", "shadow")
_PATH_CACHE_SIZE = 4096


# -- path rules ----------------------------------------------------------------------------
def _compile_pattern(pattern: str | re.Pattern[str]) -> re.Pattern[str]:
    if isinstance(pattern, re.Pattern):
        return pattern
    if not isinstance(pattern, str) or not pattern.startswith("/"):
        raise ConfigurationError(
            f"a rule's path must start with '/', got {pattern!r}; e.g. Rule(\"/api/*\", "
            '"100/minute"), Rule("/users/{id}", "10/minute") or a compiled re.Pattern'
        )
    out = []
    for token in re.split(r"(\*|\{[^{}/]+\})", pattern):
        if token == "*":
            out.append(".*")
        elif token.startswith("{") and token.endswith("}"):
            out.append("[^/]+")
        else:
            out.append(re.escape(token))
    return re.compile("".join(out) + r"\Z")


class Rule:
    """A path rule: every request whose path matches (and method, if given) gets `policy`.

    Paths: exact (``"/login"``), ``*`` for anything (``"/api/*"``), ``{name}`` for one
    segment (``"/users/{id}"``), or a compiled ``re.Pattern`` (matched from the start).
    Rules apply whether or not the route is decorated; they add to its limits.
    """

    __slots__ = ("cost", "key", "methods", "pattern", "policy", "regex")

    def __init__(
        self,
        path: str | re.Pattern[str],
        policy: Policy | str,
        *,
        methods: Iterable[str] | None = None,
        key: KeyFunc | None = None,
        cost: Cost = 1,
    ) -> None:
        self.pattern = path
        self.regex = _compile_pattern(path)
        name = None if isinstance(policy, Policy) else f"rule:{self.regex.pattern}"
        self.policy = as_policy(policy, name=name)
        if methods is not None:
            if isinstance(methods, str):
                raise ConfigurationError(
                    f'methods takes a list, e.g. methods=["POST"], not the string {methods!r}'
                )
            methods = frozenset(m.upper() for m in methods)
        self.methods: frozenset[str] | None = methods
        if key is not None and not callable(key):
            raise ConfigurationError(f"key must be a key function, got {key!r}")
        self.key = key
        self.cost = validate_cost(cost, self.policy)

    def matches(self, method: str, path: str) -> bool:
        if self.methods is not None and method not in self.methods:
            return False
        return self.regex.match(path) is not None

    def __repr__(self) -> str:
        return f"Rule({self.pattern!r}, {self.policy!r}, methods={self.methods!r})"


def _as_rules(rules: Sequence[Rule] | Mapping[str, Policy | str] | None) -> tuple[Rule, ...]:
    if rules is None:
        return ()
    if isinstance(rules, Mapping):
        return tuple(Rule(path, policy) for path, policy in rules.items())
    out = []
    for rule in rules:
        if isinstance(rule, Rule):
            out.append(rule)
        elif isinstance(rule, tuple) and len(rule) == 2:
            out.append(Rule(rule[0], rule[1]))
        else:
            raise ConfigurationError(
                f"cannot read the rule {rule!r}; write Rule(\"/login\", \"5/minute\", "
                'methods=["POST"]) or {"/login": "5/minute"}'
            )
    return tuple(out)


# -- what applies to one request -----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Applied:
    """One policy applied to a request, with the key function and cost that go with it."""

    policy: Policy
    key: KeyFunc
    cost: Cost


class Selection:
    """The policies that apply to a request shape, with their headers rendered once."""

    __slots__ = ("applied", "policy_header")

    def __init__(self, applied: tuple[Applied, ...]) -> None:
        self.applied = applied
        unique: list[Policy] = []
        for item in applied:
            if item.policy not in unique:
                unique.append(item.policy)
        self.policy_header = PolicyHeader(unique)


class Breaker:
    """After a backend failure, skip the backend for `cooldown` seconds.

    An outage then costs a clock read per request instead of a timeout each. Shared by all
    requests on purpose: it describes the backend, not a request.
    """

    __slots__ = ("_clock", "cooldown", "open_until")

    def __init__(self, cooldown: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.cooldown = cooldown
        self.open_until = 0.0
        self._clock = clock

    def is_open(self) -> bool:
        return self.open_until > 0.0 and self._clock() < self.open_until

    def trip(self) -> None:
        self.open_until = self._clock() + self.cooldown

    def reset(self) -> None:
        self.open_until = 0.0


class _ThrottledLog:
    """Log a recurring failure at most once per interval, with how many were suppressed."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self._next = 0.0
        self._suppressed = 0
        self._lock = threading.Lock()

    def __call__(self, message: str, exc: BaseException | None = None) -> None:
        now = time.monotonic()
        with self._lock:
            if now < self._next:
                self._suppressed += 1
                return
            suppressed, self._suppressed = self._suppressed, 0
            self._next = now + self.interval
        extra = f" ({suppressed} more since the last report)" if suppressed else ""
        logger.warning("%s%s: %s", message, extra, exc)


class MiddlewareCore:
    """Validated middleware options and the decisions that need no framework."""

    def __init__(
        self,
        *,
        default: Policy | str | Sequence[Policy | str] | None,
        rules: Sequence[Rule] | Mapping[str, Policy | str] | None,
        key: KeyFunc | None,
        on_backend_error: ErrorPolicy,
        headers: bool,
        legacy_headers: bool,
        mode: str,
        on_refusal: Callable[[Any, Decision], None] | None,
        count_when: Callable[[int], bool] | None,
        backend_cooldown: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if key is None:
            key = _keys.client_ip()
        elif not callable(key):
            raise ConfigurationError(
                f"key must be a key function, got {key!r}; e.g. key=keys.client_ip()"
            )
        self.key: KeyFunc = key
        if default is None:
            defaults: tuple[Policy, ...] = ()
        elif isinstance(default, (Policy, str)):
            defaults = (as_policy(default, name=None),)
        else:
            defaults = tuple(as_policy(p) for p in default)
        self.defaults = tuple(Applied(p, key, 1) for p in defaults)
        self.rules = _as_rules(rules)
        if not (on_backend_error in ("allow", "deny") or callable(on_backend_error)):
            raise ConfigurationError(
                f'on_backend_error must be "allow", "deny" or a callable (request, error) -> '
                f"bool, got {on_backend_error!r}"
            )
        self.on_backend_error = on_backend_error
        if mode not in MODES:
            raise ConfigurationError(f'mode must be "enforce" or "shadow", got {mode!r}')
        self.shadow = mode == "shadow"
        self.headers = bool(headers)
        self.legacy_headers = bool(legacy_headers)
        if on_refusal is not None and not callable(on_refusal):
            raise ConfigurationError(f"on_refusal must be a callable, got {on_refusal!r}")
        self.on_refusal = on_refusal
        if count_when is not None and not callable(count_when):
            raise ConfigurationError(
                f"count_when must be a callable (status) -> bool, e.g. "
                f"count_when=lambda status: status >= 400; got {count_when!r}"
            )
        self.count_when = count_when
        if isinstance(backend_cooldown, bool) or not isinstance(backend_cooldown, (int, float)) \
                or backend_cooldown < 0:
            raise ConfigurationError(
                f"backend_cooldown must be >= 0 seconds, got {backend_cooldown!r}"
            )
        self.breaker = Breaker(float(backend_cooldown), clock)
        self.log_failure = _ThrottledLog()
        self._rule_cache: dict[tuple[str, str], tuple[Rule, ...]] = {}
        self._selection_cache: dict[tuple[int, ...], Selection | None] = {}
        if not self.defaults and not self.rules:
            logger.info("ratelimit_mw middleware has no default and no rules: only decorated "
                        "routes are limited")

    # -- selection ---------------------------------------------------------------------------
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
        """The policies for one request; `route` is what the endpoint carries (or None).

        A decorated route replaces the defaults with its own limits, an exempt route drops
        them, an unresolved or undecorated route gets the defaults; rules always add.
        """
        rules = self._matching_rules(method, path)
        cache_key = (id(route), *map(id, rules))
        try:
            return self._selection_cache[cache_key]
        except KeyError:
            pass
        applied: list[Applied] = []
        if route is None:
            applied += self.defaults
        elif route != EXEMPT:
            for limit in route:  # type: ignore[attr-defined]
                limit_: RouteLimit = limit
                policy = limit_.policy
                if policy is None:  # pragma: no cover - bound at decoration
                    continue
                applied.append(Applied(policy, limit_.key or self.key, limit_.cost))
        applied += (Applied(rule.policy, rule.key or self.key, rule.cost) for rule in rules)
        selection = Selection(tuple(applied)) if applied else None
        # The key holds ids of objects that live as long as the app (routes, rules).
        self._selection_cache[cache_key] = selection
        return selection

    # -- identities --------------------------------------------------------------------------
    def checks(self, selection: Selection, request: Any) -> list[Check]:
        """Run the key functions; a policy whose key says None does not apply."""
        out = []
        for item in selection.applied:
            try:
                identity = item.key(request)
            except Exception as exc:  # a key function's bug must not become a 500
                self.log_failure("ratelimit_mw key function raised; using the client IP", exc)
                identity = _fallback_identity(request)
            if identity is None:
                continue
            if not isinstance(identity, str):
                # A key function must return a string; anything else would fail in the limiter
                # and trip the breaker, leaving every client unlimited for the cool-down.
                self.log_failure(
                    "ratelimit_mw key function returned a non-string; using the client IP",
                    TypeError(f"{item.key!r} returned {identity!r}"),
                )
                identity = _fallback_identity(request)
            cost = item.cost
            if not isinstance(cost, int):
                try:
                    cost = int(cost(request))
                except Exception as exc:
                    self.log_failure("ratelimit_mw cost function raised; counting 1", exc)
                    cost = 1
                cost = max(1, cost)
            out.append(Check(item.policy, identity, cost))
        return out

    # -- failures ----------------------------------------------------------------------------
    def admit_on_error(self, request: Any, exc: BaseException) -> bool:
        """The failure policy: True admits the request, False answers 503."""
        policy = self.on_backend_error
        if policy == "allow":
            return True
        if policy == "deny":
            return False
        try:
            return bool(policy(request, exc))  # type: ignore[operator]
        except Exception as hook_exc:
            self.log_failure("ratelimit_mw on_backend_error callable raised; admitting", hook_exc)
            return True

    def notify_refusal(self, request: Any, decision: Decision) -> None:
        if self.on_refusal is None:
            return
        try:
            self.on_refusal(request, decision)
        except Exception as exc:
            self.log_failure("ratelimit_mw on_refusal hook raised", exc)

    def should_refund(self, status: int) -> bool:
        """With count_when, a response that should not count gives its hit back."""
        if self.count_when is None:
            return False
        try:
            return not self.count_when(status)
        except Exception as exc:
            self.log_failure("ratelimit_mw count_when raised; keeping the hit", exc)
            return False

    def response_headers(self, decision: Decision, selection: Selection) -> list[tuple[str, str]]:
        return rate_limit_headers(decision, selection.policy_header, self.legacy_headers)

    def cooldown_seconds(self) -> int:
        return max(1, int(self.breaker.cooldown + 0.999))


def validate_on_blocked(on_blocked: Any, example: str) -> Any:
    """`on_blocked` is None or a callable (request, decision) -> response; checked at start-up."""
    if on_blocked is not None and not callable(on_blocked):
        raise ConfigurationError(
            f"on_blocked must be a callable (request, decision) -> response, got "
            f"{on_blocked!r}; e.g. on_blocked={example}"
        )
    return on_blocked


_FALLBACK_KEY = _keys.client_ip()


def _fallback_identity(request: Any) -> str:
    try:
        return _FALLBACK_KEY(request) or "ip:unknown"
    except Exception:
        return "ip:unknown"
