"""Path rules: ``Rule("/login", "5/minute", methods=["POST"])`` and how a request matches one.

A rule applies to every request whose path matches its pattern and whose method is one of its
methods (any method when none are given), decorated route or not. ``HEAD`` matches a rule
written for ``GET``: every framework this package adapts serves HEAD with the GET handler, so
a HEAD must spend the GET quota rather than run the endpoint for free.

Counters: a rule's policy is named after its path, methods and rates, so two rules share a
counter only when all three are equal or the user gives them one ``name``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.core.policy import Policy
from ratelimit_mw.http.routing import Cost, DynamicLimit, validate_cost, validate_key
from ratelimit_mw.keys import KeyFunc


def compile_pattern(pattern: str | re.Pattern[str]) -> re.Pattern[str]:
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


def _methods(methods: Iterable[str] | None) -> frozenset[str] | None:
    if methods is None:
        return None
    if isinstance(methods, str):
        raise ConfigurationError(
            f'methods takes a list, e.g. methods=["POST"], not the string {methods!r}'
        )
    out = frozenset(str(m).upper() for m in methods)
    if not out:
        raise ConfigurationError('methods must name at least one method, e.g. methods=["GET"]')
    # HEAD is served by the GET handler: a GET rule covers it.
    return out | {"HEAD"} if "GET" in out else out


class Rule:
    """A path rule: every request whose path matches (and method, if given) gets `policy`.

    Paths: exact (``"/login"``), ``*`` for anything (``"/api/*"``), ``{name}`` for one
    segment (``"/users/{id}"``), or a compiled ``re.Pattern`` (matched from the start).
    Rules apply whether or not the route is decorated; they add to its limits. ``name``
    names the counters (rules with one name share them) and the ``RateLimit`` header items.
    """

    __slots__ = ("cost", "dynamic", "exempt_when", "key", "label", "methods", "pattern", "policy",
                 "regex")

    def __init__(
        self,
        path: str | re.Pattern[str],
        policy: Policy | str | Callable[[Any], str | None],
        *,
        methods: Iterable[str] | None = None,
        key: KeyFunc | None = None,
        cost: Cost = 1,
        name: str | None = None,
        exempt_when: Callable[[Any], bool] | None = None,
    ) -> None:
        self.pattern = path
        self.regex = compile_pattern(path)
        self.methods: frozenset[str] | None = _methods(methods)
        shown = path if isinstance(path, str) else path.pattern
        verbs = "" if methods is None else ",".join(sorted(self.methods or ())) + " "
        # What a person reads in RateLimit headers: "POST /login".
        self.label = name or f"{verbs}{shown}"
        self.dynamic: DynamicLimit | None = None
        self.policy: Policy | None = None
        if isinstance(policy, Policy):
            self.policy = policy
        elif isinstance(policy, str):
            rates = Policy(policy).rates  # validates the text before it names anything
            counter = name or f"rule {verbs}{shown} {';'.join(map(str, rates))}"
            self.policy = Policy(policy, name=counter)
        elif callable(policy):
            # A dynamic limit: each rate text it returns counts apart under this base name.
            self.dynamic = DynamicLimit(policy, name or f"rule {verbs}{shown}")
        else:
            raise ConfigurationError(
                f'a rule takes a rate string such as "5/minute", a Policy or a callable '
                f"(request) -> rate text, got {policy!r}"
            )
        self.key = validate_key(key)
        if exempt_when is not None and not callable(exempt_when):
            raise ConfigurationError(
                f"exempt_when must be a callable (request) -> bool, got {exempt_when!r}"
            )
        self.exempt_when = exempt_when
        self.cost = validate_cost(cost, self.policy)

    def matches(self, method: str, path: str) -> bool:
        if self.methods is not None and method not in self.methods:
            return False
        return self.regex.match(path) is not None

    def __repr__(self) -> str:
        return f"Rule({self.pattern!r}, {self.policy!r}, methods={self.methods!r})"


def as_rules(rules: Sequence[Rule] | Mapping[str, Policy | str] | None) -> tuple[Rule, ...]:
    if rules is None:
        return ()
    if isinstance(rules, Mapping):
        return tuple(Rule(path, policy) for path, policy in rules.items())
    if isinstance(rules, (str, Rule)):
        rules = [rules]
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
