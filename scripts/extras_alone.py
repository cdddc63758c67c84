"""Install each extra alone in a fresh virtual environment and serve one request through it.

    python scripts/extras_alone.py                 # every extra (CI runs this)
    python scripts/extras_alone.py django flask    # some

The package is built into a wheel once and installed as a user installs it
(``pip install 'ratelimit_mw[django]'`` and nothing else); `tests/extras_smoke.py` then
imports the adapter its docs name and serves one request through it. The suite itself
installs every extra, so it cannot see an adapter that needs another extra's framework.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "tests" / "extras_smoke.py"
sys.path.insert(0, str(SMOKE.parent))
from extras_smoke import BRINGS  # noqa: E402


def build_wheel(into: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--wheel-dir", str(into), str(ROOT)], check=True)
    return next(into.glob("ratelimit_mw-*.whl"))


def try_extra(extra: str, wheel: Path, work: Path) -> tuple[str, bool, str, float]:
    """(extra, passed, output, seconds) of one fresh venv with the wheel and that extra."""
    started = time.monotonic()
    venv = work / f"venv-{extra}"
    python = venv / "bin" / "python"
    requirement = str(wheel) if extra == "none" else f"{wheel}[{extra}]"
    steps = [[sys.executable, "-m", "venv", str(venv)],
             [str(python), "-m", "pip", "install", "--quiet", requirement],
             # From a directory outside the checkout: the installed package, not the source.
             [str(python), str(SMOKE), extra]]
    output = []
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, cwd=work, timeout=600)
        output.append(done.stdout + done.stderr)
        if done.returncode != 0:
            return extra, False, "".join(output), time.monotonic() - started
    return extra, True, output[-1].strip(), time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("extras", nargs="*", default=sorted(BRINGS))
    parser.add_argument("--jobs", type=int, default=4, help="venvs built at once")
    args = parser.parse_args()
    unknown = set(args.extras) - set(BRINGS)
    if unknown:
        parser.error(f"unknown extras {sorted(unknown)}; known: {sorted(BRINGS)}")
    with tempfile.TemporaryDirectory(prefix="ratelimit_mw-extras-") as tmp:
        work = Path(tmp)
        wheel = build_wheel(work)
        with ThreadPoolExecutor(args.jobs) as pool:
            results = list(pool.map(lambda extra: try_extra(extra, wheel, work), args.extras))
    failed = 0
    for extra, passed, output, seconds in results:
        print(f"{'ok  ' if passed else 'FAIL'} [{extra}] {seconds:.0f} s"
              + ("" if passed else f"\n{output}"))
        failed += not passed
    print(f"extras alone: {len(results) - failed} of {len(results)} served")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
