"""A decorated endpoint's counter is named after its module's full dotted name.

Two modules of one last name (``pkga/api.py`` and ``pkgb/api.py``, every Django app's
``views.py``) hold endpoints of one name: their counters must differ, or the second route is
refused once the first has spent the quota. And the name is the same however the app is
started: ``python pkg/app.py``, ``python -m pkg.app`` and an import as ``pkg.app`` (what
``uvicorn pkg.app:app`` does).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from ratelimit_mw.asgi import RateLimitMiddleware
from ratelimit_mw.routing import route_limits

_PACKAGES = ("rlnames_pkga", "rlnames_pkgb", "rlnames_limits")


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


@pytest.fixture
def two_api_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``rlnames_pkga.api`` and ``rlnames_pkgb.api``, each with a router whose ``items`` is
    limited to 2/minute by one shared limiter (``rlnames_limits.limiter``)."""
    files = {"rlnames_limits.py": "from ratelimit_mw import AsyncLimiter\n"
                                  "limiter = AsyncLimiter()\n"}
    for package, prefix in (("rlnames_pkga", "/a"), ("rlnames_pkgb", "/b")):
        files[f"{package}/__init__.py"] = ""
        files[f"{package}/api.py"] = f"""
            from fastapi import APIRouter
            from rlnames_limits import limiter

            router = APIRouter(prefix="{prefix}")

            @router.get("/items")
            @limiter.limit("2/minute")
            async def items() -> dict[str, str]:
                return {{}}
            """
    _write(tmp_path, files)
    monkeypatch.syspath_prepend(str(tmp_path))
    import rlnames_limits  # type: ignore[import-not-found]
    import rlnames_pkga.api  # type: ignore[import-not-found]
    import rlnames_pkgb.api  # type: ignore[import-not-found]

    yield rlnames_limits.limiter, rlnames_pkga.api, rlnames_pkgb.api
    for name in [name for name in sys.modules if name.split(".")[0] in _PACKAGES]:
        del sys.modules[name]


def test_endpoints_of_one_name_in_modules_of_one_name_count_apart(two_api_modules: Any) -> None:
    limiter, api_a, api_b = two_api_modules
    app = FastAPI()
    app.include_router(api_a.router)
    app.include_router(api_b.router)
    app.add_middleware(RateLimitMiddleware, limiter=limiter)
    with TestClient(app) as client:
        assert [client.get("/a/items").status_code for _ in range(3)] == [200, 200, 429]
        assert [client.get("/b/items").status_code for _ in range(3)] == [200, 200, 429]
    assert [limit.policy.name for limit in (*route_limits(api_a.items),  # type: ignore[misc]
                                            *route_limits(api_b.items))] == [
        "route rlnames_pkga.api.items 2/minute", "route rlnames_pkgb.api.items 2/minute"]


def test_django_views_of_one_name_in_two_apps_count_apart() -> None:
    """Function views and class-based views (named through the class) alike."""
    from support.django_site import configure

    configure()
    from django.utils.decorators import method_decorator
    from django.views import View

    from ratelimit_mw.django import limit
    from ratelimit_mw.django.decorators import view_limits

    names = []
    for module in ("shop.views", "blog.views"):
        def index(request: Any) -> None: ...

        class Page(View):
            def get(self, request: Any) -> None: ...

        index.__module__ = Page.__module__ = module  # as if written in <app>/views.py
        index.__qualname__, Page.__qualname__ = "index", "Page"
        limit("5/minute")(index)
        method_decorator(limit("5/minute"), name="get")(Page)
        for view in (index, Page.as_view()):
            found = view_limits(view, "GET")
            assert isinstance(found, tuple)
            names.append(found[0].policy.name)
    assert names == ["route shop.views.index 5/minute", "route shop.views.Page.get 5/minute",
                     "route blog.views.index 5/minute", "route blog.views.Page.get 5/minute"]


_APP = """
    from ratelimit_mw import AsyncLimiter
    from ratelimit_mw.routing import route_limits

    limiter = AsyncLimiter()

    @limiter.limit("5/minute")
    async def report() -> None: ...

    def counter() -> str:
        return route_limits(report)[0].policy.name

    if __name__ == "__main__":
        print(counter())
    """


def test_the_name_is_the_same_however_the_app_is_started(tmp_path: Path) -> None:
    """A module in a package (``shop/app.py``) and a top-level one (``app.py``): run as a
    script, with ``-m``, and imported."""
    _write(tmp_path / "packaged", {"shop/__init__.py": "", "shop/app.py": _APP})
    _write(tmp_path / "flat", {"app.py": _APP})
    for root, module in (("packaged", "shop.app"), ("flat", "app")):
        started = {
            "script": [sys.executable, module.replace(".", "/") + ".py"],
            "-m": [sys.executable, "-m", module],
            "import": [sys.executable, "-c", f"import {module} as m; print(m.counter())"],
        }
        names = {how: subprocess.run(argv, cwd=tmp_path / root, capture_output=True, text=True,
                                     check=True, timeout=60).stdout.strip()
                 for how, argv in started.items()}
        assert names == dict.fromkeys(started, f"route {module}.report 5/minute")
