"""The command line's grammar, and the POLICY argument turned into a Policy: rate text
(shaped by ``--algorithm``, ``--name`` and ``--tz`` as ``Policy(...)`` would be) or
``module:attribute`` naming the app's own Policy, so that the CLI sees the same keys."""

from __future__ import annotations

import argparse
import importlib
import operator
import os
import re
import sys
from typing import cast

from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.core.policy import ALGORITHMS, DEFAULT_ALGORITHM, Algorithm, Policy

DEFAULT_URL = "redis://127.0.0.1:6379/0"
URL_VARIABLE = "RATELIMIT_REDIS_URL"
DEFAULT_LIST_LIMIT = 100
_REFERENCE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def _common(defaults: bool) -> argparse.ArgumentParser:
    """Options accepted before and after the command. After it they default to SUPPRESS, so a
    value given before the command is not overwritten by the command's default."""
    common = argparse.ArgumentParser(add_help=False)
    url = os.environ.get(URL_VARIABLE) or DEFAULT_URL
    for flag, value, options in (
        ("--url", url, {"help": "the store: redis://, rediss://, unix://, redis+cluster://, "
                        "redis+sentinel:// or their valkey:// twins (default: "
                        f"${URL_VARIABLE}, else {DEFAULT_URL})"}),
        ("--prefix", "rl", {"help": "the key prefix the limiter was built with (default: rl)"}),
        ("--timeout", 2.0, {"type": float,
                            "help": "socket and connect timeout in seconds (default: 2)"}),
        ("--json", False, {"action": "store_true", "help": "print one JSON object (for scripts)"}),
    ):
        common.add_argument(flag, default=value if defaults else argparse.SUPPRESS, **options)
    return common


def _policy_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--algorithm", choices=sorted(ALGORITHMS),
                        help=f"with rate text: the algorithm (default: {DEFAULT_ALGORITHM})")
    parser.add_argument("--name", help="with rate text: the policy's name (default: the text)")
    parser.add_argument("--tz", help="with rate text: fixed-window days align to this zone")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ratelimit-mw",
        description="Look at and lift rate limits kept in Redis by ratelimit_mw.",
        parents=[_common(defaults=True)],
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub = _common(defaults=False)
    for command, about in (("inspect", "each tier's state for one identity, recording nothing"),
                           ("reset", "forget one identity's counters and any ban")):
        parsed = commands.add_parser(command, parents=[sub], help=about)
        parsed.add_argument("policy", metavar="POLICY",
                            help='rate text such as "5/minute;100/day", or module:attribute '
                                 "naming a Policy (the current directory is importable)")
        _policy_options(parsed)
        parsed.add_argument("identity", metavar="IDENTITY", help='as the key function returns '
                            'it, e.g. "ip:203.0.113.7" or "user:42"')
    listing = commands.add_parser(
        "list", parents=[sub], help="identities that hold state now (SCAN, bounded)")
    listing.add_argument("--policy", help="only this policy (rate text or module:attribute)")
    _policy_options(listing)
    listing.add_argument("--limit", type=int, default=DEFAULT_LIST_LIMIT,
                         help=f"at most this many identities (default: {DEFAULT_LIST_LIMIT})")
    commands.add_parser("ping", parents=[sub],
                        help="connect, load the script, report the version and a round trip")
    return parser


def resolve_policy(text: str, algorithm: str | None, name: str | None,
                   tz: str | None) -> Policy:
    """The Policy POLICY names; ConfigurationError (saying what to write) when it cannot."""
    if _REFERENCE.fullmatch(text):
        if algorithm is not None or name is not None or tz is not None:
            raise ConfigurationError(
                f"--algorithm, --name and --tz shape rate text; {text!r} names a Policy that "
                f"carries its own. Drop them, or give the rates: "
                f'inspect "5/minute" IDENTITY --algorithm gcra --name login'
            )
        return _import_policy(text)
    # argparse's choices= already limited the text to the four names; Policy checks again.
    return Policy(text, algorithm=cast("Algorithm", algorithm or DEFAULT_ALGORITHM), name=name,
                  tz=tz)


def _import_policy(reference: str) -> Policy:
    module_name, attribute = reference.split(":", 1)
    # The user's code is where the command runs, as with `python -m` or uvicorn's app path.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        found: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(
            f"cannot import {module_name!r} for POLICY {reference!r} ({exc}); run from the "
            f"directory that holds it, or give rate text such as \"5/minute\" instead"
        ) from exc
    try:
        found = operator.attrgetter(attribute)(found)
    except AttributeError:
        raise ConfigurationError(
            f"{module_name!r} has no {attribute!r} (POLICY {reference!r}); name a Policy "
            f"defined there, e.g. {module_name}:LOGIN for LOGIN = Policy(\"5/minute\")"
        ) from None
    if not isinstance(found, Policy):
        raise ConfigurationError(
            f"POLICY {reference!r} is a {type(found).__name__}, not a Policy; point it at "
            f'a Policy, e.g. LOGIN = Policy("5/minute", name="login")'
        )
    return found


def positive_limit(limit: int) -> int:
    if limit < 1:
        raise ConfigurationError(f"--limit must be at least 1, got {limit}; e.g. --limit 100")
    return limit
