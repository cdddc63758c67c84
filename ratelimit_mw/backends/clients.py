"""The redis-py (and valkey-py) clients the Redis backends are given or build.

``from_url`` builds a client with defaults that keep an outage cheap: redis-py's own (5 s
socket timeouts, retries with backoff) would hold a request for seconds against a down Redis.
The clients of valkey-py (redis-py's fork: the same API, classes of its own) are accepted
wherever redis-py's are (`Valkey`). A client is named in messages by `describe`, never by its
repr.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from ratelimit_mw.backends import urls
from ratelimit_mw.backends.memory import MemoryBackend
from ratelimit_mw.core.errors import ConfigurationError

try:
    import redis
    import redis.asyncio
    import redis.asyncio.sentinel
    import redis.cluster
    import redis.sentinel
    from redis.asyncio.retry import Retry as AsyncRetry
    from redis.backoff import NoBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.retry import Retry
except ImportError:  # pragma: no cover - exercised only without the extra
    redis = None  # type: ignore[assignment]

SAFE_DEFAULTS: dict[str, Any] = {
    "socket_timeout": 0.1,
    "socket_connect_timeout": 0.1,
    "retry_on_timeout": False,
    "health_check_interval": 0,
}
# A TLS handshake can outlast 100 ms on a busy host; it happens once per connection, and an
# async request waits for it a few of its own deadlines at most (pipeline.CONNECT_DEADLINES).
TLS_CONNECT_TIMEOUT = 1.0


class Valkey:
    """valkey-py's classes, where redis-py's are checked; looked up only once the process has
    imported valkey, so valkey stays optional and free to apps that do not use it."""

    @staticmethod
    def classes(*names: str) -> tuple[type, ...]:
        """valkey-py's classes by dotted name ("asyncio.Valkey"), none without valkey."""
        if "valkey" not in sys.modules:
            return ()
        found = []
        for name in names:
            module, _, attribute = f"valkey.{name}".rpartition(".")
            found.append(getattr(importlib.import_module(module), attribute))
        return tuple(found)

    @classmethod
    def owns(cls, client: Any) -> bool:
        return isinstance(client, cls.classes("Valkey", "cluster.ValkeyCluster",
                                              "asyncio.Valkey", "asyncio.ValkeyCluster"))

    @classmethod
    def errors(cls) -> tuple[type[BaseException], ...]:
        """What a valkey-py client raises, besides socket errors: its own exception tree
        (ValkeyClusterException, like redis-py's, is not a ValkeyError)."""
        return cls.classes("exceptions.ValkeyError", "exceptions.ValkeyClusterException")

    @staticmethod
    def redis_twin(connection_class: type) -> type:
        """The redis-py class that a valkey-py connection class (or a subclass of one) copies:
        the fork keeps redis-py's module and class names and their options. What
        settings.Settings reads to mirror a client (its transport); any other class as it is."""
        for klass in connection_class.__mro__:
            module = klass.__module__
            if module.startswith("valkey."):
                twin = getattr(importlib.import_module("redis" + module[len("valkey"):]),
                               klass.__name__, None)
                if isinstance(twin, type):
                    return twin
        return connection_class


def require_redis() -> None:
    if redis is None:
        raise ConfigurationError(
            "the Redis backend needs redis-py: pip install 'ratelimit_mw[redis]'"
        )


def _safe_kwargs(overrides: dict[str, Any], *, asyncio: bool = False) -> dict[str, Any]:
    kwargs = dict(SAFE_DEFAULTS)
    # One immediate retry on a dropped connection (survives a Redis restart), none on timeouts.
    retry_class = AsyncRetry if asyncio else Retry
    kwargs["retry"] = retry_class(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
    kwargs.update(overrides)
    return kwargs


def client_kwargs(spec: urls.BackendURL, overrides: dict[str, Any], *,
                  asyncio: bool = False) -> dict[str, Any]:
    """Safe defaults, then the URL's options, then the caller's keyword arguments."""
    options = {k: v for k, v in spec.options.items()
               if k not in ("db", "sentinel_username", "sentinel_password")}
    if spec.tls:
        options.setdefault("socket_connect_timeout", TLS_CONNECT_TIMEOUT)
    return _safe_kwargs({**options, **overrides}, asyncio=asyncio)


def label(client: Any, *, asyncio: bool) -> str:
    """The backend's name in ``ping()``'s report: "redis-sentinel" or "redis"."""
    pool = getattr(client, "connection_pool", None)
    sentinel_pools = ((redis.asyncio.sentinel.SentinelConnectionPool,
                       *Valkey.classes("asyncio.sentinel.SentinelConnectionPool"))
                      if asyncio else (redis.sentinel.SentinelConnectionPool,
                                       *Valkey.classes("sentinel.SentinelConnectionPool")))
    return "redis-sentinel" if isinstance(pool, sentinel_pools) else "redis"


def memory_backend(redis_kwargs: dict[str, Any]) -> MemoryBackend:
    if redis_kwargs:
        raise ConfigurationError(
            f"memory:// takes no client options, got {sorted(redis_kwargs)}; "
            "write RedisBackend.from_url(\"memory://\") alone"
        )
    return MemoryBackend()


def describe(client: Any) -> str:
    """The store a client talks to, as a URL without credentials (never its repr, which is
    a page of pool internals)."""
    family = "valkey" if Valkey.owns(client) else "redis"
    try:
        if isinstance(client, DeferredCluster):
            return client.where
        if hasattr(client, "get_default_node") or hasattr(client, "nodes_manager"):
            nodes = getattr(client, "startup_nodes", None) or getattr(
                getattr(client, "nodes_manager", None), "startup_nodes", {})
            names = [getattr(node, "name", str(node)) for node in
                     (nodes.values() if isinstance(nodes, dict) else nodes)]
            return f"{family}+cluster://" + ",".join(names)
        pool = client.connection_pool
        service = getattr(pool, "service_name", None)
        if service is not None:
            sentinels = [f"{c.connection_pool.connection_kwargs.get('host')}:"
                         f"{c.connection_pool.connection_kwargs.get('port')}"
                         for c in pool.sentinel_manager.sentinels]
            return f"{family}+sentinel://{','.join(sentinels)}/{service}"
        kwargs = pool.connection_kwargs
        db = kwargs.get("db", 0)
        if kwargs.get("path"):
            return f"{'valkey+' if family == 'valkey' else ''}unix://{kwargs['path']}?db={db}"
        tls = "SSL" in getattr(pool.connection_class, "__name__", "")
        scheme = f"{family}s" if tls else family
        return f"{scheme}://{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}/{db}"
    except Exception:  # an unusual client: its type says enough
        return type(client).__name__


def blocking_pool(pool_class: Any, url: str, kwargs: dict[str, Any]) -> Any:
    """The client's own pool, for whoever uses the client besides the checks (which take
    their own connections): one that waits up to the socket timeout for a free connection,
    where redis-py's default pool raises past its size."""
    if "connection_pool" in kwargs:
        return kwargs["connection_pool"]
    options = dict(kwargs)
    options.setdefault("timeout", options.get("socket_timeout") or 0.1)
    options.setdefault("max_connections", 100)
    return pool_class.from_url(url, **options)


class DeferredCluster:
    """Stands in for a RedisCluster that could not be reached at start-up; the backend
    replaces it with the real client on the first call that can build one."""

    def __init__(self, factory: Any, where: str) -> None:
        self.factory = factory
        self.where = where  # the URL, redacted: for messages

    def register_script(self, source: str) -> None:
        return None

    def __repr__(self) -> str:
        return "RedisCluster(<not connected yet>)"
