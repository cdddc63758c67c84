"""Redis backends: the script runs by EVALSHA on redis-py's sync, asyncio and cluster clients.

``from_url`` builds a client with defaults that keep an outage cheap. redis-py's own defaults
(5 s socket timeouts, retries with backoff) make one call against a down Redis take ~4.4 s,
and ~60 s when SYNs are dropped; a rate limiter must never hold a request that long.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

from ratelimit_mw._errors import BackendError, ConfigurationError
from ratelimit_mw._scripts import SHA1, SOURCE
from ratelimit_mw.core import ScriptCall

try:
    import redis
    import redis.asyncio
    import redis.cluster
    from redis.asyncio.retry import Retry as AsyncRetry
    from redis.backoff import NoBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import NoScriptError, RedisClusterException, RedisError
    from redis.retry import Retry
except ImportError:  # pragma: no cover - exercised only without the extra
    redis = None  # type: ignore[assignment]

try:  # the pipelined async path needs hiredis (the [hiredis] extra); without it, redis-py's
    from ratelimit_mw.backends import _pipeline
except ImportError:  # pragma: no cover - exercised only without hiredis
    _pipeline = None  # type: ignore[assignment]

# The errors a backend call may raise: redis-py's own (RedisClusterException, e.g. "cannot
# be connected", is not a RedisError), socket errors, and the builtin TimeoutError that
# asyncio.timeout raises.
_FAILURES: tuple[type[BaseException], ...] = (OSError, TimeoutError)
if redis is not None:
    _FAILURES = (RedisError, RedisClusterException, OSError, TimeoutError)
try:
    import hiredis
except ImportError:  # pragma: no cover - hiredis is the optional [hiredis] extra
    hiredis = None  # type: ignore[assignment]
if _pipeline is not None and hiredis is not None:
    _FAILURES = (*_FAILURES, hiredis.HiredisError)

SAFE_DEFAULTS: dict[str, Any] = {
    "socket_timeout": 0.1,
    "socket_connect_timeout": 0.1,
    "retry_on_timeout": False,
    "health_check_interval": 0,
}


def _require_redis() -> None:
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


def _is_cluster_url(url: str) -> bool:
    return url.startswith(("redis+cluster://", "rediss+cluster://"))


def _plain_url(url: str) -> str:
    return url.replace("+cluster://", "://", 1)


def _failure(exc: BaseException) -> BackendError:
    return BackendError(f"Redis call failed: {type(exc).__name__}: {exc}")


def _blocking_pool(pool_class: Any, url: str, kwargs: dict[str, Any]) -> Any:
    """A pool that waits (up to the socket timeout) for a free connection in a burst.

    redis-py's default pool raises past its size instead, which the middleware would take
    for an outage — turning limiting off (or answering 503) for a whole cool-down.
    """
    if "connection_pool" in kwargs:
        return kwargs["connection_pool"]
    options = dict(kwargs)
    options.setdefault("timeout", options.get("socket_timeout") or 0.1)
    options.setdefault("max_connections", 100)
    return pool_class.from_url(url, **options)


class _DeferredCluster:
    """Stands in for a RedisCluster that could not be reached at start-up; the backend
    replaces it with the real client on the first call that can build one."""

    def __init__(self, factory: Any) -> None:
        self.factory = factory

    def register_script(self, source: str) -> None:
        return None

    def __repr__(self) -> str:
        return "RedisCluster(<not connected yet>)"


def _direct(client: Any) -> bool:
    """Whether the client's pool can be driven directly (a plain pooled client)."""
    return (
        getattr(client, "connection", None) is None
        and getattr(client, "connection_pool", None) is not None
        and not getattr(client, "_single_connection_client", False)
    )


