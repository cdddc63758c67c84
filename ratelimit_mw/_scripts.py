"""The Lua source: four algorithm files and the entry point, joined into one script.

The files live in the top-level ``lua/`` folder; the wheel carries them as
``ratelimit_mw/lua/``. An editable install or a checkout reads them from ``lua/`` beside the
package. Joining them lets one EVALSHA decide tiers of different algorithms together, while
each algorithm stays in its own file.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

ALGORITHM_FILES = ("fixed_window.lua", "sliding_window.lua", "gcra.lua", "sliding_log.lua")
ENTRY_FILE = "main.lua"


def lua_dir() -> Path:
    here = Path(__file__).resolve().parent
    for candidate in (here / "lua", here.parent / "lua"):
        if (candidate / ENTRY_FILE).is_file():
            return candidate
    raise FileNotFoundError(  # pragma: no cover - a broken install
        f"ratelimit_mw cannot find its Lua scripts in {here / 'lua'} or {here.parent / 'lua'}; "
        "reinstall the package"
    )


def _load() -> str:
    folder = lua_dir()
    parts = [(folder / name).read_text(encoding="utf-8") for name in ALGORITHM_FILES]
    parts.append((folder / ENTRY_FILE).read_text(encoding="utf-8"))
    return "\n".join(parts)


SOURCE = _load()
SHA1 = hashlib.sha1(SOURCE.encode("utf-8")).hexdigest()
