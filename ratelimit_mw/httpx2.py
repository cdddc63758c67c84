"""Throttle outbound HTTP calls made with httpx2, the HTTP client of today's ``openai`` and
``anthropic`` SDKs (``pip install 'ratelimit_mw[httpx2]'``).

    transport = RateLimitTransport(limiter, "90000/minute", key="openai", settle="usage")
    client = openai.OpenAI(http_client=httpx2.Client(transport=transport))

The same transports as `ratelimit_mw.httpx`, with the same options (see its
`RateLimitTransport`), for ``httpx2.Client`` and ``httpx2.AsyncClient``: one core
(`ratelimit_mw._async.transport`), bound here to httpx2's classes. Needs httpx2 only.
"""

from __future__ import annotations

from ratelimit_mw.http.extras import require

require("httpx2", "httpx2", "ratelimit_mw.httpx2")
import httpx2  # noqa: E402

from ratelimit_mw._async.transport import AsyncMetered, AsyncTransportCore  # noqa: E402
from ratelimit_mw._sync.transport import Metered, TransportCore  # noqa: E402
from ratelimit_mw.http.outbound import host_key  # noqa: E402
from ratelimit_mw.http.usage import Events  # noqa: E402

__all__ = ["AsyncRateLimitTransport", "Events", "RateLimitTransport", "host_key"]


class _Metered(Metered, httpx2.SyncByteStream):
    pass


class _AsyncMetered(AsyncMetered, httpx2.AsyncByteStream):
    pass


class RateLimitTransport(TransportCore, httpx2.BaseTransport):
    """An httpx2 transport that charges ``limiter`` before sending each request; the options
    are `ratelimit_mw.httpx.RateLimitTransport`'s. ``wrapped`` defaults to
    ``httpx2.HTTPTransport()``."""

    _sender = httpx2.HTTPTransport
    _stream = _Metered
    _hint = "for httpx2.AsyncClient use AsyncRateLimitTransport(AsyncLimiter(...), ...)"

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response: httpx2.Response = self._handle(request)
        return response

    def close(self) -> None:
        self.wrapped.close()


class AsyncRateLimitTransport(AsyncTransportCore, httpx2.AsyncBaseTransport):
    """The ``httpx2.AsyncClient`` twin of `RateLimitTransport`, on an ``AsyncLimiter``;
    ``wrapped`` defaults to ``httpx2.AsyncHTTPTransport()``."""

    _sender = httpx2.AsyncHTTPTransport
    _stream = _AsyncMetered
    _hint = "for httpx2.Client use RateLimitTransport(Limiter(...), ...)"

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response: httpx2.Response = await self._handle(request)
        return response

    async def aclose(self) -> None:
        await self.wrapped.aclose()
