"""Lines of code in ratelimit_mw/: physical lines holding a token that is neither a comment
nor a docstring (blank lines, comments and docstrings are not counted; a statement over
three lines counts three). Per module with ``--modules``.

    python benchmarks/code_lines.py                # this checkout
    python benchmarks/code_lines.py --tree DIR     # another (e.g. a ``git archive`` of a commit)
"""

from __future__ import annotations

import argparse
import io
import tokenize
from pathlib import Path

_SKIPPED = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER)
_STATEMENT_START = (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.NL)


def code_lines(source: str) -> int:
    """The physical lines of `source` that hold code (a string alone as a statement, as a
    docstring is, is not code)."""
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    lines: set[int] = set()
    previous: tokenize.TokenInfo | None = None
    for i, token in enumerate(tokens):
        if token.type in _SKIPPED:
            continue
        if token.type == tokenize.STRING and (previous is None
                                              or previous.type in _STATEMENT_START):
            following = tokens[i + 1] if i + 1 < len(tokens) else None
            if following is None or following.type in (tokenize.NEWLINE, tokenize.NL,
                                                       tokenize.ENDMARKER):
                previous = token
                continue
        lines.update(range(token.start[0], token.end[0] + 1))
        previous = token
    return len(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent),
                        help="the checkout whose ratelimit_mw/ is counted")
    parser.add_argument("--modules", action="store_true", help="a line per module too")
    args = parser.parse_args()
    package = Path(args.tree) / "ratelimit_mw"
    counts = {path.relative_to(package.parent): code_lines(path.read_text())
              for path in sorted(package.rglob("*.py"))}
    if args.modules:
        for path, count in sorted(counts.items(), key=lambda item: item[1]):
            print(f"{count:6,}  {path}")
    generated = sum(count for path, count in counts.items() if path.parts[1] == "_sync")
    print(f"{sum(counts.values()):,} code lines in {package} ({generated:,} of them generated, "
          "in _sync/)")


if __name__ == "__main__":
    main()
