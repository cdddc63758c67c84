"""Optional dependencies: an adapter whose framework is missing says which extra to install."""

from __future__ import annotations

import importlib.util


def require(package: str, extra: str, module: str) -> None:
    """Raise ImportError naming ``pip install 'ratelimit_mw[extra]'`` if `package` is missing.

    Called before the adapter imports the framework, so the user reads the install line
    instead of a bare ``No module named 'starlette'``.
    """
    if importlib.util.find_spec(package) is None:
        raise ImportError(
            f"{module} needs {package}: pip install 'ratelimit_mw[{extra}]' (or {package})"
        )
