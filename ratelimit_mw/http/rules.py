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
from typing import Any, cast

from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.core.policy import Policy
from ratelimit_mw.keys import KeyFunc
from ratelimit_mw.routing import (
    Cost,
    DynamicLimit,
    in_flight_policy,
    named_in_flight,
    validate_cost,
    validate_count_when,
    validate_key,
    validate_methods,
    validate_predicate,
)


def compile_pattern(pattern: str | re.Pattern[str]) -> re.Pattern[str]:
    """The regex of a rule's path, for ``.match(path)``: a compiled ``re.Pattern`` as it is;
    a string means its plain regex (``*`` -> ``(?s:.*)``, ``{name}`` -> ``[^/]+``, the rest
    literal, to the path's end), which backtracks polynomially on hostile paths, so the one
    returned gives the same answers in O(len(path) * len(pattern)) (see `_Writer`)."""
    if isinstance(pattern, re.Pattern):
        return pattern
    if not isinstance(pattern, str) or not pattern.startswith("/"):
        raise ConfigurationError(
            f"a rule's path must start with '/', got {pattern!r}; e.g. Rule(\"/api/*\", "
            '"100/minute"), Rule("/users/{id}", "10/minute") or a compiled re.Pattern'
        )
    return re.compile(_Writer().pattern(pattern))


_PARTS = re.compile(r"(\*|\{[^{}/]+\})")
# A string pattern is read as pieces (split at '*'), a piece as components (split at '/'), a
# component as items: a literal without '/', or the number n of adjacent '{name}'s, which
# match n or more characters other than '/'.
_Component = list[str | int]


def _pieces(pattern: str) -> list[list[_Component]]:
    pieces: list[list[_Component]] = [[[]]]
    for index, part in enumerate(_PARTS.split(pattern)):
        if part == "*":
            pieces.append([[]])
        elif index % 2:  # a {name}
            items = pieces[-1][-1]
            if items and isinstance(items[-1], int):
                items[-1] += 1
            else:
                items.append(1)
        else:
            for position, text in enumerate(part.split("/")):
                if position:
                    pieces[-1].append([])
                items = pieces[-1][-1]
                if text and items and isinstance(items[-1], str):
                    items[-1] += text
                elif text:
                    items.append(text)
    return pieces


def _run(count: int) -> str:
    """Exactly `count` characters of one segment."""
    return f"[^/]{{{count}}}" if count else ""


class _Writer:
    """Writes a string pattern as a regex that never tries one thing twice.

    The plain translation backtracks polynomially: with several ``*``, every way of splitting
    the path between them is tried. Here the pieces between ``*`` are taken one after the
    other, each where it ENDS EARLIEST, and kept (an atomic group): the ``*`` that follows
    absorbs whatever a later end would have skipped, so an earliest end never loses a match.
    The first piece is anchored at the start, the last at the end. A piece's earliest end:

    - within a segment, after a ``{name}`` (``[^/]{n,}``) the next literal is taken at its
      leftmost place, atomically (it ends first and leaves the most room to what follows);
    - a piece with no '/' is tried where the previous piece ended and then only right after
      each '/', with ``[^/]*`` in front: one try covers every start in that segment;
    - a piece with '/' has its '/' on '/' of the path, so every start in a segment gives the
      same alignment: again one try per segment, its inner components filling their
      segments exactly.

    Each try reads at most one segment per component: O(len(path) * len(piece)) per piece.
    """

    def __init__(self) -> None:
        self.groups = 0

    def atomic(self, regex: str) -> str:
        # (?>regex), which Python 3.10 lacks: a lookahead is never re-entered by backtracking.
        self.groups += 1
        name = f"_{self.groups}"
        return f"(?=(?P<{name}>{regex}))(?P={name})"

    def shortest(self, items: _Component) -> str:
        """`items` from here to their earliest end within the segment."""
        out: list[str] = []
        wild: int | None = None  # a pending [^/]{wild,}
        for item in items:
            if isinstance(item, int):
                wild = item
            elif wild is None:
                out.append(re.escape(item))
            else:  # the leftmost `item` `wild` or more characters on
                out.append(self.atomic(f"{_run(wild)}[^/]*?{re.escape(item)}"))
                wild = None
        return "".join(out) + _run(wild or 0)

    def whole(self, items: _Component) -> str:
        """`items` from here to the end of the segment (a '/' or the path's end follows)."""
        if not items:
            return ""
        last = items[-1]
        if isinstance(last, int):
            return self.shortest(items[:-1]) + self.atomic(f"[^/]{{{last},}}")
        if len(items) == 1:
            return re.escape(last)
        wild = cast(int, items[-2])  # items alternate literals and wildcard counts
        # The rest of the segment, `wild` + len(last) characters or more, ending in `last`.
        return (self.shortest(items[:-2]) + self.atomic(f"{_run(wild + len(last))}[^/]*")
                + f"(?<={re.escape(last)})")

    def piece(self, components: list[_Component], *, first: bool, last: bool) -> str:
        out = []
        for position, items in enumerate(components):
            if position == 0 and not first and not (items and isinstance(items[0], int)):
                items = [0, *items]  # after '*': anywhere in the segment, [^/]*
            final = position == len(components) - 1
            out.append(self.shortest(items) if final and not last else self.whole(items))
        return "/".join(out)

    def pattern(self, pattern: str) -> str:
        pieces = _pieces(pattern)
        if len(pieces) == 1:
            return self.piece(pieces[0], first=True, last=True) + r"\Z"
        out = [self.piece(pieces[0], first=True, last=False)]
        for index, components in enumerate(pieces[1:], 1):
            last = index == len(pieces) - 1
            literal = _literal(components)
            if literal == "":
                continue  # '**', or the path's end after a final '*'
            if literal is not None and last:
                out.append(f"(?s:.*){re.escape(literal)}\\Z")
            elif literal is not None:
                out.append(self.atomic(f"(?s:.*?){re.escape(literal)}"))
            else:
                # Tried where the previous piece ended, then right after each '/'.
                tried = "(?:|(?s:.*?)(?<=/))" + self.piece(components, first=False, last=last)
                out.append(tried + r"\Z" if last else self.atomic(tried))
        return "".join(out)


