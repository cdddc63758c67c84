"""Draw the algorithm pictures of the documentation from real runs of the limiter.

    python -m pip install -e . matplotlib
    python docs/scripts/draw_algorithms.py          # rewrites docs/img/algorithm-*.png

Every point is a decision the real `Limiter` returned: one client asks once a second from
t = 50 s to t = 180 s against `Policy("10/minute", algorithm=...)` on a `MemoryBackend`
(the in-process twin of the Lua scripts, held to identical answers by the differential
test). The clock is controlled, so the run is the same every time and the PNGs only change
when an algorithm does. The deny cache is off: the pictures show what the store decides.

The PNGs are committed; building the site needs only mkdocs and mkdocs-material.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import ratelimit_mw as rl

if TYPE_CHECKING:  # matplotlib is imported by main() only: the runs need no plotting library
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

OUT = Path(__file__).resolve().parent.parent / "img"
START = 1_800_000_000.0  # a multiple of 60: t = 0 is a minute boundary (windows are epoch-aligned)
LIMIT, PERIOD = 10, 60.0
RATE = f"{LIMIT}/minute"
REQUESTS = [50.0 + i for i in range(131)]  # once a second, t = 50 … 180
END = 181.0

# Titles: {peak} is the most hits admitted within any 60 s of the run, counted from it.
ALGORITHMS = {
    "fixed-window": "fixed-window: 10 before a minute boundary, 10 after it ({peak} within 60 s)",
    "sliding-log": "sliding-log (default): never more than the limit in any 60 s ({peak})",
    "sliding-window": "sliding-window: the estimate lets hits back one by one ({peak} within 60 s)",
    "gcra": "gcra: a burst of 10, then one every 6 s ({peak} within 60 s)",
}


class Clock:
    """Seconds since the epoch, moved by the script (the limiter passes it as `now`)."""

    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


def run(algorithm: str) -> tuple[list[float], list[float]]:
    """Admitted and refused request times (seconds from START) from the real limiter."""
    clock = Clock()
    limiter = rl.Limiter(rl.MemoryBackend(), clock=clock, deny_cache=0)
    policy = rl.Policy(RATE, algorithm=algorithm, name="demo")
    admitted: list[float] = []
    refused: list[float] = []
    for t in REQUESTS:
        clock.now = START + t
        (admitted if limiter.hit(policy, "client").allowed else refused).append(t)
    return admitted, refused


def trailing_counts(admitted: list[float]) -> tuple[list[float], list[int]]:
    """Admitted hits in the trailing period (now − 60 s, now], sampled every 0.25 s."""
    xs = [i * 0.25 for i in range(int(END / 0.25) + 1)]
    return xs, [sum(1 for a in admitted if x - PERIOD < a <= x) for x in xs]


def draw(ax: Axes, algorithm: str, title: str) -> int:
    admitted, refused = run(algorithm)
    xs, counts = trailing_counts(admitted)
    for boundary in (0.0, 60.0, 120.0, 180.0):
        ax.axvline(boundary, color="#bbbbbb", linestyle=":", linewidth=0.8)
    ax.axhline(LIMIT, color="#c0392b", linestyle="--", linewidth=1, label="limit (10)")
    ax.step(
        xs, counts, where="post", color="#2c3e50", linewidth=1.5, label="admitted in the last 60 s"
    )
    ax.scatter(
        admitted,
        [-2.0] * len(admitted),
        marker="|",
        s=60,
        color="#27ae60",
        label=f"admitted ({len(admitted)})",
    )
    ax.scatter(
        refused,
        [-2.0] * len(refused),
        marker=".",
        s=6,
        color="#95a5a6",
        label=f"refused ({len(refused)})",
    )
    ax.set_title(title.format(peak=max(counts)), fontsize=10, loc="left")
    ax.set_xlim(0, END)
    ax.set_ylim(-4, 22)
    ax.set_yticks([0, 10, 20])
    ax.grid(axis="y", color="#eeeeee")
    ax.legend(loc="upper left", fontsize=7, ncol=2, frameon=False)
    return max(counts)


def save(fig: Figure, name: str) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    # No "Software" metadata: the file depends on the run, not on who drew it.
    fig.savefig(OUT / name, dpi=110, metadata={"Software": None})
    plt.close(fig)


def main() -> int:
    import matplotlib

    matplotlib.use("Agg")  # no display; the same pixels on every machine with this matplotlib
    import matplotlib.pyplot as plt

    OUT.mkdir(parents=True, exist_ok=True)
    peaks = {}
    fig, axes = plt.subplots(len(ALGORITHMS), 1, figsize=(9, 9), sharex=True)
    for ax, (algorithm, title) in zip(axes, ALGORITHMS.items(), strict=True):
        peaks[algorithm] = draw(ax, algorithm, title)
    axes[-1].set_xlabel("seconds (one request a second from t = 50; dotted: minute boundaries)")
    fig.suptitle('"10/minute", one eager client, decisions of the real Limiter', fontsize=11)
    save(fig, "algorithms.png")
    for algorithm, title in ALGORITHMS.items():
        fig, ax = plt.subplots(figsize=(9, 2.6))
        draw(ax, algorithm, title)
        ax.set_xlabel("seconds")
        save(fig, f"algorithm-{algorithm}.png")
    for algorithm, peak in peaks.items():
        print(f"{algorithm:15} most admitted in any 60 s: {peak}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
