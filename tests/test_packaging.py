"""The wheel carries the Lua scripts and py.typed; a checkout loads them from the top-level lua/.

Builds the wheel, installs it into a fresh virtualenv (no system site-packages: only the wheel
and redis-py), and runs a limiter there on the memory backend and on the real Redis.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
import zipfile
from pathlib import Path

import pytest

import ratelimit_mw
from ratelimit_mw.core import scripts as _scripts

ROOT = Path(__file__).resolve().parent.parent
LUA_FILES = {"main.lua", "fixed_window.lua", "sliding_window.lua", "gcra.lua", "sliding_log.lua"}
REDIS_URL = os.environ.get("RATELIMIT_REDIS_URL", "redis://127.0.0.1:6379/0")


def test_a_checkout_loads_the_scripts_from_the_top_level_lua_folder() -> None:
    package = Path(ratelimit_mw.__file__).resolve().parent
    if (package / "lua").is_dir():
        pytest.skip("running from an installed wheel, not a checkout")
    assert _scripts.lua_dir() == ROOT / "lua"
    assert {p.name for p in (ROOT / "lua").glob("*.lua")} >= LUA_FILES
    source = _scripts.source()
    for name in LUA_FILES - {"main.lua"}:
        assert (ROOT / "lua" / name).read_text(encoding="utf-8") in source
    algorithms = {name.removesuffix(".lua"): (ROOT / "lua" / name).read_text(encoding="utf-8")
                  for name in _scripts.ALGORITHM_FILES}
    entry = (ROOT / "lua" / "main.lua").read_text(encoding="utf-8")
    assert source.rstrip().endswith(_scripts.inline(entry, algorithms).rstrip())


def test_main_lua_holds_no_copy_of_an_algorithm_its_checks_are_written_out_from_their_files(
) -> None:
    entry = (ROOT / "lua" / "main.lua").read_text(encoding="utf-8")
    source = _scripts.source()
    for check, line in [("fixed_window", "string.format('%d:%d', start, total), px"),
                        ("gcra", "string.format('%d', now_us + stored), math.ceil(stored / 1000)"),
                        ("sliding_window", "string.format('%d:%d:%d', start, total, prev)"),
                        ("sliding_log.sliding_log_count",
                         "if later == 0 and redis.call('ZSCORE', key, '+') then later = -1"),
                        ("sliding_log.sliding_log_record",
                         "redis.call('ZREMRANGEBYSCORE', key, '-inf'")]:
        assert f"--@inline {check if '.' in check else check + '.check'}(" in entry
        assert line not in entry  # no copy by hand...
        assert source.count(line) >= 2  # ...the algorithm's own line, and its written-out one
    with pytest.raises(ValueError, match="only return"):
        _scripts.inline("--@inline a.f(x) -> y", {"a": "local function f(x)\n"
                                                          "  if x then return 1 end\n"
                                                          "  return 2\nend"})
    with pytest.raises(ValueError, match="name the targets"):
        _scripts.inline("--@inline a.f(x)", {"a": "local function f(x)\n  return x\nend"})
    written = _scripts.inline("  --@inline a.f(x + 1)", {"a": "local function f(y)\n"
                                                               "  redis.call('DEL', y)\nend"})
    assert written.split("\n") == ["  do", "    do", "      local y = x + 1",
                                    "      redis.call('DEL', y)", "    end", "  end"]


def test_every_lua_file_opens_with_its_keys_argv_and_reply() -> None:
    for name in LUA_FILES - {"main.lua"}:
        head = (ROOT / "lua" / name).read_text(encoding="utf-8").split("\nlocal ", 1)[0]
        for word in ("KEYS", "ARGV", "Reply"):
            assert word in head, (name, word)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # --no-isolation: build with the hatchling already installed, no network needed.
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation",
                    "--outdir", str(out), str(ROOT)],
                   check=True, capture_output=True, timeout=300)
    (found,) = out.glob("ratelimit_mw-*.whl")
    return found


@pytest.mark.slow
def test_the_wheel_carries_the_lua_scripts_and_py_typed(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"ratelimit_mw/lua/{name}" for name in LUA_FILES} <= names
    assert "ratelimit_mw/py.typed" in names
    assert not any(name.startswith(("tests/", "lua/")) for name in names)


@pytest.mark.slow
def test_the_wheel_works_in_a_fresh_virtualenv(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", str(wheel), "redis>=5"],
                   check=True, capture_output=True, timeout=600)
    prefix = "w" + uuid.uuid4().hex[:12]
    script = textwrap.dedent(f"""
        import json, sys
        import ratelimit_mw as rl
        from ratelimit_mw.core import scripts as _scripts
        memory = rl.Limiter()
        on_redis = rl.Limiter(rl.RedisBackend.from_url({REDIS_URL!r}), prefix={prefix!r})
        policy = rl.Policy("2/minute;3/hour", algorithm="sliding-log")
        print(json.dumps({{
            "file": rl.__file__,
            "lua": str(_scripts.lua_dir()),
            "memory": [memory.hit(policy, "u").allowed for _ in range(3)],
            "redis": [on_redis.hit(policy, "u").allowed for _ in range(3)],
            "prefix": sys.prefix,
        }}))
        on_redis.reset(policy, "u")
    """)
    # Run outside the checkout, so that nothing but the installed wheel can be imported.
    result = subprocess.run([str(python), "-c", script], cwd=tmp_path, check=True,
                            capture_output=True, text=True, timeout=120,
                            env={"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path)})
    report = json.loads(result.stdout)
    assert report["prefix"] == str(venv)
    assert report["file"].startswith(str(venv))
    assert report["lua"] == str(Path(report["file"]).parent / "lua")
    assert report["memory"] == report["redis"] == [True, True, False]
