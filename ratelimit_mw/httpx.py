"""Throttle outbound HTTP calls made with httpx: every call first waits for its quota.

    import httpx
    from ratelimit_mw import Limiter, Policy, RedisBackend
    from ratelimit_mw.httpx import RateLimitTransport

    limiter = Limiter(RedisBackend.from_url("redis://localhost:6379/0"))
    client = httpx.Client(transport=RateLimitTransport(
        limiter, Policy("100/second", algorithm="gcra"), key="payments"))

Before a request is sent, the transport calls ``limiter.acquire`` (which sleeps until the
shared quota admits it), then hands the request to the wrapped transport. Every process whose
limiter shares the Redis shares the quota, so a whole fleet stays under the provider's limit.
``AsyncRateLimitTransport`` is the same for ``httpx.AsyncClient`` and an ``AsyncLimiter``.

httpx is an optional dependency: ``pip install 'ratelimit_mw[httpx]'``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeAlias, TypeVar

from ratelimit_mw.core import plans
from ratelimit_mw.core.errors import BackendError, ConfigurationError
from ratelimit_mw.core.policy import Policy, as_policy
from ratelimit_mw.http.extras import require
from ratelimit_mw.limiter import AsyncLimiter, Limiter
from ratelimit_mw.log import ThrottledLog

require("httpx", "httpx", "ratelimit_mw.httpx")
import httpx  # noqa: E402

__all__ = ["AsyncRateLimitTransport", "RateLimitTransport", "host_key"]

RequestKey: TypeAlias = Callable[[httpx.Request], "str | None"]
RequestCost: TypeAlias = Callable[[httpx.Request], int]

_ON_BACKEND_ERROR = ("allow", "raise")


def host_key(request: httpx.Request) -> str:
    """The default key: the request's host, with its port when the URL names a non-default one."""
    return request.url.netloc.decode("ascii")


def _constant(identity: str) -> RequestKey:
    def key(request: httpx.Request) -> str:
        return identity

    return key


class _Throttle:
    """The options both transports share, validated once; `identity`/`cost` per request."""

    def __init__(
        self,
        policy: Policy | str,
        key: str | RequestKey | None,
        cost: int | RequestCost,
        timeout: float | None,
        on_backend_error: str,
    ) -> None:
        self.policy = as_policy(policy)
        if key is None:
            self._key: RequestKey = host_key
        elif isinstance(key, str):
            if not key:
                raise ConfigurationError(
                    'key must be a non-empty identity or a callable (request) -> str | None, '
                    'e.g. key="payments"'
                )
            self._key = _constant(key)
        elif callable(key):
            self._key = key
        else:
            raise ConfigurationError(
                f"key must be a string, a callable (request) -> str | None, or None for the "
                f'host; got {key!r}. e.g. key="payments" or key=lambda r: r.url.host'
            )
        if callable(cost):
            self._cost: RequestCost | None = cost
            self._fixed_cost = 1
        else:
            plans.validate_cost(cost)
            self._cost = None
            self._fixed_cost = cost
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0
        ):
            raise ConfigurationError(
                f"timeout is how many seconds a call may wait for its quota (None: as long as "
                f"it takes, 0: no wait), got {timeout!r}; e.g. timeout=5"
            )
        self.timeout = timeout
        if on_backend_error not in _ON_BACKEND_ERROR:
            raise ConfigurationError(
                f'on_backend_error must be "allow" (send unthrottled, log) or "raise" '
                f"(BackendError), got {on_backend_error!r}"
            )
        self.allow_on_error = on_backend_error == "allow"
        self.log_failure = ThrottledLog()

    def identity(self, request: httpx.Request) -> str | None:
        identity = self._key(request)
        if identity is not None and not isinstance(identity, str):
            raise ConfigurationError(
                f"the key function of the httpx transport must return a string or None, got "
                f"{identity!r}"
            )
        return identity

    def cost(self, request: httpx.Request) -> int:
        if self._cost is None:
            return self._fixed_cost
        cost = self._cost(request)
        plans.validate_cost(cost)
        return cost

    def failed(self, exc: BackendError) -> None:
        """A backend failure: re-raise, or log (throttled) and let the call through."""
        if not self.allow_on_error:
            raise exc
        self.log_failure("ratelimit_mw: the rate-limit backend failed; sending unthrottled", exc)


