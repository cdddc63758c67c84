"""The Lua source: the algorithm files (four rates and in-flight slots) and the entry point,
joined into one script.

The files live in the project's top-level ``lua/``; the wheel carries them as
``ratelimit_mw/lua/`` (found through ``importlib.resources``), a checkout or editable install
reads ``lua/`` beside the package. They are read once, at first use, never at import. Joining
them lets one EVALSHA decide tiers of different algorithms together, while each algorithm
stays in its own file.
"""

from __future__ import annotations

import functools
import hashlib
import re
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from importlib.abc import Traversable

ALGORITHM_FILES = ("fixed_window.lua", "sliding_window.lua", "gcra.lua", "sliding_log.lua",
                   "concurrency.lua")
ENTRY_FILE = "main.lua"


def lua_dir() -> Traversable:
    """Where the Lua files are: inside the installed package (a wheel), else beside it."""
    package = resources.files("ratelimit_mw")
    bundled = package / "lua"
    if bundled.joinpath(ENTRY_FILE).is_file():
        return bundled
    checkout = Path(str(package)).parent / "lua"
    if (checkout / ENTRY_FILE).is_file():
        return checkout
    raise FileNotFoundError(  # pragma: no cover - a broken install
        f"ratelimit_mw cannot find its Lua scripts in {bundled} or {checkout}; "
        "reinstall the package"
    )


# main.lua's ``--@inline file.function(args) -> targets`` lines (``-> targets`` left out for a
# function that returns nothing): the algorithm's own function written out in place.
_INLINE = re.compile(r"^(?P<indent>[ ]*)--@inline (?P<file>\w+)\.(?P<name>\w+)"
                     r"\((?P<args>[^)]*)\)(?: -> (?P<targets>.+))?$")


def _function(text: str, file: str, name: str) -> tuple[list[str], list[str]]:
    """The parameters and body lines of `local function name(...)` in an algorithm file."""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        found = re.match(rf"^(?P<indent>[ ]*)local function {name}\((?P<params>[^)]*)\)$", line)
        if found is None:
            continue
        end = found.group("indent") + "end"
        for j in range(i + 1, len(lines)):
            if lines[j] == end:
                params = [p.strip() for p in found.group("params").split(",")]
                return params, lines[i + 1:j]
    raise ValueError(f"lua/{file}.lua has no `local function {name}(...)` ... `end` to inline")


def inline(entry: str, algorithms: dict[str, str]) -> str:
    """`entry` with each ``--@inline file.function(args) -> targets`` line replaced by that
    function's body, from its algorithm file, inside a ``do`` block: its parameters bound to
    `args`, its one ``return`` (its last statement) assigned to `targets`; without targets the
    function must return nothing. Inlined because a Lua call costs more than these checks;
    the specialised path is still generated from each algorithm's one source."""
    out: list[str] = []
    for line in entry.split("\n"):
        marker = _INLINE.match(line)
        if marker is None:
            out.append(line)
            continue
        indent, file, name = marker.group("indent"), marker.group("file"), marker.group("name")
        params, body = _function(algorithms[file], file, name)
        code = [text.split("--", 1)[0] for text in body]  # comments may say "return"
        returns = [k for k, text in enumerate(code) if text.strip().startswith("return ")]
        written = sum(len(re.findall(r"\breturn\b", text)) for text in code)
        targets = [t.strip() for t in (marker.group("targets") or "").split(",") if t.strip()]
        if targets and (len(returns) != 1 or written != 1):
            raise ValueError(f"{file}.{name} must end with its only return to be inlined")
        if not targets and written:
            raise ValueError(f"{file}.{name} returns values: name the targets they go to "
                             "(`--@inline file.function(args) -> targets`)")
        depth = len(body[0]) - len(body[0].lstrip(" "))  # the body's own indentation
        cut = returns[0] if targets else len(body)
        # The body's locals may bear the targets' names: its results go through locals of
        # their own, out of the body's scope, then to the targets.
        results = [f"_inlined{k}" for k in range(len(targets))]
        out.append(f"{indent}do")
        if results:
            out.append(f"{indent}  local {', '.join(results)}")
        out.append(f"{indent}  do")
        out.append(f"{indent}    local {', '.join(params)} = {marker.group('args')}")
        out += [f"{indent}    {text[depth:]}" if text.strip() else "" for text in body[:cut]]
        if targets:
            continuation = "\n".join(body[cut:]).strip()[len("return "):].split("\n")
            out.append(f"{indent}    {', '.join(results)} = {continuation[0]}")
            out += [f"{indent}      {text.strip()}" for text in continuation[1:]]
        out.append(f"{indent}  end")
        if targets:
            out.append(f"{indent}  {', '.join(targets)} = {', '.join(results)}")
        out.append(f"{indent}end")
    return "\n".join(out)


@functools.cache
def source() -> str:
    """The joined script, read on first use and kept."""
    folder = lua_dir()
    texts = {name: folder.joinpath(name).read_text(encoding="utf-8")
             for name in ALGORITHM_FILES}
    entry = inline(folder.joinpath(ENTRY_FILE).read_text(encoding="utf-8"),
                   {name.removesuffix(".lua"): text for name, text in texts.items()})
    return "\n".join([*texts.values(), entry])


@functools.cache
def sha1() -> str:
    """The script's SHA1, the name EVALSHA runs it by."""
    return hashlib.sha1(source().encode("utf-8")).hexdigest()
