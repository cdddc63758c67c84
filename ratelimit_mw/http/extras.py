"""Optional dependencies: an adapter whose framework is missing says which extra to install."""

from __future__ import annotations

import importlib.util


def installed(package: str) -> bool:
    """Whether `package` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a finder that refuses it, a half-removed package
        return False


def require(package: str, extra: str, module: str) -> None:
    """Raise ImportError naming ``pip install 'ratelimit_mw[extra]'`` if `package` is missing.

    Called before the adapter imports the framework, so the user reads the install line
    instead of a bare ``No module named 'starlette'``.
    """
    if not installed(package):
        raise ImportError(
            f"{module} needs {package}: pip install 'ratelimit_mw[{extra}]' (or {package})"
        )
