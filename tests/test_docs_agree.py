"""What the docs say of the package agrees with the package: the README's extras list is
pyproject's, and every page that gives the suite's size gives the same one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

def test_the_readme_lists_every_extra_of_the_package() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = set(pyproject["project"]["optional-dependencies"])
    readme = (ROOT / "README.md").read_text()
    paragraph = readme[readme.index("Install from PyPI-style extras"):]
    paragraph = paragraph[:paragraph.index("\n\n")]
    listed = set(re.findall(r"\[([a-z0-9]+)\]", paragraph))
    assert listed == extras


def _suite_size(text: str) -> tuple[str, str]:
    found = re.search(r"The suite \(about ([\d,]+) tests.*?takes\s+(\d+ to \d+) minutes",
                      text, re.S)
    assert found is not None
    return found.group(1), found.group(2)


def test_the_readme_and_getting_started_give_the_same_suite_size() -> None:
    readme = _suite_size((ROOT / "README.md").read_text())
    started = _suite_size((ROOT / "docs" / "getting-started.md").read_text())
    assert readme == started
