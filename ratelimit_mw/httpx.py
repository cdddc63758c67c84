"""Throttle outbound HTTP calls made with httpx (``pip install 'ratelimit_mw[httpx]'``).

    client = httpx.Client(transport=RateLimitTransport(limiter, "100/second", key="payments"))

Before a request is sent, the transport charges its cost with ``limiter.charge`` (which
waits until the shared quota admits it), then hands the request to the wrapped transport:
every process whose limiter shares the Redis shares the quota. A cost known only from the
response (an LLM call's tokens) is settled from it: ``settle=lambda r:
r.json()["usage"]["total_tokens"]``. ``AsyncRateLimitTransport`` is the same for
``httpx.AsyncClient`` and an ``AsyncLimiter``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Generic, TypeAlias, TypeVar

from ratelimit_mw._async.limiter import AsyncTicket
from ratelimit_mw._sync.limiter import Ticket
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
ResponseCost: TypeAlias = Callable[[httpx.Response], int]

def host_key(request: httpx.Request) -> str:
    """The default key: the request's host, with its port when the URL names a non-default one."""
    return request.url.netloc.decode("ascii")


L = TypeVar("L", Limiter, AsyncLimiter)


class _Throttled(Generic[L]):
    """What both transports take, validated once; the subclasses name the limiter and sender."""

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
        calls: Policy | str | None = None,
        settle: ResponseCost | None = None,
        concurrency: Policy | int | None = None,
    ) -> None:
        if not isinstance(limiter, self._limiter_type):
            raise ConfigurationError(
                f"{type(self).__name__} needs a {self._limiter_type.__name__}, got "
                f"{limiter!r}; {self._hint}"
            )
        self.limiter: L = limiter
        self.policy = as_policy(policy)
        if key == "" or not (key is None or isinstance(key, str) or callable(key)):
            raise ConfigurationError(
                f"key must be a non-empty identity, a callable (request) -> str | None, or None "
                f'for the host; got {key!r}. e.g. key="payments" or key=lambda r: r.url.host'
            )
        self._key = host_key if key is None else key
        if not callable(cost):
            plans.validate_cost(cost)
        self._cost = cost
        if timeout is not None and (isinstance(timeout, bool)
                                    or not isinstance(timeout, (int, float)) or timeout < 0):
            raise ConfigurationError(
                f"timeout is how many seconds a call may wait for its quota (None: as long as "
                f"it takes, 0: no wait), got {timeout!r}; e.g. timeout=5"
            )
        self.timeout = timeout
        if on_backend_error not in ("allow", "raise"):
            raise ConfigurationError(
                f'on_backend_error must be "allow" (send unthrottled, log) or "raise" '
                f"(BackendError), got {on_backend_error!r}"
            )
        self._allow_on_error = on_backend_error == "allow"
        self.calls = None if calls is None else as_policy(calls)
        if settle is not None and not callable(settle):
            raise ConfigurationError(
                f"settle is a callable (response) -> the actual cost, got {settle!r}; e.g. "
                'settle=lambda r: r.json()["usage"]["total_tokens"]')
        self._settle = settle
        if concurrency is not None and not isinstance(concurrency, Policy):
            concurrency = Policy.in_flight(concurrency, name=f"{self.policy.name} in flight")
        if concurrency is not None and concurrency.algorithm != "concurrency":
            raise ConfigurationError(f"concurrency is a number of slots or a "
                                     f"Policy.in_flight(...), got {concurrency!r}")
        self.concurrency = concurrency
        self._lease = (concurrency.rates[0].period_ms / 1000 if concurrency is not None
                       else 0.0)
        self._log_failure = ThrottledLog()
        self.wrapped = wrapped if wrapped is not None else self._sender()

    def _quota(self, request: httpx.Request) -> tuple[str, int] | None:
        """(identity, cost) of `request`, or None when it is not throttled."""
        identity = self._key if isinstance(self._key, str) else self._key(request)
        if identity is None:
            return None
        if not isinstance(identity, str):
            raise ConfigurationError(f"the key function of the httpx transport must return a "
                                     f"string or None, got {identity!r}")
        if isinstance(self._cost, int):
            return identity, self._cost
        cost = self._cost(request)
        plans.validate_cost(cost)
        return identity, cost

    def _actual(self, response: httpx.Response) -> int | None:
        """What `settle` makes of the (read) response, or None: the estimate stands (no
        `settle`, or it failed on this response: logged)."""
        if self._settle is None:
            return None
        try:
            actual = self._settle(response)
        except Exception as exc:
            self._log_failure("ratelimit_mw: settle= raised; the estimate stays charged", exc)
            return None
        if isinstance(actual, bool) or not isinstance(actual, int) or actual < 0:
            self._log_failure(f"ratelimit_mw: settle= returned {actual!r}, not a whole cost "
                              ">= 0; the estimate stays charged")
            return None
        return actual

    def _gave_up(self, what: str, exc: Exception) -> None:
        """A slot's release or renewal failed: logged, never raised (the lease ends it)."""
        self._log_failure(f"ratelimit_mw: could not {what}", exc)

    def _failed(self, exc: BackendError) -> None:
        """A backend failure: re-raise, or log (throttled) and let the call through."""
        if not self._allow_on_error:
            raise exc
        self._log_failure("ratelimit_mw: the rate-limit backend failed; sending unthrottled", exc)


