"""`Limiter` and `AsyncLimiter`, and what the package's other modules read of them.

`AsyncLimiter` is written in `ratelimit_mw/_async/limiter.py`; `Limiter` is generated from it
(`ratelimit_mw/_sync/limiter.py`); what they share, without I/O, is `ratelimit_mw.engine`.
"""

from ratelimit_mw._async.handles import Messages
from ratelimit_mw._async.limiter import AsyncLimiter
from ratelimit_mw._sync.limiter import Limiter
from ratelimit_mw.arguments import validate_prefix
from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.engine import SWITCH, LimiterOptions, _Shared, live_limiters

__all__ = ["SWITCH", "AsyncLimiter", "Limiter", "LimiterOptions", "Messages", "_Shared",
           "live_limiters", "require_async_limiter", "require_sync_limiter", "validate_prefix"]


def require_sync_limiter(limiter: object, where: str) -> Limiter:
    if not isinstance(limiter, Limiter):
        hint = (
            "an AsyncLimiter belongs to the ASGI middleware (ratelimit_mw.asgi)"
            if isinstance(limiter, AsyncLimiter)
            else "build one with Limiter(RedisBackend.from_url(url)) or Limiter() for memory"
        )
        raise ConfigurationError(f"{where} needs a sync Limiter, got {limiter!r}; {hint}")
    return limiter


def require_async_limiter(limiter: object, where: str) -> AsyncLimiter:
    if isinstance(limiter, AsyncLimiter):
        return limiter
    hint = ("a sync Limiter would block the event loop; " if isinstance(limiter, Limiter)
            else "")
    raise ConfigurationError(
        f"{where} needs an AsyncLimiter, got {limiter!r}; {hint}write "
        "limiter=AsyncLimiter(AsyncRedisBackend.from_url(\"redis://localhost:6379/0\")) "
        "or AsyncLimiter() for the in-process memory backend"
    )
