"""examples/flask_app.py does what its docstring says."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

import ratelimit_mw as rl

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flask_app.py"


def load_example() -> ModuleType:
    # A fresh module each time: the example builds its limiter at import.
    spec = importlib.util.spec_from_file_location("flask_app_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_counts_in_memory_without_a_redis_url(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RATELIMIT_REDIS_URL", raising=False)
    example = load_example()
    assert isinstance(example.limiter.backend, rl.MemoryBackend)
    c = example.app.test_client()
    assert [c.post("/login").status_code for _ in range(6)] == [401] * 5 + [429]
    refused = c.post("/login")
    assert refused.get_json() == {"error": "slow down", "retry_after": 60}
    assert refused.headers["Retry-After"] == "60"
    assert refused.headers["RateLimit"] == '"minute";r=0;t=60'
    assert c.get("/").get_json() == {"hello": "world", "remaining": 59}
    assert c.get("/users/1").headers["RateLimit"] == '"minute";r=19;t=60'
    assert c.get("/users/2").headers["RateLimit"] == '"minute";r=18;t=60'  # one template
    assert "RateLimit" not in c.get("/health").headers
    assert c.get("/api/status").headers["RateLimit-Policy"] == '"minute";q=30;w=60'
    assert c.get("/api/search").headers["RateLimit-Policy"] == '"minute";q=10;w=60'


def test_the_example_uses_redis_when_a_url_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RATELIMIT_REDIS_URL", "redis://127.0.0.1:6379/0")
    example = load_example()
    backend = example.limiter.backend
    assert isinstance(backend, rl.RedisBackend)
    assert backend.client.connection_pool.connection_kwargs["socket_timeout"] == 0.1
    backend.close()