class RateLimitTransport(_Throttled[Limiter], httpx.BaseTransport):
    """An httpx transport that waits for ``limiter.acquire`` before sending each request
    (docs/scenarios.md#the-httpx-transport).

    - ``limiter``: a sync ``Limiter``; ``policy``: a ``Policy`` or a rate string; ``calls``:
      another, counting each request once beside its cost (tokens and requests per minute).
    - ``key``: ``None`` (default) throttles per host; a string puts every request under one
      identity; a callable ``(request) -> str | None`` chooses per request (``None``: not
      throttled). ``cost``: units per request, or a callable ``(request) -> int``: the
      estimate, when ``settle`` gives the actual cost from the response, ``(response) ->
      int``; the response is then read before it is returned, and a response that cannot
      say (``settle`` raised) or a request that failed keeps its estimate.
    - ``timeout``: the longest wait for the quota in seconds, past which ``RateLimitExceeded``
      is raised unsent; ``None`` waits as long as it takes, ``0`` tries once.
    - ``on_backend_error``: ``"allow"`` (default) sends unthrottled and logs when the backend
      fails; ``"raise"`` raises ``BackendError``.
    - ``wrapped``: the transport that sends, default ``httpx.HTTPTransport()``: configure TLS,
      proxies and retries on it (a client's own such options do not reach a custom one).
    - ``concurrency``: at most this many requests of one identity open at once across the
      fleet (or a ``Policy.in_flight``), taken with the quota and held until the response is
      closed (its lease renewed while its body is read).
    """

    _limiter_type = Limiter
    _sender = httpx.HTTPTransport
    wrapped: httpx.BaseTransport
    _hint = "for httpx.AsyncClient use AsyncRateLimitTransport(AsyncLimiter(...), ...)"

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        quota = self._quota(request)
        ticket = None
        if quota is not None:
            try:
                ticket = self.limiter.charge(self.policy, *quota, calls=self.calls,
                                             concurrency=self.concurrency,
                                             timeout=self.timeout)
            except BackendError as exc:
                self._failed(exc)
        try:
            response = self.wrapped.handle_request(request)
            if ticket is not None and self._settle is not None:
                response.read()
                actual = self._actual(response)
                if actual is not None:
                    try:
                        ticket.settle(actual)
                    except BackendError as exc:
                        self._failed(exc)
        except BaseException:
            if ticket is not None:
                self._release(ticket)
            raise
        if ticket is not None and ticket.held:
            if response.is_closed:  # a body made in memory, read already: the call is over
                self._release(ticket)
            else:
                response.stream = _Held(self, response.stream, ticket)  # type: ignore[arg-type]
        return response

    def _release(self, ticket: Ticket) -> None:
        try:
            ticket.release()
        except Exception as exc:
            self._gave_up("give back an in-flight slot; it comes back with its lease", exc)

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
        quota = self._quota(request)
        ticket = None
        if quota is not None:
            try:
                ticket = await self.limiter.charge(self.policy, *quota, calls=self.calls,
                                                   concurrency=self.concurrency,
                                                   timeout=self.timeout)
            except BackendError as exc:
                self._failed(exc)
        try:
            response = await self.wrapped.handle_async_request(request)
            if ticket is not None and self._settle is not None:
                await response.aread()
                actual = self._actual(response)
                if actual is not None:
                    try:
                        await ticket.settle(actual)
                    except BackendError as exc:
                        self._failed(exc)
        except BaseException:
            if ticket is not None:
                await self._release(ticket)
            raise
        if ticket is not None and ticket.held:
            if response.is_closed:  # a body made in memory, read already: the call is over
                await self._release(ticket)
            else:
                response.stream = _AsyncHeld(self, response.stream,  # type: ignore[arg-type]
                                             ticket)
        return response

    async def _release(self, ticket: AsyncTicket) -> None:
        try:
            await ticket.release()
        except Exception as exc:
            self._gave_up("give back an in-flight slot; it comes back with its lease", exc)

    async def aclose(self) -> None:
        await self.wrapped.aclose()


class _Held(httpx.SyncByteStream):
    """A response body whose request holds an in-flight slot: given back when it is closed,
    its lease renewed while its chunks are read (a third of the lease apart at least)."""

    def __init__(self, owner: RateLimitTransport, stream: httpx.SyncByteStream,
                 ticket: Ticket) -> None:
        self.owner, self.stream, self.ticket = owner, stream, ticket

    def __iter__(self) -> Iterator[bytes]:
        renewed = time.monotonic()
        for chunk in self.stream:
            if time.monotonic() - renewed > self.owner._lease / 3:
                renewed = time.monotonic()
                try:
                    self.ticket.renew()
                except Exception as exc:
                    self.owner._gave_up("renew an in-flight lease", exc)
            yield chunk

    def close(self) -> None:
        try:
            self.stream.close()
        finally:
            self.owner._release(self.ticket)


class _AsyncHeld(httpx.AsyncByteStream):
    """`_Held` for `AsyncRateLimitTransport`."""

    def __init__(self, owner: AsyncRateLimitTransport, stream: httpx.AsyncByteStream,
                 ticket: AsyncTicket) -> None:
        self.owner, self.stream, self.ticket = owner, stream, ticket

    async def __aiter__(self) -> AsyncIterator[bytes]:
        renewed = time.monotonic()
        async for chunk in self.stream:
            if time.monotonic() - renewed > self.owner._lease / 3:
                renewed = time.monotonic()
                try:
                    await self.ticket.renew()
                except Exception as exc:
                    self.owner._gave_up("renew an in-flight lease", exc)
            yield chunk

    async def aclose(self) -> None:
        try:
            await self.stream.aclose()
        finally:
            await self.owner._release(self.ticket)
