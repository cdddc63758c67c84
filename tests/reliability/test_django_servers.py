"""Django as deployed: gunicorn (WSGI Django) and uvicorn (ASGI Django), 4 workers each, the
settings' default at ``100/minute`` on the real Redis. One client sends 200 requests at once:
exactly 100 are admitted, each with a Decision, the rest answered 429 with Retry-After. A
view's own limit (3 a minute) holds under both servers too, and a class-based view's limit
holds for its extension method (PURGE) after every worker has seen an invented one."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from reliability._django_project import LIMIT, PURGE_LIMIT
from reliability._support import AppServer, Figures, free_port
from tests.conftest import REDIS_URL, forget_prefix

pytestmark = pytest.mark.slow

BURST = 200
WORKERS = 4


@pytest.fixture(params=["gunicorn", "uvicorn"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[str, AppServer]]:
    port = free_port()
    if request.param == "gunicorn":
        argv = [sys.executable, "-m", "gunicorn", "reliability._django_project:make_wsgi()",
                "--bind", f"127.0.0.1:{port}", "--workers", str(WORKERS),
                "--worker-class", "sync", "--log-level", "warning"]
    else:
        argv = [sys.executable, "-m", "uvicorn", "reliability._django_project:make_asgi",
                "--factory", "--host", "127.0.0.1", "--port", str(port), "--workers",
                str(WORKERS), "--log-level", "warning", "--no-access-log"]
    prefix = "dj" + uuid.uuid4().hex[:10]
    server = AppServer(argv, {"RL_REDIS_URL": REDIS_URL, "RL_PREFIX": prefix}, port)
    try:
        yield request.param, server
    finally:
        server.stop()
        forget_prefix(prefix)


async def test_a_burst_of_200_admits_exactly_100_of_100_a_minute(
    served: tuple[str, AppServer], figures: Figures,
) -> None:
    name, server = served
    identity = uuid.uuid4().hex
    limits = httpx.Limits(max_connections=BURST, max_keepalive_connections=BURST)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30, limits=limits) as client:
        responses = await asyncio.gather(*(client.get("/burst", headers={"x-client": identity})
                                           for _ in range(BURST)))
    statuses = Counter(r.status_code for r in responses)
    admitted = [json.loads(r.content) for r in responses if r.status_code == 200]
    figures.record(f"django_burst.{name}.admitted_of_limit", f"{len(admitted)}/{LIMIT}")
    if statuses != Counter({200: LIMIT, 429: BURST - LIMIT}) or not all(
            body["decided"] for body in admitted):
        pytest.fail(f"{statuses}; the workers' log:\n{server.stop()[-4000:]}")
    refused = next(r for r in responses if r.status_code == 429)
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["ratelimit-policy"].endswith(";q=100;w=60")
    # The per-view limit, instead of the default, for another client.
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
        views = [await client.get("/view", headers={"x-client": identity + "v"})
                 for _ in range(5)]
    assert [r.status_code for r in views] == [200, 200, 200, 429, 429]
    assert views[0].headers["ratelimit-policy"].endswith(";q=3;w=60")


async def test_an_invented_method_never_frees_a_class_based_views_own_method(
    served: tuple[str, AppServer],
) -> None:
    _, server = served
    headers = {"x-client": uuid.uuid4().hex}
    fresh = httpx.Limits(max_keepalive_connections=0)  # every request on a new connection
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30, limits=fresh) as client:
        # PROPFIND has no handler (405): at once, so that every worker sees one first.
        first = await asyncio.gather(*(client.request("PROPFIND", "/purge", headers=headers)
                                       for _ in range(4 * WORKERS)))
        assert {r.status_code for r in first} == {405}
    purges = []
    for _ in range(20):
        # One connection for both: under keep-alive the PURGE meets the worker that has just
        # answered a PROPFIND.
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            assert (await client.request("PROPFIND", "/purge", headers=headers)
                    ).status_code == 405
            purges.append(await client.request("PURGE", "/purge", headers=headers))
    assert [r.status_code for r in purges] == [200] * PURGE_LIMIT + [429] * (20 - PURGE_LIMIT)
    assert purges[0].headers["ratelimit-policy"].endswith(f";q={PURGE_LIMIT};w=60")
