"""Fixtures of the reliability suite: private redis-servers and the figures it measures.

The shared fixtures (`prefix`, `redis_client`, `redis_cluster_url`, ...) come from
tests/conftest.py. Faults are only ever injected into servers started here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from reliability._support import FIGURES_FILE, Figures, PrivateRedis

_FIGURES = Figures()


@pytest.fixture(scope="session")
def figures() -> Figures:
    """Where tests record what they measured (printed at the end, written as JSON)."""
    return _FIGURES


@pytest.fixture
def private_redis() -> Iterator[Callable[..., PrivateRedis]]:
    """``private_redis(*redis_server_args)`` starts a private server; all end with the test."""
    started: list[PrivateRedis] = []

    def start(*extra: str) -> PrivateRedis:
        server = PrivateRedis(*extra)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        # SIGKILL by pid: nothing is persisted, and a paused server would sit on a SHUTDOWN.
        server.kill()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _FIGURES.data:
        return
    _FIGURES.write()
    terminalreporter.section("ratelimit_mw reliability figures")
    for name, value in sorted(_FIGURES.data.items()):
        terminalreporter.write_line(f"{name}: {json.dumps(value)}")
    terminalreporter.write_line(f"(written to {FIGURES_FILE})")
