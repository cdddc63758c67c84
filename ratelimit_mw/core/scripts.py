"""The Lua source: four algorithm files and the entry point, joined into one script.

The files live in the top-level ``lua/`` folder of the project; the wheel carries them as
``ratelimit_mw/lua/`` (found through ``importlib.resources``), and a checkout or an editable
install reads them from ``lua/`` beside the package. They are read once, at first use (the
first script call or load), never at import: importing the package touches no file. Joining
them lets one EVALSHA decide tiers of different algorithms together, while each algorithm stays
in its own file.
"""

from __future__ import annotations

import functools
import hashlib
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from importlib.abc import Traversable

ALGORITHM_FILES = ("fixed_window.lua", "sliding_window.lua", "gcra.lua", "sliding_log.lua")
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


@functools.cache
def source() -> str:
    """The joined script, read on first use and kept."""
    folder = lua_dir()
    parts = [folder.joinpath(name).read_text(encoding="utf-8") for name in ALGORITHM_FILES]
    parts.append(folder.joinpath(ENTRY_FILE).read_text(encoding="utf-8"))
    return "\n".join(parts)


@functools.cache
def sha1() -> str:
    """The script's SHA1, the name EVALSHA runs it by."""
    return hashlib.sha1(source().encode("utf-8")).hexdigest()
