"""Where the counters live: Redis (shared by a fleet) or this process's memory."""

from ratelimit_mw.backends.memory import MemoryBackend
from ratelimit_mw.backends.redis import AsyncRedisBackend, RedisBackend

__all__ = ["AsyncRedisBackend", "MemoryBackend", "RedisBackend"]
