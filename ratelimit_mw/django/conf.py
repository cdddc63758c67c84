"""``settings.RATELIMIT``: read and checked once, turned into a `Config` and the limiters.

    RATELIMIT = {
        "default": "100/minute",                    # any keyword of ratelimit_mw's Config
        "rules": [Rule("/login", "5/minute", methods=["POST"])],
        "backend": "redis://127.0.0.1:6379/0",      # a URL (urls.py); memory:// when absent
        "prefix": "rl",                             # the keys' prefix in the store
    }

``limiter`` (a `Limiter`) and ``async_limiter`` (an `AsyncLimiter`) may be given instead of
``backend`` and ``prefix``: a limiter of the app's own (a metrics hook, a test clock, its own
Redis client). The sync one serves WSGI Django and `is_ratelimited`, the async one ASGI
Django and `ais_ratelimited`, each through one `Guard` (breaker, deadline, failure policy)
that the middleware and the view functions share. Pure reading: no I/O until a limiter is
first asked.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ratelimit_mw.backends.memory import MemoryBackend
from ratelimit_mw.backends.redis import AsyncRedisBackend, RedisBackend
from ratelimit_mw.backends.urls import parse as parse_url
from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.core.policy import SharedLogs
from ratelimit_mw.django.legacy import check_key
from ratelimit_mw.http.config import OPTION_NAMES, Config
from ratelimit_mw.http.guard import Guard
from ratelimit_mw.keys import DJANGO
from ratelimit_mw.limiter import AsyncLimiter, Limiter, validate_prefix

#: The keys of ``RATELIMIT`` beside Config's keywords.
EXTRA_NAMES = ("backend", "prefix", "limiter", "async_limiter")
NAMES = (*OPTION_NAMES, *EXTRA_NAMES)
DEFAULT_BACKEND = "memory://"

#: The sliding-log names of every policy the Django adapter configures (decorators, the
#: settings' default and rules): one log per name, whatever limiter counts it.
SHARED_LOGS = SharedLogs()


@dataclass(frozen=True)
class Settings:
    """``settings.RATELIMIT``, checked."""

    config: Config
    backend: str
    prefix: str
    limiter: Limiter | None
    async_limiter: AsyncLimiter | None


def read(raw: object) -> Settings:
    """Check ``settings.RATELIMIT`` (None: not set); ConfigurationError says what to write."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigurationError(
            f'settings.RATELIMIT must be a dict, e.g. RATELIMIT = {{"default": "100/minute"}}; '
            f"got {type(raw).__name__}"
        )
    unknown = sorted(str(name) for name in raw if name not in NAMES)
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, NAMES, n=1)
            hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ConfigurationError(
            f"settings.RATELIMIT has unknown key {', '.join(hints)}; the keys are "
            f"{', '.join(NAMES)}"
        )
    check_key(raw.get("key"), 'settings.RATELIMIT["key"]')
    options = {name: value for name, value in raw.items() if name in OPTION_NAMES}
    config = Config(**options)
    backend = raw.get("backend", DEFAULT_BACKEND)
    if not isinstance(backend, str):
        raise ConfigurationError(
            f'settings.RATELIMIT["backend"] is a URL such as "redis://127.0.0.1:6379/0" or '
            f'"memory://", got {backend!r}; for a client of your own give "limiter" and '
            f'"async_limiter"'
        )
    parse_url(backend)  # a malformed URL fails here, at start-up
    prefix = raw.get("prefix", "rl")
    limiter = raw.get("limiter")
    if limiter is not None and not isinstance(limiter, Limiter):
        raise ConfigurationError(
            f'settings.RATELIMIT["limiter"] must be a ratelimit_mw Limiter, got {limiter!r}; '
            f'an AsyncLimiter goes under "async_limiter"'
        )
    async_limiter = raw.get("async_limiter")
    if async_limiter is not None and not isinstance(async_limiter, AsyncLimiter):
        raise ConfigurationError(
            f'settings.RATELIMIT["async_limiter"] must be a ratelimit_mw AsyncLimiter, got '
            f'{async_limiter!r}; a sync Limiter goes under "limiter"'
        )
    validate_prefix(prefix)
    SHARED_LOGS.add([*config.defaults, *(rule.policy for rule in config.rule_list
                                         if rule.policy is not None)])
    return Settings(config, backend, prefix, limiter, async_limiter)


class Limiters:
    """The limiters ``settings.RATELIMIT`` names and their guards, built on first use and
    kept: one store connection, one breaker and one failure policy per process and side,
    whatever asks (the middleware, `is_ratelimited`)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._sync: Limiter | None = settings.limiter
        self._async: AsyncLimiter | None = settings.async_limiter
        self._memory: MemoryBackend | None = None
        self._sync_guard: Guard | None = None
        self._async_guard: Guard | None = None

    def _adopt(self, limiter: Any) -> Any:
        # Decorators and the settings record their sliding logs in one place.
        limiter.shared_logs = SHARED_LOGS
        return limiter

    def _shared_memory(self) -> MemoryBackend | None:
        """memory://: one MemoryBackend for both sides of this process."""
        if parse_url(self.settings.backend).kind != "memory":
            return None
        if self._memory is None:
            self._memory = MemoryBackend()
        return self._memory

    def sync(self) -> Limiter:
        if self._sync is None:
            backend = self._shared_memory() or RedisBackend.from_url(self.settings.backend)
            self._sync = self._adopt(Limiter(backend, prefix=self.settings.prefix))
        return self._sync

    def asynchronous(self) -> AsyncLimiter:
        if self._async is None:
            backend = (self._shared_memory()
                       or AsyncRedisBackend.from_url(self.settings.backend))
            self._async = self._adopt(AsyncLimiter(backend, prefix=self.settings.prefix))
        return self._async

    def sync_guard(self) -> Guard:
        """The sync side's guard (WSGI Django's middleware, `is_ratelimited`): no deadline,
        nothing awaited (an async hook in the settings is a ConfigurationError)."""
        if self._sync_guard is None:
            self._sync_guard = Guard(self.settings.config, self.sync(), timeout=None,
                                     awaits="Django under WSGI (or is_ratelimited)",
                                     requests=DJANGO)
        return self._sync_guard

    def async_guard(self) -> Guard:
        """The async side's guard (ASGI Django's middleware, `ais_ratelimited`): every store
        call within ``backend_timeout``."""
        if self._async_guard is None:
            limiter = self.asynchronous()
            self._async_guard = Guard(
                self.settings.config, limiter,
                timeout=self.settings.config.backend_timeout, requests=DJANGO)
        return self._async_guard


_current: tuple[object, Limiters] | None = None


def current() -> Limiters:
    """The limiters of the settings in force (read again when ``RATELIMIT`` changes, as
    ``override_settings`` does in tests)."""
    global _current
    from django.conf import settings

    raw = getattr(settings, "RATELIMIT", None)
    found = _current
    if found is not None and found[0] is raw:
        return found[1]
    made = Limiters(read(raw))
    _current = (raw, made)
    return made