def _literal(components: list[_Component]) -> str | None:
    """The text of a piece with no {name}; None if it has one."""
    if any(isinstance(item, int) for items in components for item in items):
        return None
    return "/".join("".join(map(str, items)) for items in components)


class Rule:
    """A path rule: every request whose path matches (and method, if given) gets `policy`,
    decorated route or not. Paths: exact (``"/login"``), ``*`` for anything (``"/api/*"``),
    ``{name}`` for one segment (``"/users/{id}"``), or a compiled ``re.Pattern`` (matched
    from the start). ``name`` names the counters (rules with one name share them) and the
    ``RateLimit`` header items. ``count_when(status)``: False gives this rule's hit back.
    ``concurrency=N`` (or a `Policy.in_flight`): at most N of a key's requests in flight at
    once, beside the rate or alone (``Rule("/export", concurrency=4)``)."""

    __slots__ = ("cost", "count_when", "dynamic", "exempt_when", "in_flight", "key", "label",
                 "methods", "pattern", "policy", "regex")

    def __init__(
        self,
        path: str | re.Pattern[str],
        policy: Policy | str | Callable[[Any], str | None] | None = None,
        *,
        methods: Iterable[str] | None = None,
        key: KeyFunc | None = None,
        cost: Cost = 1,
        name: str | None = None,
        exempt_when: Callable[[Any], bool] | None = None,
        count_when: Callable[[int], bool] | None = None,
        concurrency: Policy | int | None = None,
    ) -> None:
        self.pattern = path
        self.regex = compile_pattern(path)
        self.methods: frozenset[str] | None = validate_methods(methods)
        shown = path if isinstance(path, str) else path.pattern
        verbs = "" if methods is None else ",".join(sorted(self.methods or ())) + " "
        # What a person reads in RateLimit headers: "POST /login".
        self.label = name or f"{verbs}{shown}"
        self.dynamic: DynamicLimit | None = None
        self.policy: Policy | None = None
        in_flight = in_flight_policy(concurrency)
        self.in_flight = None if in_flight is None else named_in_flight(
            in_flight, f"rule {verbs}{shown}", name)
        if isinstance(policy, Policy) and policy.algorithm == "concurrency":
            raise ConfigurationError(
                f"an in-flight limit goes in concurrency=, got it as the rate: {policy!r}; "
                f"write Rule({shown!r}, concurrency={policy!r})")
        if policy is None and in_flight is not None:
            pass  # slots alone
        elif isinstance(policy, Policy):
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
                f"(request) -> rate text, and/or concurrency=N, got {policy!r}; e.g. "
                f'Rule({shown!r}, "5/minute") or Rule({shown!r}, concurrency=4)'
            )
        self.key = validate_key(key)
        self.exempt_when = validate_predicate("exempt_when", exempt_when)
        self.count_when = validate_count_when(count_when)
        self.cost = validate_cost(cost, self.policy)

    def matches(self, method: str, path: str) -> bool:
        return ((self.methods is None or method in self.methods)
                and self.regex.match(path) is not None)

    def __repr__(self) -> str:
        slots = "" if self.in_flight is None else f", concurrency={self.in_flight!r}"
        return f"Rule({self.pattern!r}, {self.policy!r}, methods={self.methods!r}{slots})"


def as_rules(rules: Sequence[Rule] | Mapping[str, Policy | str] | None) -> tuple[Rule, ...]:
    if rules is None:
        return ()
    if isinstance(rules, Mapping):
        return tuple(Rule(path, policy) for path, policy in rules.items())
    if isinstance(rules, (str, Rule)):
        rules = [rules]
    if not isinstance(rules, Iterable):
        raise ConfigurationError(
            f"rules takes a list of rules or a mapping of paths to rates, got {rules!r}; write "
            'rules=[Rule("/login", "5/minute")] or rules={"/api/*": "100/minute"}'
        )
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
