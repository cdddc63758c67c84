"""Fixtures for the WSGI middleware and Flask extension tests.

The shared fixtures (`clock`, `prefix`, `backend`, `limiter`, `redis_client`) come from
tests/conftest.py; these add a Redis backend that cannot be reached. Helpers the test modules
import live in wsgi_support.py.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from support import free_port

import ratelimit_mw as rl


@pytest.fixture
def down_backend() -> Iterable[rl.RedisBackend]:
    """A real Redis client, with the library's safe defaults, pointed at a closed port."""
    backend = rl.RedisBackend.from_url(f"redis://127.0.0.1:{free_port()}/0")
    yield backend
    backend.close()