L = TypeVar("L", Limiter, AsyncLimiter)


class _Throttled(Generic[L]):
    """What both transports take and keep; the subclasses say which limiter and sender."""

    _limiter_type: type[Limiter] | type[AsyncLimiter]
    _sender: type[Any]  # the transport that sends when none is given
    _hint: str

    def __init__(
        self,
        limiter: L,
        policy: Policy | str,
        *,
        key: str | RequestKey | None = None,
        cost: int | RequestCost = 1,
        timeout: float | None = None,
        on_backend_error: str = "allow",
        wrapped: Any = None,
    ) -> None:
        if not isinstance(limiter, self._limiter_type):
            raise ConfigurationError(
                f"{type(self).__name__} needs a {self._limiter_type.__name__}, got "
                f"{limiter!r}; {self._hint}"
            )
        self.limiter: L = limiter
        self._throttle = _Throttle(policy, key, cost, timeout, on_backend_error)
        self.wrapped = wrapped if wrapped is not None else self._sender()

    @property
    def policy(self) -> Policy:
        return self._throttle.policy


class RateLimitTransport(_Throttled[Limiter], httpx.BaseTransport):
    """An httpx transport that waits for ``limiter.acquire`` before sending each request.

    - ``limiter``: a sync ``Limiter`` (share its Redis to share the quota across processes).
    - ``policy``: the provider's limit, a ``Policy`` or a rate string such as ``"100/second"``.
    - ``key``: ``None`` (default) throttles per host; a string puts every request under one
      identity (one quota for a provider, whatever host it answers on); a callable
      ``(request) -> str | None`` chooses per request, ``None`` meaning "not throttled".
    - ``cost``: units per request, or a callable ``(request) -> int``.
    - ``timeout``: the longest a request may wait for its quota, in seconds; past it the
      transport raises ``RateLimitExceeded`` (carrying the Decision) without sending. ``None``
      waits as long as it takes; ``0`` tries once.
    - ``on_backend_error``: ``"allow"`` (default) sends the request unthrottled and logs when
      the limiter's backend fails; ``"raise"`` raises ``BackendError`` instead.
    - ``wrapped``: the transport that sends, default ``httpx.HTTPTransport()``; give your own
      to configure TLS, proxies or retries (a client's own such options do not reach a custom
      transport).
    """

    _limiter_type = Limiter
    _sender = httpx.HTTPTransport
    wrapped: httpx.BaseTransport
    _hint = "for httpx.AsyncClient use AsyncRateLimitTransport(AsyncLimiter(...), ...)"

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        throttle = self._throttle
        identity = throttle.identity(request)
        if identity is not None:
            try:
                self.limiter.acquire(throttle.policy, identity, throttle.cost(request),
                                     timeout=throttle.timeout)
            except BackendError as exc:
                throttle.failed(exc)
        return self.wrapped.handle_request(request)

    def close(self) -> None:
        self.wrapped.close()


class AsyncRateLimitTransport(_Throttled[AsyncLimiter], httpx.AsyncBaseTransport):
    """The ``httpx.AsyncClient`` twin of `RateLimitTransport`, on an ``AsyncLimiter``.

    Waiting is ``asyncio.sleep``: the event loop keeps serving other tasks meanwhile.
    ``wrapped`` defaults to ``httpx.AsyncHTTPTransport()``.
    """

    _limiter_type = AsyncLimiter
    _sender = httpx.AsyncHTTPTransport
    wrapped: httpx.AsyncBaseTransport
    _hint = "for httpx.Client use RateLimitTransport(Limiter(...), ...)"

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        throttle = self._throttle
        identity = throttle.identity(request)
        if identity is not None:
            try:
                await self.limiter.acquire(throttle.policy, identity, throttle.cost(request),
                                           timeout=throttle.timeout)
            except BackendError as exc:
                throttle.failed(exc)
        return await self.wrapped.handle_async_request(request)

    async def aclose(self) -> None:
        await self.wrapped.aclose()
