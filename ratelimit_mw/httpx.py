"""Throttle outbound HTTP calls made with httpx (``pip install 'ratelimit_mw[httpx]'``); for
httpx2, the client of today's ``openai`` and ``anthropic`` SDKs, see `ratelimit_mw.httpx2`
(the same transports and options).

    client = httpx.Client(transport=RateLimitTransport(limiter, "100/second", key="payments"))

Before a request is sent, the transport charges its cost with ``limiter.charge`` (which
waits until the shared quota admits it), then hands the request to the wrapped transport:
every process whose limiter shares the Redis shares the quota. A cost known only from the
response (an LLM call's tokens) is settled from it: ``settle="usage"`` reads OpenAI's and
Anthropic's usage from a JSON body or from the stream's events. ``AsyncRateLimitTransport``
is the same for ``httpx.AsyncClient`` and an ``AsyncLimiter``.
"""

from __future__ import annotations

from ratelimit_mw.http.extras import require

require("httpx", "httpx", "ratelimit_mw.httpx")
import httpx  # noqa: E402

from ratelimit_mw._async.transport import AsyncMetered, AsyncTransportCore  # noqa: E402
from ratelimit_mw._sync.transport import Metered, TransportCore  # noqa: E402
from ratelimit_mw.http.outbound import host_key  # noqa: E402
from ratelimit_mw.http.usage import Events  # noqa: E402

__all__ = ["AsyncRateLimitTransport", "Events", "RateLimitTransport", "host_key"]


class _Metered(Metered, httpx.SyncByteStream):
    pass


class _AsyncMetered(AsyncMetered, httpx.AsyncByteStream):
    pass


class RateLimitTransport(TransportCore, httpx.BaseTransport):
    """An httpx transport that waits for ``limiter.charge`` before sending each request
    (docs/scenarios.md#the-httpx-transport, docs/settle.md).

    - ``limiter``: a sync ``Limiter``; ``policy``: a ``Policy`` or a rate string; ``calls``:
      another, counting each request once beside its cost (tokens and requests per minute).
    - ``key``: ``None`` (default) throttles per host; a string puts every request under one
      identity; a callable ``(request) -> str | None`` chooses per request (``None``: not
      throttled). ``cost``: units per request, or a callable ``(request) -> int``: the
      estimate, when ``settle`` gives the actual cost from the response.
    - ``settle``: ``"usage"`` reads OpenAI's ``usage.total_tokens`` or Anthropic's
      ``input_tokens + output_tokens`` from a JSON body (read before it is returned) or from
      a stream of server-sent events as the caller reads it (settled when it is closed);
      ``Events(read)`` reads another format so; a callable ``(response) -> int | None``
      reads the whole response (``None``: it says nothing). An answer that says nothing
      keeps its estimate, but a refusal (status >= 400) settles at 0 unless
      ``refusals="estimate"``; a stream closed before its end keeps its estimate unless
      ``abandoned="seen"`` (what its events said so far). A request that failed keeps its
      estimate.
    - ``on_429``: ``"pause"`` (default): a 429 with ``Retry-After`` (or a ``RateLimit``
      field with nothing left) pauses this key for every limiter on the store until then,
      and is returned; ``"raise"`` pauses and raises ``RateLimitExceeded`` (its
      ``retry_after``) instead; ``"pass"`` returns it untouched and pauses nothing.
    - ``timeout``: the longest wait for the quota (or a pause) in seconds: a wait that would
      end later raises ``RateLimitExceeded`` at once, unsent, unless ``wait_out=True``
      (the timeout is waited out, then one more try); ``None`` waits as long as it takes,
      ``0`` tries once.
    - ``on_backend_error``: ``"allow"`` (default) sends unthrottled and logs when the backend
      fails; ``"raise"`` raises ``BackendError``.
    - ``wrapped``: the transport that sends, default ``httpx.HTTPTransport()``: configure TLS,
      proxies and retries on it (a client's own such options do not reach a custom one).
    - ``concurrency``: at most this many requests of one identity open at once across the
      fleet (or a ``Policy.in_flight``), taken with the quota and held until the response is
      closed (its lease renewed while its body is read).
    """

    _sender = httpx.HTTPTransport
    _stream = _Metered
    _hint = "for httpx.AsyncClient use AsyncRateLimitTransport(AsyncLimiter(...), ...)"

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response: httpx.Response = self._handle(request)
        return response

    def close(self) -> None:
        self.wrapped.close()


class AsyncRateLimitTransport(AsyncTransportCore, httpx.AsyncBaseTransport):
    """The ``httpx.AsyncClient`` twin of `RateLimitTransport`, on an ``AsyncLimiter``.

    Waiting is ``asyncio.sleep``: the event loop keeps serving other tasks meanwhile.
    ``wrapped`` defaults to ``httpx.AsyncHTTPTransport()``.
    """

    _sender = httpx.AsyncHTTPTransport
    _stream = _AsyncMetered
    _hint = "for httpx.Client use RateLimitTransport(Limiter(...), ...)"

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response: httpx.Response = await self._handle(request)
        return response

    async def aclose(self) -> None:
        await self.wrapped.aclose()
