"""ratelimit_mw: rate-limit middleware for ASGI and WSGI apps, on Redis or in memory.

    import ratelimit_mw as rl
    limiter = rl.Limiter(rl.RedisBackend.from_url("redis://localhost:6379/0"))
    decision = limiter.hit(rl.Policy("10/minute"), "user:42")
"""

from ratelimit_mw import keys
from ratelimit_mw._async.handles import AsyncTicket
from ratelimit_mw._sync.handles import Ticket
from ratelimit_mw.backends import AsyncRedisBackend, MemoryBackend, RedisBackend
from ratelimit_mw.core.codec import Check
from ratelimit_mw.core.decision import Booking, Decision, TierState
from ratelimit_mw.core.errors import BackendError, ConfigurationError, RateLimitExceeded
from ratelimit_mw.core.policy import ALGORITHMS, Policy
from ratelimit_mw.core.rates import Rate
from ratelimit_mw.limiter import AsyncLimiter, Limiter

__version__ = "0.1.0"

__all__ = [
    "ALGORITHMS",
    "AsyncLimiter",
    "AsyncRedisBackend",
    "AsyncTicket",
    "BackendError",
    "Booking",
    "Check",
    "ConfigurationError",
    "Decision",
    "Limiter",
    "MemoryBackend",
    "Policy",
    "Rate",
    "RateLimitExceeded",
    "RedisBackend",
    "Ticket",
    "TierState",
    "__version__",
    "keys",
]
