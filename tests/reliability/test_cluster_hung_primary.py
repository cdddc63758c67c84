"""A hung cluster primary (SIGSTOP: it accepts TCP connections and answers nothing) on a
Valkey 3+3 cluster, fail closed: the identities on the healthy primaries are decided all
along, and the victim's are decided again soon after its replica is promoted.

A stopped process never gives a connection error, only timeouts: a timeout makes its node
a suspect and the slot map is asked again from the other nodes (backends/cluster.py), as
after a failover; the middleware's breaker is one per node (http/breaker.py `Breakers`),
so the sick node's open breaker refuses only the identities it serves. Measured and
recorded: how long after the promotion the victim's identities were decided again.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from redis.crc import key_slot
from starlette.responses import PlainTextResponse

import ratelimit_mw as rl
from ratelimit_mw import asgi
from ratelimit_mw.backends.cluster import parse_slots
from ratelimit_mw.core.identity import encode_identity
from reliability._support import Figures

pytestmark = pytest.mark.slow

NODE_TIMEOUT_MS = 1000  # how soon the replica takes over the stopped primary
# Bounds of the test, not of the library: the whole hang, and how long after the promotion
# the victim's identities may take to be decided again (measured: about a second).
HANG_LIMIT = 30.0
DECIDED_AGAIN_WITHIN = 10.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[object]:
    from cluster import LocalCluster  # tests/cluster.py
    from servers import valkey

    # Full coverage not required: by default every node answers CLUSTERDOWN from the
    # moment the primary is marked failed until its replica is promoted (0.5-1 s here), which
    # the failure policy covers like any failure of the store; this test is about the
    # breaker and the slot map (docs/backends.md says what the default costs).
    local = LocalCluster(tmp_path / "valkey-3x3", flavour=valkey(), replicas=1,
                         node_timeout=NODE_TIMEOUT_MS,
                         options=("--cluster-require-full-coverage", "no"))
    try:
        local.start()
        yield local
    finally:
        local.stop()  # resumes the paused primary first; bounded (SIGKILL after 5 s)


def _slot(identity: str) -> int:
    """The hash slot of an identity's keys (its encoded form is their hash tag)."""
    return key_slot(b"{%s}" % encode_identity(identity).encode())


def _client(request: Any) -> str:
    """The identity as the header says it (keys.header would prefix it): the test knows
    which node serves it."""
    return str(request.headers["x-client"])


def _owners(port: int) -> list[int]:
    """The port of the primary serving each hash slot, from CLUSTER SLOTS."""
    client = redis.Redis(port=port, socket_timeout=2)
    try:
        table = parse_slots(client.cluster("SLOTS"), ("127.0.0.1", port))
    finally:
        client.close()
    return [0 if address is None else address[1] for address in table]


async def test_a_hung_primary_is_left_for_its_replica_and_spares_the_other_nodes(
        cluster: object, prefix: str, figures: Figures) -> None:
    local = cluster
    victim = local.ports[0]  # type: ignore[attr-defined]  # the URL's node: asked first
    assert victim in local.primaries()  # type: ignore[attr-defined]
    replica = local.replica_of(victim)  # type: ignore[attr-defined]
    healthy_port = next(p for p in local.primaries() if p != victim)  # type: ignore[attr-defined]
    owners = _owners(healthy_port)
    names = [f"client-{i}" for i in range(200)]
    victims = [n for n in names if owners[_slot(n)] == victim][:4]
    healthy = [n for n in names if owners[_slot(n)] != victim][:8]
    assert len(victims) == 4 and len({owners[_slot(n)] for n in healthy}) == 2

    backend = rl.AsyncRedisBackend.from_url(local.url)  # type: ignore[attr-defined]
    middleware = asgi.RateLimitMiddleware(
        PlainTextResponse("ok"), rl.AsyncLimiter(backend, prefix=prefix),
        default="100000/minute", key=_client, on_backend_error="deny",
        # A deadline the healthy nodes meet on a loaded machine: a timeout there would be
        # a 503 too, and the victim's calls miss any deadline.
        backend_timeout=0.25)

    def promoted() -> bool:
        rows = local.nodes(healthy_port)  # type: ignore[attr-defined]
        return any(int(row["port"]) == replica and "master" in row["flags"] for row in rows)

    healthy_refused = 0
    victim_seen: Counter[int] = Counter()
    promoted_at = decided_again_at = None
    transport = httpx.ASGITransport(app=middleware)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        async def status(who: str) -> int:
            return (await client.get("/", headers={"x-client": who})).status_code

        assert [await status(who) for who in victims + healthy] == [200] * 12
        local.pause(victim)  # type: ignore[attr-defined]
        stopped = time.monotonic()
        try:
            while time.monotonic() - stopped < HANG_LIMIT:
                replies = await asyncio.gather(*map(status, healthy + victims))
                healthy_refused += sum(code != 200 for code in replies[:len(healthy)])
                victim_seen.update(replies[len(healthy):])
                now = time.monotonic()
                if promoted_at is None and await asyncio.to_thread(promoted):
                    promoted_at = now
                if promoted_at is not None and all(c == 200 for c in replies[len(healthy):]):
                    decided_again_at = now
                    break
                await asyncio.sleep(0.05)
            # The slots' new primary answers for good: every victim decided, every time.
            for _ in range(5):
                assert [await status(who) for who in victims] == [200] * len(victims)
        finally:
            local.resume(victim)  # type: ignore[attr-defined]
            await backend.aclose()

    figures.record("cluster_hung_primary", {
        "promoted_after_stop_s": None if promoted_at is None else round(
            promoted_at - stopped, 2),
        "decided_again_after_promotion_s": None if decided_again_at is None or
        promoted_at is None else round(decided_again_at - promoted_at, 2),
        "victim_statuses": dict(victim_seen), "healthy_refused": healthy_refused,
    })
    assert healthy_refused == 0  # a sick node's breaker refuses only what it serves
    assert promoted_at is not None, "the replica was never promoted"
    assert decided_again_at is not None, (
        f"the victim's identities were not decided again within {HANG_LIMIT} s of the stop "
        f"(statuses {dict(victim_seen)})")
    assert decided_again_at - promoted_at < DECIDED_AGAIN_WITHIN
    assert victim_seen[503] > 0  # the hang was seen (fail closed) before the failover
