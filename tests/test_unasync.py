"""The sync twins in ratelimit_mw/_sync/ are what scripts/unasync.py makes of their async
sources: edited by hand, or left stale after a change to the source, they fail here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import unasync  # noqa: E402

sys.path.remove(str(ROOT / "scripts"))


@pytest.mark.parametrize("source", sorted(
    path.name for path in unasync.SOURCES.glob("*.py") if path.name not in unasync.HAND_WRITTEN))
def test_each_sync_twin_is_generated_from_its_source(source: str) -> None:
    made = unasync.unasync((unasync.SOURCES / source).read_text(), source)
    assert (unasync.TARGETS / source).read_text() == made, (
        f"ratelimit_mw/_sync/{source} is stale: run python scripts/unasync.py")


def test_generated_code_lives_in_the_sync_package_only() -> None:
    marked = [path.relative_to(ROOT) for path in (ROOT / "ratelimit_mw").rglob("*.py")
              if unasync.TARGETS not in path.parents
              and "by scripts/unasync.py: do not edit" in path.read_text()]
    assert marked == []
    generated = sorted(path.name for path in unasync.TARGETS.glob("*.py")
                       if path.name not in unasync.HAND_WRITTEN)
    assert generated == sorted(path.name for path in unasync.SOURCES.glob("*.py")
                               if path.name not in unasync.HAND_WRITTEN)


def test_the_check_mode_says_so_too() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "unasync.py"), "--check"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout


def test_a_signature_continued_over_lines_stays_aligned() -> None:
    source = ("async def decide(self, a: int,\n"
              "                 b: int) -> None:\n"
              "    await self.backend.arun(a)\n")
    assert unasync.unasync(source, "x.py").splitlines()[1:] == [
        "def decide(self, a: int,",
        "           b: int) -> None:",
        "    self.backend.run(a)",
    ]
    renamed = ("    async def decide_async(self, a: int,\n"
               "                           b: int) -> None:\n")
    assert unasync.unasync_lines(renamed.splitlines(keepends=True)) == [
        "    def decide_sync(self, a: int,\n",
        "                    b: int) -> None:\n",
    ]


def test_every_substitution_rewrites_something_in_the_sources() -> None:
    used: set[int] = set()
    unasync.made(used)
    assert unasync.unused(used) == []


def test_a_substitution_that_matches_nothing_fails_the_check(
        monkeypatch: pytest.MonkeyPatch) -> None:
    idle = (r"\bnever_written_anywhere\b", "x")
    monkeypatch.setattr(unasync, "SUBSTITUTIONS", [*unasync.SUBSTITUTIONS, idle])
    monkeypatch.setattr(unasync, "_COMPILED", [
        *unasync._COMPILED, (unasync.re.compile(idle[0]), idle[1])])
    used: set[int] = set()
    unasync.made(used)
    assert unasync.unused(used) == [idle[0]]
