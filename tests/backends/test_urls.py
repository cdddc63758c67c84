"""Backend URLs: every accepted form builds the right client; every mistake is a
ConfigurationError at build time that shows what to write instead."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio
import redis.asyncio.sentinel
import redis.cluster
import redis.sentinel
from reliability._support import PrivateRedis

import ratelimit_mw as rl
from ratelimit_mw.backends import urls

# (url, kind, what the parsed URL holds)
VALID: list[tuple[str, str, dict[str, Any]]] = [
    ("redis://127.0.0.1:6379/0", "redis", {"client_url": "redis://127.0.0.1:6379/0", "db": 0}),
    ("redis://127.0.0.1", "redis", {"client_url": "redis://127.0.0.1/0", "db": 0}),
    ("redis://h:6379/3", "redis", {"db": 3}),
    ("redis://h:6379?db=2", "redis", {"client_url": "redis://h:6379/2", "db": 2}),
    ("redis://user:p%40ss@h:6379/1", "redis", {"client_url": "redis://user:p%40ss@h:6379/1"}),
    ("REDIS://h", "redis", {"scheme": "redis"}),
    ("rediss://h:6380/0?ssl_cert_reqs=none", "redis",
     {"client_url": "rediss://h:6380/0", "options": {"ssl_cert_reqs": "none"}}),
    ("redis://h?socket_timeout=0.5&socket_connect_timeout=2&max_connections=10", "redis",
     {"options": {"socket_timeout": 0.5, "socket_connect_timeout": 2.0,
                  "max_connections": 10}}),
    ("redis://h?socket_keepalive=true&retry_on_timeout=0&client_name=api", "redis",
     {"options": {"socket_keepalive": True, "retry_on_timeout": False, "client_name": "api"}}),
    ("unix:///run/redis.sock", "redis", {"client_url": "unix:///run/redis.sock", "db": 0}),
    ("unix://:pw@/run/redis.sock?db=4", "redis", {"client_url": "unix://:pw@/run/redis.sock",
                                                   "db": 4}),
    ("redis+cluster://10.0.0.1:7000", "cluster", {"client_url": "redis://10.0.0.1:7000/0"}),
    ("rediss+cluster://10.0.0.1:7000/0", "cluster", {"client_url": "rediss://10.0.0.1:7000/0"}),
    ("redis+sentinel://10.0.0.1:26379,10.0.0.2:26380/mymaster/2", "sentinel",
     {"sentinels": (("10.0.0.1", 26379), ("10.0.0.2", 26380)), "service": "mymaster",
      "db": 2}),
    ("redis+sentinel://s1,s2/cache", "sentinel",
     {"sentinels": (("s1", 26379), ("s2", 26379)), "service": "cache", "db": 0}),
    ("redis+sentinel://:secret@s1/cache?sentinel_password=spw&socket_timeout=0.2", "sentinel",
     {"password": "secret", "username": None,
      "options": {"sentinel_password": "spw", "socket_timeout": 0.2}}),
    ("redis+sentinel://[::1]:26379/m", "sentinel", {"sentinels": (("::1", 26379),)}),
    ("memory://", "memory", {}),
]

# (url, a fragment the message must contain); every message also shows an example.
INVALID: list[tuple[Any, str]] = [
    ("127.0.0.1:6379", "no scheme"),
    ("localhost", "no scheme"),
    ("http://127.0.0.1:6379", "unknown scheme"),
    ("memory://x", "takes no host"),
    ("memory://?size=1", "takes no host"),
    ("redis://", "no host"),
    ("redis://:6379/0", "no host"),
    ("redis://host:6379/abc", "database number"),
    ("redis://host:6379/0/1", "database number"),
    ("redis://host:port/0", "port must be a number"),
    ("redis://host:99999/0", "port must be a number"),
    ("redis://host:6379/0?bogus=1", "unknown option 'bogus'"),
    # Values redis-py would only refuse on the first call, which the middleware would take
    # for an outage (and, failing open, admit everyone): refused here, at start-up.
    ("redis://[::1:6379/0", "goes in brackets"),
    ("redis+sentinel://[::1:26379/mymaster", "goes in brackets"),
    ("redis://host:6379/0?protocol=5", "protocol must be 2 or 3"),
    ("rediss://host:6380/0?ssl_cert_reqs=bogus", "none, optional or required"),
    ("redis://host:6379/0?socket_timeout=0", "above 0"),
    ("redis://host:6379/0?socket_connect_timeout=0", "above 0"),
    ("redis://host:6379/0?client_name=api%20worker", "without spaces"),
    ("redis://host:6379/0?client_name=api worker", "without spaces"),
    ("redis://host:6379/0?sockettimeout=1", "unknown option 'sockettimeout'"),
    ("redis://host:6379/0?socket_timeout=fast", "socket_timeout must be a number of seconds"),
    ("redis://host:6379/0?socket_timeout=-1", "socket_timeout must be"),
    ("redis://host:6379/0?socket_timeout=nan", "socket_timeout must be"),
    ("redis://host:6379/0?socket_connect_timeout=", "socket_connect_timeout must be"),
    ("redis://host?max_connections=ten", "max_connections must be a whole number"),
    ("redis://host?socket_keepalive=maybe", "true or false"),
    ("redis://host?socket_timeout=1&socket_timeout=2", "given twice"),
    ("redis://host/1?db=2", "given twice"),
    ("redis://host?ssl_ca_certs=/ca.pem", "TLS options need rediss://"),
    ("redis://host?socket_timeout", "name=value"),
    ("redis://host/0#frag", "fragment"),
    ("unix://run/redis.sock", "absolute path"),
    ("unix://", "absolute path"),
    ("redis+cluster://host:7000/3", "database 0 only"),
    ("redis+cluster://h1:7000,h2:7000", "one start-up host"),
    ("redis+cluster://host:7000?timeout=1", "unknown option 'timeout'"),
    ("redis+sentinel://s1:26379", "names the service"),
    ("redis+sentinel://s1:26379/", "names the service"),
    ("redis+sentinel://s1:26379/m/x", "must be a number"),
    ("redis+sentinel://s1:26379/m/0/1", "/service or /service/db"),
    ("redis+sentinel://s1:port/m", "must be a number"),
    ("redis+sentinel:///m", "no sentinel address"),
    ("redis+sentinel://s1/m?db=1", "unknown option 'db'"),
    (6379, "a backend URL is a string"),
]


@pytest.mark.parametrize(("url", "kind", "fields"), VALID, ids=[v[0] for v in VALID])
def test_valid_urls_are_read(url: str, kind: str, fields: dict[str, Any]) -> None:
    spec = urls.parse(url)
    assert spec.kind == kind
    for name, value in fields.items():
        assert getattr(spec, name) == value, name


@pytest.mark.parametrize(("url", "fragment"), INVALID, ids=[str(v[0]) for v in INVALID])
def test_mistakes_are_configuration_errors_with_an_example(url: Any, fragment: str) -> None:
    for build in (rl.RedisBackend.from_url, rl.AsyncRedisBackend.from_url):
        with pytest.raises(rl.ConfigurationError, match=r"e\.g\.") as raised:
            build(url)
        assert fragment in str(raised.value)


def test_a_password_never_appears_in_the_message() -> None:
    with pytest.raises(rl.ConfigurationError) as raised:
        rl.RedisBackend.from_url("redis://user:hunter2@host:6379/0?bogus=1")
    assert "hunter2" not in str(raised.value) and "user:***@host" in str(raised.value)


def test_memory_url_gives_a_memory_backend_and_takes_no_options() -> None:
    assert isinstance(rl.RedisBackend.from_url("memory://"), rl.MemoryBackend)
    assert isinstance(rl.AsyncRedisBackend.from_url("memory://"), rl.MemoryBackend)
    with pytest.raises(rl.ConfigurationError, match="memory:// takes no client options"):
        rl.RedisBackend.from_url("memory://", socket_timeout=1)


# -- what gets built (no connection is made) --------------------------------------------------
def pool_kwargs(backend: Any) -> dict[str, Any]:
    return backend.client.connection_pool.connection_kwargs  # type: ignore[no-any-return]


@pytest.mark.parametrize("build", [rl.RedisBackend.from_url, rl.AsyncRedisBackend.from_url],
                         ids=["sync", "async"])
def test_url_options_override_the_safe_defaults_and_keywords_override_both(build: Any) -> None:
    backend = build("redis://127.0.0.1:6379/2?socket_timeout=0.25&client_name=api")
    kwargs = pool_kwargs(backend)
    assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"]) == (0.25, 0.1)
    assert (kwargs["db"], kwargs["client_name"]) == (2, "api")
    backend = build("redis://127.0.0.1:6379/0?socket_timeout=0.25", socket_timeout=0.5)
    assert pool_kwargs(backend)["socket_timeout"] == 0.5


@pytest.mark.parametrize(("build", "module"), [
    (rl.RedisBackend.from_url, redis), (rl.AsyncRedisBackend.from_url, redis.asyncio),
], ids=["sync", "async"])
def test_tls_and_unix_socket_urls_build_those_connections(build: Any, module: Any) -> None:
    tls = build("rediss://127.0.0.1:6380/0?ssl_cert_reqs=none")
    assert tls.client.connection_pool.connection_class is module.SSLConnection
    assert pool_kwargs(tls)["ssl_cert_reqs"] == "none"
    unix = build("unix:///tmp/nothing.sock?db=3")
    assert unix.client.connection_pool.connection_class is module.UnixDomainSocketConnection
    assert (pool_kwargs(unix)["path"], pool_kwargs(unix)["db"]) == ("/tmp/nothing.sock", 3)
    assert pool_kwargs(unix)["socket_timeout"] == 0.1


@pytest.mark.parametrize(("build", "pool_class"), [
    (rl.RedisBackend.from_url, redis.sentinel.SentinelConnectionPool),
    (rl.AsyncRedisBackend.from_url, redis.asyncio.sentinel.SentinelConnectionPool),
], ids=["sync", "async"])
def test_a_sentinel_url_builds_a_sentinel_managed_client_with_safe_timeouts(
    build: Any, pool_class: type,
) -> None:
    backend = build("redis+sentinel://:pw@127.0.0.1:1,127.0.0.1:2/mymaster/1"
                    "?sentinel_password=spw")
    pool = backend.client.connection_pool
    assert isinstance(pool, pool_class) and pool.service_name == "mymaster"
    kwargs = pool.connection_kwargs
    assert (kwargs["db"], kwargs["password"], kwargs["socket_timeout"]) == (1, "pw", 0.1)
    sentinels = pool.sentinel_manager.sentinels
    assert [s.connection_pool.connection_kwargs["port"] for s in sentinels] == [1, 2]
    assert sentinels[0].connection_pool.connection_kwargs["password"] == "spw"
    assert sentinels[0].connection_pool.connection_kwargs["socket_timeout"] == 0.1


async def test_a_unix_socket_url_reaches_redis(tmp_path: Path, prefix: str) -> None:
    socket_path = tmp_path / "redis.sock"
    server = PrivateRedis("--unixsocket", str(socket_path), "--unixsocketperm", "700").start()
    try:
        sync_backend = rl.RedisBackend.from_url(f"unix://{socket_path}?db=1")
        assert [rl.Limiter(sync_backend, prefix=prefix).hit("2/minute", "u").allowed
                for _ in range(3)] == [True, True, False]
        assert sync_backend.ping()["backend"] == "redis"
        async_backend = rl.AsyncRedisBackend.from_url(f"unix://{socket_path}?db=1")
        assert not (await rl.AsyncLimiter(async_backend, prefix=prefix).hit("2/minute", "u"))
        assert server.client(db=1).keys(f"{prefix}:*")  # in the database the URL named
        await async_backend.aclose()
        sync_backend.close()
    finally:
        server.kill()