class RedisBackend:
    """Runs the script on a ``redis.Redis`` or ``redis.cluster.RedisCluster`` client.

    On a plain pooled ``redis.Redis`` the call takes the shortest path redis-py offers: a
    pooled connection, the command packed once, one send, one read — skipping the per-command
    bookkeeping of ``execute_command`` (about half of a redis-py call's CPU) while keeping the
    client's timeouts and its retry policy. NOSCRIPT (a flushed or restarted server) loads the
    script and runs it again. Cluster clients go through ``register_script``, which routes by
    key.
    """

    def __init__(self, client: Any) -> None:
        _require_redis()
        if isinstance(client, (redis.asyncio.Redis, redis.asyncio.RedisCluster)):
            raise ConfigurationError(
                "RedisBackend takes a sync client; for redis.asyncio use "
                "AsyncRedisBackend(redis.asyncio.Redis(...))"
            )
        self.client = client
        self.is_cluster = isinstance(client, (redis.cluster.RedisCluster, _DeferredCluster))
        self._script = client.register_script(SOURCE)
        self._pool: Any = None
        if not self.is_cluster and _direct(client):
            self._pool = getattr(client, "connection_pool", None)
        self._connect_lock = threading.Lock()
        self._local = threading.local()

    @classmethod
    def from_url(cls, url: str, **redis_kwargs: Any) -> RedisBackend:
        """A backend on a new client with safe timeouts; ``redis+cluster://`` for a cluster."""
        _require_redis()
        kwargs = _safe_kwargs(redis_kwargs)
        if _is_cluster_url(url):
            plain = _plain_url(url)
            try:
                return cls(redis.cluster.RedisCluster.from_url(plain, **kwargs))
            except _FAILURES:
                # The sync cluster client connects as it is built; an app must still start
                # while the cluster is down (its failure policy covers the outage), so the
                # client is built on the first call instead.
                return cls(_DeferredCluster(lambda: redis.cluster.RedisCluster.from_url(
                    plain, **kwargs)))
        return cls(redis.Redis(connection_pool=_blocking_pool(redis.BlockingConnectionPool,
                                                              url, kwargs)))

    def __repr__(self) -> str:
        return f"RedisBackend({self.client!r})"

    def run(self, call: ScriptCall) -> list[int]:
        try:
            if self._pool is None:
                if self._script is None:
                    self._build_deferred()
                return self._script(keys=call.keys, args=call.args)  # type: ignore[no-any-return]
            try:
                return self._evalsha(call)
            except NoScriptError:
                self.client.script_load(SOURCE)
                return self._evalsha(call)
        except _FAILURES as exc:
            raise _failure(exc) from exc

    def _build_deferred(self) -> None:
        with self._connect_lock:
            if self._script is None:
                client = self.client.factory()
                self._script = client.register_script(SOURCE)
                self.client = client

    def _connection(self) -> Any:
        """This thread's own connection, made from the client's pool settings.

        Taking a pooled connection and giving it back costs more than the script itself in
        redis-py 8 (deprecation and observability hooks, an event, a poll syscall); a thread
        runs one call at a time, so it keeps one connection of its own (a new one after a
        fork). Threads are bounded by the server, and so are these connections.
        """
        local = self._local
        conn = getattr(local, "conn", None)
        if conn is None or local.pid != os.getpid():
            pool = self._pool
            conn = pool.connection_class(**pool.connection_kwargs)
            local.conn, local.pid = conn, os.getpid()
        return conn

    def _evalsha(self, call: ScriptCall) -> list[int]:
        conn = self._connection()
        command = ("EVALSHA", SHA1, len(call.keys), *call.keys, *call.args)
        if hiredis is not None:
            packed = [hiredis.pack_command(command)]  # type: ignore[arg-type]
        else:
            packed = conn.pack_command(*command)

        def attempt() -> list[int]:
            conn.send_packed_command(packed, check_health=False)
            return conn.read_response()  # type: ignore[no-any-return]

        # The client's own retry policy (one immediate retry on a dropped connection when
        # built by from_url); a failed attempt drops the connection so that a late reply can
        # never be read as the answer to the next call. An error reply (NOSCRIPT, OOM) has
        # been read whole and leaves the connection in order.
        return conn.retry.call_with_retry(attempt, lambda _: conn.disconnect())  # type: ignore[no-any-return]

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.disconnect()
        self.client.close()


