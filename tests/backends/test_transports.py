"""Every transport takes the one connection design and counts exactly: TCP, TLS (a
certificate this run makes), a unix socket, the primary that real sentinels name, and the
3-node cluster, then Valkey 8 single node, Sentinel and cluster (valkey:// URLs), each built
by ``from_url`` (the defaults, but for a second to read).

The bursts are larger than any pool redis-py would have given them, sync and async: each
must admit exactly the limit with no error (over TLS a pool per burst once timed out its
handshakes into fail-open: 3 admitted and 47 BackendErrors of 50 at 20/minute).
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
from transports import TRANSPORTS, transport_url

import ratelimit_mw as rl

pytestmark = pytest.mark.slow

BURST = 60
LIMIT = 20
# Reads get a second (connects keep the defaults: 100 ms, 1 s over TLS): the claim is about
# connections, and a loaded CI machine answering in more than 100 ms is no pool failure.
READ_TIMEOUT = 1.0


def outcome(result: object) -> str:
    if isinstance(result, rl.Decision):
        return "admitted" if result.allowed else "refused"
    return type(result).__name__


@pytest.fixture(params=TRANSPORTS)
def url(request: pytest.FixtureRequest) -> str:
    return transport_url(request, request.param)


@pytest.mark.parametrize("algorithm", ["sliding-log", "gcra"])
async def test_an_async_burst_admits_exactly_the_limit(url: str, algorithm: str) -> None:
    backend = rl.AsyncRedisBackend.from_url(url, socket_timeout=READ_TIMEOUT)
    limiter = rl.AsyncLimiter(backend, prefix="tt" + uuid.uuid4().hex[:10])
    policy = rl.Policy(f"{LIMIT}/minute", algorithm=algorithm)
    try:
        results = await asyncio.gather(*(limiter.hit(policy, "burst") for _ in range(BURST)),
                                       return_exceptions=True)
        assert Counter(map(outcome, results)) == {"admitted": LIMIT, "refused": BURST - LIMIT}
        await limiter.reset(policy, "burst")
    finally:
        await backend.aclose()


def test_a_threaded_sync_burst_admits_exactly_the_limit(url: str) -> None:
    backend = rl.RedisBackend.from_url(url, socket_timeout=READ_TIMEOUT)
    limiter = rl.Limiter(backend, prefix="tt" + uuid.uuid4().hex[:10])

    def hit(_: int) -> object:
        try:
            return limiter.hit(f"{LIMIT}/minute", "burst")
        except rl.BackendError as exc:
            return exc

    try:
        with ThreadPoolExecutor(max_workers=12) as pool:
            results = list(pool.map(hit, range(BURST)))
        assert Counter(map(outcome, results)) == {"admitted": LIMIT, "refused": BURST - LIMIT}
        limiter.reset(f"{LIMIT}/minute", "burst")
    finally:
        backend.close()


@pytest.mark.parametrize("transport", ["tls", "unix", "sentinel"])
async def test_a_burst_is_one_connection_per_event_loop(
    request: pytest.FixtureRequest, transport: str,
) -> None:
    """A TLS handshake once per connection, not per burst: the server sees one client of
    the backend however many calls are in flight."""
    name = "tt" + uuid.uuid4().hex[:10]
    url = transport_url(request, transport)
    backend = rl.AsyncRedisBackend.from_url(url + ("&" if "?" in url else "?")
                                            + f"client_name={name}")
    limiter = rl.AsyncLimiter(backend, prefix=name)
    try:
        await asyncio.gather(*(limiter.hit("1000/minute", "burst") for _ in range(200)))
        local = request.getfixturevalue(
            "redis_sentinel" if transport == "sentinel" else "redis_transports")
        port = local.primary() if transport == "sentinel" else local.port
        inspector = redis.Redis(port=port, socket_timeout=2)
        try:
            clients = [c for c in inspector.client_list() if c["name"] == name]
        finally:
            inspector.close()
        assert len(clients) == 1, clients
        await limiter.reset("1000/minute", "burst")
    finally:
        await backend.aclose()


async def test_tls_verifies_the_servers_certificate(redis_transports: object) -> None:
    """Without the certificate that signed the server's, the start-up check fails (redis-py's
    default is to verify) instead of talking to whoever answers."""
    unverified = redis_transports.tls_url.split("?", 1)[0]  # type: ignore[attr-defined]
    backend = rl.AsyncRedisBackend.from_url(unverified)
    with pytest.raises(rl.BackendError, match=r"CERTIFICATE_VERIFY_FAILED|certificate"):
        await backend.aping()
    await backend.aclose()
    sync_backend = rl.RedisBackend.from_url(unverified)
    with pytest.raises(rl.BackendError, match=r"CERTIFICATE_VERIFY_FAILED|certificate"):
        sync_backend.ping()
    sync_backend.close()


async def test_the_start_up_check_names_the_transport_it_reached(url: str) -> None:
    backend = rl.AsyncRedisBackend.from_url(url)
    try:
        report = await backend.aping()
    finally:
        await backend.aclose()
    expected = {"sentinel": "redis-sentinel", "cluster": "redis-cluster"}
    kind = next((k for k in expected if k in url), None)
    assert report["backend"] == expected.get(kind or "", "redis")
    assert report["version"] and report["rtt_ms"] >= 0
    # Valkey's own version, not the Redis version it reports itself compatible with.
    server = "valkey" if url.startswith("valkey") else "redis"
    assert (report["server"], report["version"].startswith("8.")) == (server, server == "valkey")


@pytest.mark.parametrize("on_backend_error", ["allow", "deny"])
async def test_a_burst_through_the_middleware_is_decided_request_by_request(
    url: str, on_backend_error: str,
) -> None:
    """400 requests at once through the ASGI middleware, after the start-up check: exactly
    the limit admitted, the rest refused, none let through or answered 503 by the failure
    policy on a healthy Redis. (Before the one connection design, at the defaults: TLS 400
    admitted, or 351 503s; Sentinel 400, or 382 503s.) Timeouts of a second: the claim is
    about connections, and a loaded CI machine whose Redis answers 400 calls in more than
    100 ms must not be mistaken for a pool failure (tests/reliability/test_transport_burst.py
    holds the defaults, through uvicorn)."""
    import httpx
    from starlette.responses import PlainTextResponse

    from ratelimit_mw import asgi, keys

    backend = rl.AsyncRedisBackend.from_url(url, socket_timeout=READ_TIMEOUT)
    await backend.aping()
    middleware = asgi.RateLimitMiddleware(
        PlainTextResponse("ok"), rl.AsyncLimiter(backend, prefix="tt" + uuid.uuid4().hex[:10]),
        default="100/minute", key=keys.header("x-client"), on_backend_error=on_backend_error,
        backend_timeout=1.0)
    transport = httpx.ASGITransport(app=middleware)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            responses = await asyncio.gather(*(client.get("/", headers={"x-client": "burst"})
                                               for _ in range(400)))
        assert Counter(r.status_code for r in responses) == {200: 100, 429: 300}
        await middleware.limiter.reset(rl.Policy("100/minute"), "h:x-client:burst")
    finally:
        await backend.aclose()
