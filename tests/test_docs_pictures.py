"""The algorithm pictures in docs/algorithms.md, and the numbers its prose quotes from them,
come from real runs of the limiter (docs/scripts/draw_algorithms.py). If an algorithm's
behaviour changes, this fails: redraw the pictures and update the page."""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "docs" / "scripts" / "draw_algorithms.py"


@pytest.fixture(scope="module")
def drawing() -> ModuleType:
    spec = importlib.util.spec_from_file_location("draw_algorithms", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports no matplotlib: only main() draws
    return module


# The most hits admitted within any 60 s of the run, as docs/algorithms.md states them.
PEAKS = {"fixed-window": 20, "sliding-log": 10, "sliding-window": 18, "gcra": 19}


@pytest.mark.parametrize("algorithm", sorted(PEAKS))
def test_the_pictures_show_what_the_algorithms_page_says(
    drawing: ModuleType, algorithm: str
) -> None:
    admitted, refused = drawing.run(algorithm)
    _, counts = drawing.trailing_counts(admitted)
    assert max(counts) == PEAKS[algorithm]
    assert len(admitted) + len(refused) == len(drawing.REQUESTS)


def test_fixed_window_admits_twice_the_limit_across_the_boundary(drawing: ModuleType) -> None:
    admitted, _ = drawing.run("fixed-window")
    assert [t for t in admitted if t < 70] == [50.0 + i for i in range(20)]


def test_gcra_admits_one_every_six_seconds_after_the_burst(drawing: ModuleType) -> None:
    admitted, _ = drawing.run("gcra")
    # The burst of 10 took 10 s, during which 10/6 of a hit came back (60 s and 62 s).
    assert admitted[:12] == [50.0 + i for i in range(11)] + [62.0]
    assert {b - a for a, b in itertools.pairwise(admitted[11:])} == {6.0}


def test_the_runs_are_deterministic(drawing: ModuleType) -> None:
    assert drawing.run("sliding-window") == drawing.run("sliding-window")
