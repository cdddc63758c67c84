"""Generate the sync twins of the async sources.

    python scripts/unasync.py            # write them
    python scripts/unasync.py --check    # exit 1 if one is not what its source makes

As httpcore does: the async code is the one source, and the sync code is the same code with
``async``/``await`` taken out and the async names replaced by their sync ones, word by word.
A module ``ratelimit_mw/_async/NAME.py`` makes ``ratelimit_mw/_sync/NAME.py``. Generated code
lives in ``_sync/`` only, and nothing there is written by hand: the primitives the two sides
stand on (deadline, sleep, flights, timers) are in ``ratelimit_mw/_synchronization.py``,
written by hand, their async names mapped onto their blocking twins here.

CI runs ``--check`` (and tests/test_unasync.py does), so a stale twin fails the suite.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ROOT / "ratelimit_mw" / "_async"
TARGETS = ROOT / "ratelimit_mw" / "_sync"
HAND_WRITTEN = {"__init__.py"}

# Applied in order, to whole words (a name is never rewritten inside a longer one).
SUBSTITUTIONS = [
    (r"\basync def\b", "def"),
    (r"\basync with\b", "with"),
    (r"\basync for\b", "for"),
    (r"\bawait ", ""),
    (r"\bAsyncBackend\b", "SyncBackend"),
    (r"\bAsync([A-Z]\w*)", r"\1"),
    (r"\b(\w+)_async\b", r"\1_sync"),
    (r"\barun\b", "run"),
    (r"\baping\b", "ping"),
    (r"\baclose\b", "close"),
    (r"\baread\b", "read"),
    (r"\b__aiter__\b", "__iter__"),
    (r"\bhandle_async_request\b", "handle_request"),
    (r"\b__aenter__\b", "__enter__"),
    (r"\b__aexit__\b", "__exit__"),
    (r"\bratelimit_mw\._async\b", "ratelimit_mw._sync"),
    (r"\bAwaitable\[(\w+)\]", r"\1"),
    (r"^(from collections\.abc import .*)\bAwaitable, ", r"\1"),
]
_COMPILED = [(re.compile(pattern), replacement) for pattern, replacement in SUBSTITUTIONS]


def unasync_lines(lines: list[str], used: set[int] | None = None) -> list[str]:
    """The sync twin of async source lines. The continuation lines of a signature that got
    shorter move left with its parenthesis, so that they stay aligned with it. `used`
    collects the index of every substitution that changed a line."""
    out = []
    depth = shift = 0  # parentheses still open in such a signature; how far it moved
    for line in lines:
        source = line
        if depth > 0 and line.startswith(" " * shift):
            line = line[shift:]
        for index, (pattern, replacement) in enumerate(_COMPILED):
            line, count = pattern.subn(replacement, line)
            if count and used is not None:
                used.add(index)
        if depth > 0:
            depth += source.count("(") - source.count(")")
        elif "async def " in source and "(" in source:
            depth = source.count("(") - source.count(")")
            shift = source.index("(") - line.index("(")
        out.append(line)
    return out


def unasync(source: str, name: str, used: set[int] | None = None) -> str:
    """The sync twin of one async source module."""
    return "".join([f"# Generated from ratelimit_mw/_async/{name} by scripts/unasync.py: "
                    "do not edit.\n", *unasync_lines(source.splitlines(keepends=True), used)])


def made(used: set[int] | None = None) -> dict[Path, str]:
    """Every generated file as its sources make it."""
    files = {TARGETS / path.name: unasync(path.read_text(), path.name, used)
             for path in sorted(SOURCES.glob("*.py")) if path.name not in HAND_WRITTEN}
    return files


def unused(used: set[int]) -> list[str]:
    """The substitutions that changed nothing in any source: stale rules, which would
    silently rewrite a line written later."""
    return [SUBSTITUTIONS[index][0] for index in range(len(SUBSTITUTIONS))
            if index not in used]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check, write nothing")
    args = parser.parse_args()
    used: set[int] = set()
    files = made(used)
    idle = unused(used)
    for pattern in idle:
        print(f"a substitution that matches nothing in the async sources: {pattern!r}; "
              "remove it from SUBSTITUTIONS")
    if idle:
        return 1
    stale = [path for path, text in files.items()
             if not path.exists() or path.read_text() != text]
    for path in stale:
        if not args.check:
            path.write_text(files[path])
        print(f"{'stale' if args.check else 'wrote'}: {path.relative_to(ROOT)}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
