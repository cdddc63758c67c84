"""``ratelimit-mw`` (also ``python -m ratelimit_mw``): look at and lift limits from a shell.

    ratelimit-mw inspect "5/minute;100/day" user:42 [--json]
    ratelimit-mw reset myapp.limits:LOGIN ip:203.0.113.7
    ratelimit-mw list [--policy P] [--limit N]
    ratelimit-mw ping

Exit codes: 0 done, 1 the store could not be reached, 2 bad input (the message says what to
write instead).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from ratelimit_mw.backends.urls import redact
from ratelimit_mw.cli import report
from ratelimit_mw.cli.args import build_parser, positive_limit, resolve_policy
from ratelimit_mw.cli.store import Store
from ratelimit_mw.core import codec, wire
from ratelimit_mw.core.errors import BackendError, ConfigurationError
from ratelimit_mw.core.identity import identity_head
from ratelimit_mw.core.policy import Policy
from ratelimit_mw.limiter import Limiter

Output = tuple[dict[str, Any], str]  # the --json object, and the text printed otherwise

EXIT_OK, EXIT_STORE_DOWN, EXIT_BAD_INPUT = 0, 1, 2

__all__ = ["EXIT_BAD_INPUT", "EXIT_OK", "EXIT_STORE_DOWN", "main"]


def _target(args: argparse.Namespace, operation: Any) -> tuple[Policy, str, str, list[str]]:
    """POLICY, IDENTITY, the ban key and the keys `operation` touches, ban included."""
    policy = resolve_policy(args.policy, args.algorithm, args.name, args.tz)
    if not args.identity:
        raise ConfigurationError('IDENTITY must not be empty; e.g. "user:42"')
    # The ban is read and cleared even when POLICY carries no penalty: the app's policy may,
    # and a ban left in place would go on refusing after a reset.
    ban = f"{identity_head(args.prefix, args.identity)}{wire.wire(policy).segment}:ban"
    call = codec.build(operation, (codec.Check(policy, args.identity),), args.prefix)
    return policy, args.identity, ban, list(dict.fromkeys([*call.keys, ban]))


def _inspect(store: Store, limiter: Limiter, args: argparse.Namespace) -> Output:
    policy, identity, ban, keys = _target(args, codec.PEEK)
    # Nothing stored: a fresh quota, or a name that is not the one the app counts under
    # (a decorator's is "route <module>.<function> <rates>"): say which names are there.
    stored = bool(store.existing(keys))
    others: list[str] = []
    if not stored:
        head = f"{identity_head(args.prefix, identity)}*"
        found = report.list_report(args.prefix, store.scan(head), 1, None)["identities"]
        others = found[0]["policies"] if found else []
    decision = limiter.peek(policy, identity)
    raw = store.get(ban)
    ban_end = int(raw) if raw is not None and raw.isdigit() else None
    data = report.inspect_report(policy, identity, decision, ban_end, store.time_ms())
    data["stored"] = stored
    data["stored_under_other_names"] = others
    return data, report.render_inspect(data)


def _reset(store: Store, limiter: Limiter, args: argparse.Namespace) -> Output:
    policy, identity, ban, keys = _target(args, codec.RESET)
    removed = store.existing(keys)
    limiter.reset(policy, identity)
    store.delete([ban])  # gone already when the reset cleared it
    data = report.reset_report(policy, identity, removed)
    return data, report.render_reset(data)


def _list(store: Store, limiter: Limiter, args: argparse.Namespace) -> Output:
    limit = positive_limit(args.limit)
    policy = None
    if args.policy is not None:
        policy = resolve_policy(args.policy, args.algorithm, args.name, args.tz)
    elif args.algorithm is not None or args.name is not None or args.tz is not None:
        raise ConfigurationError(
            "--algorithm, --name and --tz shape --policy; give it too, e.g. "
            'list --policy "5/minute" --algorithm gcra'
        )
    data = report.list_report(args.prefix, store.scan(report.scan_pattern(args.prefix, policy)),
                              limit, policy)
    return data, report.render_list(data)


def _ping(store: Store, limiter: Limiter, args: argparse.Namespace) -> Output:
    data = store.backend.ping()
    return data, report.render_ping(redact(store.url), data)


_COMMANDS = {"inspect": _inspect, "reset": _reset, "list": _list, "ping": _ping}


def _run(args: argparse.Namespace) -> Output:
    store = Store(args.url, args.timeout)
    try:
        # No deny cache: every answer comes from the store, as it stands now.
        return _COMMANDS[args.command](store, Limiter(store.backend, prefix=args.prefix,
                                                      deny_cache=0), args)
    finally:
        store.close()


def main(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None,
         stderr: TextIO | None = None) -> int:
    """Run one command; returns the exit code (the console script exits with it)."""
    err = stderr or sys.stderr
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # argparse has printed its usage message already
        return exit_.code if isinstance(exit_.code, int) else EXIT_BAD_INPUT
    try:
        data, text = _run(args)
    except ConfigurationError as exc:
        print(f"ratelimit-mw: error: {exc}", file=err)
        return EXIT_BAD_INPUT
    except BackendError as exc:
        # The underlying error says why in one line (the BackendError may carry a long repr).
        cause = exc.__cause__
        reason = f"{type(cause).__name__}: {cause}" if cause is not None else str(exc)
        print(f"ratelimit-mw: cannot reach the store at {redact(args.url)}: {reason}", file=err)
        return EXIT_STORE_DOWN
    print(json.dumps(data, indent=2) if args.json else text, file=stdout or sys.stdout)
    return EXIT_OK
