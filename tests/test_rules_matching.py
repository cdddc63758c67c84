"""How a rule's path matches a request path, and what a rule accepts.

A string pattern means its plain regex (`plain_regex`): ``*`` is any characters ('/' and
newlines included, or none), ``{name}`` is one non-empty segment ``[^/]+``, everything else is
literal, and the whole path must match. `compile_pattern` writes a different regex with the same
answers that the engine runs in linear time; the differential tests below hold it to the plain
one. Timing is measured in benchmarks/, not here: the hostile-path tests pin down the answers
(with the plain regex each would run for minutes).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.http.config import Config
from ratelimit_mw.http.rules import Rule, compile_pattern


def plain_regex(pattern: str) -> re.Pattern[str]:
    """The definition of a string pattern, as the regex it was matched with before."""
    out = []
    for index, part in enumerate(re.split(r"(\*|\{[^{}/]+\})", pattern)):
        if part == "*":
            out.append("(?s:.*)")
        elif index % 2:
            out.append("[^/]+")
        else:
            out.append(re.escape(part))
    return re.compile("".join(out) + r"\Z")


def matches(pattern: str, path: str) -> bool:
    return Rule(pattern, "1/minute").matches("GET", path)


PATTERN_PARTS = st.sampled_from(["/", "a", "b", "ab", "*", "{x}"])
patterns = st.lists(PATTERN_PARTS, max_size=8).map(lambda parts: "/" + "".join(parts))
paths = st.text(alphabet="/ab", max_size=14).map(lambda text: "/" + text)


@st.composite
def pattern_and_path_built_from_it(draw: st.DrawFn) -> tuple[str, str]:
    """A path made by filling in the pattern, then perhaps edited: mostly matches, or nearly."""
    pattern = draw(patterns)
    path = ""
    for index, part in enumerate(re.split(r"(\*|\{[^{}/]+\})", pattern)):
        if part == "*":
            path += draw(st.text(alphabet="/ab", max_size=5))
        elif index % 2:
            path += draw(st.text(alphabet="ab", min_size=1, max_size=4))
        else:
            path += part
    if draw(st.booleans()):
        spot = draw(st.integers(0, len(path)))
        edit = draw(st.sampled_from(["", "/", "a", "b"]))
        path = path[:spot] + edit + path[spot + draw(st.integers(0, 1)):]
    return pattern, path


@settings(max_examples=1500)
@given(patterns, paths)
def test_a_pattern_matches_a_random_path_exactly_when_its_plain_regex_does(
    pattern: str, path: str
) -> None:
    assert matches(pattern, path) is (plain_regex(pattern).match(path) is not None)


@settings(max_examples=1500)
@given(pattern_and_path_built_from_it())
def test_a_pattern_matches_a_path_built_from_it_exactly_when_its_plain_regex_does(
    case: tuple[str, str],
) -> None:
    pattern, path = case
    assert matches(pattern, path) is (plain_regex(pattern).match(path) is not None)


@pytest.mark.parametrize(
    ("pattern", "path", "expected"),
    [
        ("/login", "/login", True),
        ("/login", "/login/", False),
        ("/login", "/log", False),
        ("/api/*", "/api/", True),
        ("/api/*", "/api/v1/users", True),
        ("/api/*", "/apix", False),
        ("/api/*/comments", "/api/comments", False),
        ("/api/*/comments", "/api//comments", True),
        ("/api/*/comments", "/api/v1/posts/7/comments", True),
        ("/users/{id}", "/users/42", True),
        ("/users/{id}", "/users/", False),
        ("/users/{id}", "/users/42/posts", False),
        ("/users/{id}/posts/*", "/users/42/posts/7", True),
        ("/files/{name}.{ext}", "/files/report.final.pdf", True),
        ("/files/{name}.{ext}", "/files/report.", False),
        ("/v1.0/*", "/v1x0/items", False),
        ("/a+b/(x)", "/a+b/(x)", True),
    ],
)
def test_rule_paths_follow_the_documented_syntax(pattern: str, path: str, expected: bool) -> None:
    assert matches(pattern, path) is expected


def test_a_star_also_matches_a_newline_so_an_encoded_one_cannot_sidestep_a_rule() -> None:
    # ASGI paths are percent-decoded: /api/a%0Ab arrives as "/api/a\nb".
    assert matches("/api/*", "/api/a\nb")
    assert matches("/api/*/edit", "/api/\n/edit")
    assert matches("/users/{id}", "/users/4\n2")


def test_a_compiled_regex_is_used_as_given() -> None:
    regex = re.compile(r"/api/v\d+")
    assert compile_pattern(regex) is regex
    assert Rule(regex, "1/minute").matches("GET", "/api/v2/users")  # matched from the start


@pytest.mark.parametrize(
    ("pattern", "path", "expected"),
    [
        ("/files/*/*/*/raw", "/files/" + "/" * 20_000, False),
        ("/files/*/*/*/raw", "/files/" + "/" * 20_000 + "raw", True),
        ("/api/*/*/comments", "/api/" + "/" * 20_000, False),
        ("/*/*/*/*/x", "/" * 20_000, False),
        ("/*/*/*/*/x", "/" * 20_000 + "x", True),
        ("/api/*{id}", "/api/" + "a" * 20_000 + "/", False),
        ("/files/{name}.{ext}", "/files/" + "." * 20_000 + "/", False),
        ("/f/{a}-{b}-{c}", "/f/" + "-" * 20_000 + "/", False),
        ("/f/{a}-{b}-{c}", "/f/" + "-" * 20_000, True),
    ],
    ids=lambda value: value if isinstance(value, str) and len(value) < 30 else None,
)
def test_a_long_hostile_path_is_answered_correctly(
    pattern: str, path: str, expected: bool
) -> None:
    assert matches(pattern, path) is expected


@pytest.mark.parametrize(
    ("make", "mentions"),
    [
        (lambda: Config(rules=5), r'rules=\[Rule\("/login", "5/minute"\)\]'),
        (lambda: Config(rules=1.5), "rules takes a list of rules or a mapping"),
        (lambda: Rule("/x", "1/minute", methods=[""]), r"got ''; e\.g\. methods="),
        (lambda: Rule("/x", "1/minute", methods=["GET POST"]), "got 'GET POST'"),
        (lambda: Rule("/x", "1/minute", methods=["GET\r\n"]), "HTTP method names"),
        (lambda: Rule("/x", "1/minute", methods=[b"GET"]), "got b'GET'"),
        (lambda: Rule("/x", "1/minute", methods=[None]), "got None"),
        (lambda: Rule("/x", "1/minute", methods=[]), "at least one method"),
        (lambda: Rule("/x", "1/minute", methods="GET"), "not the string"),
        (lambda: Rule("x", "1/minute"), "must start with '/'"),
    ],
    ids=["rules=5", "rules=1.5", "empty method", "two methods in one", "method with CRLF",
         "bytes method", "None method", "no methods", "methods as a string", "relative path"],
)
def test_rule_mistakes_are_reported_with_what_to_write(make: Any, mentions: str) -> None:
    with pytest.raises(ConfigurationError, match=mentions):
        make()


def test_methods_are_case_insensitive_tokens_and_may_be_any_iterable() -> None:
    rule = Rule("/cache", "1/minute", methods=(name for name in ["purge", "M-SEARCH"]))
    assert rule.methods == frozenset({"PURGE", "M-SEARCH"})
    assert rule.matches("PURGE", "/cache")
