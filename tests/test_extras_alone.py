"""Each extra alone: its adapter imports and serves a request with every framework the extra
does not bring hidden (`tests/extras_smoke.py`). CI also installs each extra alone in a fresh
virtual environment (`scripts/extras_alone.py`), which this cannot replace: it catches a
dependency the package metadata forgot, this catches an import of another extra's framework."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from extras_smoke import BRINGS, FRAMEWORKS

SMOKE = Path(__file__).with_name("extras_smoke.py")


@pytest.mark.parametrize("extra", sorted(BRINGS))
def test_an_extra_alone_imports_its_adapter_and_serves_a_request(extra: str) -> None:
    done = subprocess.run([sys.executable, str(SMOKE), extra, "--hide"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONHASHSEED": "0"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"[{extra}] alone: served" in done.stdout


def test_every_extra_of_the_package_is_tried_alone() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads(Path(__file__).parents[1].joinpath("pyproject.toml").read_text())
    extras = set(pyproject["project"]["optional-dependencies"])
    # Bundles of other extras and tooling, not an adapter a user installs for itself.
    bundles = {"test", "docs", "demo", "hiredis"}
    assert extras - bundles == set(BRINGS) - {"none"}


def test_the_hidden_frameworks_are_the_ones_an_extra_does_not_bring() -> None:
    for extra, brings in BRINGS.items():
        assert brings <= FRAMEWORKS, extra
