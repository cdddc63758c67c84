"""The README demo apps behave as their comments say (memory backend, in process)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
from starlette.testclient import TestClient

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.delenv("RATELIMIT_REDIS_URL", raising=False)
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["fastapi_app", "starlette_app"])
def test_each_example_has_a_default_a_decorated_an_exempt_route_and_a_login_rule(
        name, monkeypatch):
    app = load(name, monkeypatch).app
    with TestClient(app) as client:
        index = client.get("/")
        search = [client.get("/search").status_code for _ in range(6)]
        health = [client.get("/health").status_code for _ in range(70)]
        login = [client.post("/login").status_code for _ in range(6)]

    assert index.headers["ratelimit-policy"] == '"minute";q=60;w=60'
    assert search == [200] * 5 + [429]
    assert health == [200] * 70
    assert login == [200] * 5 + [429]


def test_the_fastapi_example_limits_reports_per_api_key(monkeypatch):
    app = load("fastapi_app", monkeypatch).app
    with TestClient(app) as client:
        ann = [client.get("/reports/1", headers={"X-Api-Key": "ann"}).status_code
               for _ in range(11)]
        bob = client.get("/reports/2", headers={"X-Api-Key": "bob"})

    assert ann == [200] * 10 + [429]
    assert bob.status_code == 200


def test_the_starlette_example_keys_api_routes_by_template(monkeypatch):
    app = load("starlette_app", monkeypatch).app
    with TestClient(app) as client:
        first = client.get("/api/users/1")
        statuses = [client.get(f"/api/users/{i}").status_code for i in range(2, 31)]
        refused = client.get("/api/users/99")

    assert first.json() == {"user": 1, "route": "/api/users/{user_id}"}
    assert statuses == [200] * 29
    assert refused.status_code == 429
