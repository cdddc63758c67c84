"""Redis backends: the script runs by EVALSHA on redis-py's sync, asyncio and cluster clients.

``from_url`` builds a client with defaults that keep an outage cheap. redis-py's own defaults
(5 s socket timeouts, retries with backoff) make one call against a down Redis take ~4.4 s,
and ~60 s when SYNs are dropped; a rate limiter must never hold a request that long.
"""

from __future__ import annotations

from typing import Any

from ratelimit_mw._errors import BackendError, ConfigurationError
from ratelimit_mw._scripts import SOURCE
from ratelimit_mw.core import ScriptCall

try:
    import redis
    import redis.asyncio
    import redis.cluster
    from redis.asyncio.retry import Retry as AsyncRetry
    from redis.backoff import NoBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import RedisError
    from redis.retry import Retry
except ImportError:  # pragma: no cover - exercised only without the extra
    redis = None  # type: ignore[assignment]

# The errors a backend call may raise: redis-py's own, socket errors, and the builtin
# TimeoutError that asyncio.timeout raises.
_FAILURES: tuple[type[BaseException], ...] = (OSError, TimeoutError)
if redis is not None:
    _FAILURES = (RedisError, OSError, TimeoutError)

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


class RedisBackend:
    """Runs the script on a ``redis.Redis`` or ``redis.cluster.RedisCluster`` client."""

    def __init__(self, client: Any) -> None:
        _require_redis()
        if isinstance(client, (redis.asyncio.Redis, redis.asyncio.RedisCluster)):
            raise ConfigurationError(
                "RedisBackend takes a sync client; for redis.asyncio use "
                "AsyncRedisBackend(redis.asyncio.Redis(...))"
            )
        self.client = client
        self.is_cluster = isinstance(client, redis.cluster.RedisCluster)
        self._script = client.register_script(SOURCE)

    @classmethod
    def from_url(cls, url: str, **redis_kwargs: Any) -> RedisBackend:
        """A backend on a new client with safe timeouts; ``redis+cluster://`` for a cluster."""
        _require_redis()
        kwargs = _safe_kwargs(redis_kwargs)
        if _is_cluster_url(url):
            return cls(redis.cluster.RedisCluster.from_url(_plain_url(url), **kwargs))
        return cls(redis.Redis.from_url(url, **kwargs))

    def __repr__(self) -> str:
        return f"RedisBackend({self.client!r})"

    def run(self, call: ScriptCall) -> list[int]:
        try:
            return self._script(keys=call.keys, args=call.args)  # type: ignore[no-any-return]
        except _FAILURES as exc:
            raise _failure(exc) from exc

    def close(self) -> None:
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

    @classmethod
    def from_url(cls, url: str, **redis_kwargs: Any) -> AsyncRedisBackend:
        """A backend on a new asyncio client with safe timeouts."""
        _require_redis()
        kwargs = _safe_kwargs(redis_kwargs, asyncio=True)
        if _is_cluster_url(url):
            return cls(redis.asyncio.RedisCluster.from_url(_plain_url(url), **kwargs))
        return cls(redis.asyncio.Redis.from_url(url, **kwargs))

    def __repr__(self) -> str:
        return f"AsyncRedisBackend({self.client!r})"

    async def arun(self, call: ScriptCall) -> list[int]:
        try:
            return await self._script(keys=call.keys, args=call.args)  # type: ignore[no-any-return]
        except _FAILURES as exc:
            raise _failure(exc) from exc

    async def aclose(self) -> None:
        await self.client.aclose()