class AsyncRedisBackend:
    """Runs the script on a ``redis.asyncio.Redis`` or ``redis.asyncio.RedisCluster`` client.

    The client belongs to the event loop it was first used on.
    """

    def __init__(self, client: Any) -> None:
        _require_redis()
        if not isinstance(client, (redis.asyncio.Redis, redis.asyncio.RedisCluster)):
            raise ConfigurationError(
                "AsyncRedisBackend takes a redis.asyncio client; for a sync client use "
                "RedisBackend(redis.Redis(...))"
            )
        self.client = client
        self.is_cluster = isinstance(client, redis.asyncio.RedisCluster)
        self._script = client.register_script(SOURCE)
        self._pool: Any = None
        if not self.is_cluster and _direct(client):
            self._pool = getattr(client, "connection_pool", None)
        # A redis.asyncio.RedisCluster that has not initialized yet routes the commands that
        # reach it meanwhile as keyless, to one node: with concurrent first calls most of
        # them get MOVED, and the topology refreshes that follow close connections other
        # calls are using. So a cluster client is initialized once, alone, first.
        self._ready = not self.is_cluster
        self._init_lock = asyncio.Lock()
        # The fastest path: one pipelined connection per event loop (see _pipeline.py).
        self._pipe: Any = None
        if _pipeline is not None and not self.is_cluster and _pipeline.eligible(client):
            self._pipe = _pipeline.PipelinedConnection(client)

    @classmethod
    def from_url(cls, url: str, **redis_kwargs: Any) -> AsyncRedisBackend:
        """A backend on a new asyncio client with safe timeouts."""
        _require_redis()
        kwargs = _safe_kwargs(redis_kwargs, asyncio=True)
        if _is_cluster_url(url):
            if "retry_on_timeout" not in redis_kwargs:
                # redis.asyncio.RedisCluster has no such argument (TypeError); the `retry`
                # set above bounds its retries.
                del kwargs["retry_on_timeout"]
            return cls(redis.asyncio.RedisCluster.from_url(_plain_url(url), **kwargs))
        return cls(redis.asyncio.Redis(connection_pool=_blocking_pool(
            redis.asyncio.BlockingConnectionPool, url, kwargs)))

    def __repr__(self) -> str:
        return f"AsyncRedisBackend({self.client!r})"

    async def arun(self, call: ScriptCall) -> list[int]:
        try:
            if self._pipe is not None:
                return await self._pipe.evalsha(call.keys, call.args)  # type: ignore[no-any-return]
            if self._pool is None:
                if not self._ready:
                    await self._initialize()
                return await self._script(keys=call.keys, args=call.args)  # type: ignore[no-any-return]
            try:
                return await self._evalsha(call)
            except NoScriptError:
                await self.client.script_load(SOURCE)
                return await self._evalsha(call)
        except _FAILURES as exc:
            raise _failure(exc) from exc

    async def _initialize(self) -> None:
        async with self._init_lock:
            if not self._ready:
                await self.client.initialize()
                self._ready = True

    async def _evalsha(self, call: ScriptCall) -> list[int]:
        pool = self._pool
        conn = await pool.get_connection()
        try:
            packed = conn.pack_command("EVALSHA", SHA1, len(call.keys), *call.keys, *call.args)

            async def attempt() -> list[int]:
                await conn.send_packed_command(packed)
                return await conn.read_response()  # type: ignore[no-any-return]

            async def dropped(_: BaseException) -> None:
                await conn.disconnect()

            return await conn.retry.call_with_retry(attempt, dropped)  # type: ignore[no-any-return]
        except (asyncio.CancelledError, TimeoutError, OSError):
            # Cancelled (e.g. by the middleware's deadline) between send and read: the reply
            # may still arrive, so this connection must not serve another call.
            await conn.disconnect()
            raise
        finally:
            await pool.release(conn)

    async def aclose(self) -> None:
        if self._pipe is not None:
            await self._pipe.aclose()
        await self.client.aclose()
