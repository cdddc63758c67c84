# Generated from ratelimit_mw/_async/transport.py by scripts/unasync.py: do not edit.
"""The outbound transports' one core: charge, send, pause, settle.

Bound to an HTTP library by a few lines (`ratelimit_mw.httpx`, `ratelimit_mw.httpx2`): the
binding names its transport base class, its sender and its byte stream class; requests and
responses are only read here (``url``, ``headers``, ``status_code``, ``stream``). The one
source of both sides is this module: `_sync/transport.py` is generated from it by
``python scripts/unasync.py``.

A call: reserve its estimate (and one request, and an in-flight slot) with
``limiter.charge``, waiting while a pause holds its key; send; if the answer is a 429 with
Retry-After (or a RateLimit field with nothing left), pause the key on the store for every
process; then settle the ticket from the answer: a JSON body is read before it is returned,
a stream of server-sent events is read as the caller reads it and settled when it is closed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from ratelimit_mw._sync.handles import Ticket
from ratelimit_mw.core.errors import BackendError, RateLimitExceeded
from ratelimit_mw.http.outbound import Throttled
from ratelimit_mw.http.usage import Meter
from ratelimit_mw.limiter import Limiter

__all__ = ["Metered", "TransportCore"]


class TransportCore(Throttled[Limiter]):
    """Charges, sends through ``wrapped``, pauses, settles (see the module's docstring)."""

    _limiter_type = Limiter
    _stream: type[Metered]  # the binding's: also its library's byte stream class

    def _handle(self, request: Any) -> Any:
        quota = self._quota(request)
        ticket = None
        if quota is not None:
            try:
                ticket = self.limiter.charge(
                    self._charged, *quota, calls=self.calls, concurrency=self.concurrency,
                    timeout=self.timeout, wait_out=self.wait_out)
            except BackendError as exc:
                self._failed(exc)
        try:
            response = self.wrapped.handle_request(request)
        except BaseException:
            if ticket is not None:
                self._release(ticket)
            raise
        paused = None if quota is None else self._pause_for(response)
        if paused is not None and quota is not None:
            try:
                self.limiter.pause(self.policy, quota[0], paused)
            except Exception as exc:
                self._gave_up("pause the key after the provider's 429", exc)
        raising = paused is not None and quota is not None and self.on_429 == "raise"
        if ticket is not None:
            try:
                meter = self._meter(response)
                if meter is not None and meter.stream and not raising \
                        and not response.is_closed:  # (a body made in memory is read)
                    # Read as the caller reads it; settled (and the slot given back) on close.
                    response.stream = self._stream(self, response.stream, ticket, meter,
                                                   response.status_code)
                    return response
                if self._settle is not None:
                    response.read()
                    if meter is None:
                        said = self._actual(response)
                    else:
                        meter.feed(response.content)
                        meter.end()
                        said = meter.cost
                    self._settle_at(ticket, self._settles_at(response.status_code, said),
                                          in_call=True)
            except BaseException:
                self._release(ticket)
                raise
            if ticket.held:
                if response.is_closed:  # read already: the call is over
                    self._release(ticket)
                else:  # the slot is held until the body is closed
                    response.stream = self._stream(self, response.stream, ticket, None,
                                                   response.status_code)
        if raising and quota is not None and paused is not None:
            response.close()
            raise RateLimitExceeded(self._refused(quota[0], paused))
        return response

    def _settle_at(self, ticket: Ticket, actual: int | None,
                   in_call: bool = False) -> None:
        """Settle at `actual`, or keep the estimate (None) and give the slot back."""
        if actual is None:
            self._release(ticket)
            return
        try:
            ticket.settle(actual)
        except BackendError as exc:
            self._release(ticket)
            if in_call:
                self._failed(exc)
            else:
                self._gave_up("settle a streamed call; its estimate stays charged", exc)

    def _closed(self, ticket: Ticket, meter: Meter | None, status: int) -> None:
        """A held or metered body was closed: settle from what it said, or give back."""
        if meter is None or ticket.settled is not None:
            self._release(ticket)
            return
        self._settle_at(ticket, self._settles_at(status, meter.cost, meter.ended))

    def _release(self, ticket: Ticket) -> None:
        try:
            ticket.release()
        except Exception as exc:
            self._gave_up("give back an in-flight slot; it comes back with its lease", exc)


class Metered:
    """A response body read through: its chunks fed to the meter (when the cost is read
    from it), the in-flight lease renewed while it is read (a third of the lease apart at
    least), and on close the ticket settled or its slot given back, once."""

    def __init__(self, owner: TransportCore, stream: Any, ticket: Ticket,
                 meter: Meter | None, status: int) -> None:
        self.owner, self.stream, self.ticket = owner, stream, ticket
        self.meter, self.status = meter, status
        self.closed = False

    def __iter__(self) -> Iterator[bytes]:
        renewed = time.monotonic()
        meter = self.meter
        for chunk in self.stream:
            if self.ticket.held and time.monotonic() - renewed > self.owner._lease / 3:
                renewed = time.monotonic()
                try:
                    self.ticket.renew()
                except Exception as exc:
                    self.owner._gave_up("renew an in-flight lease", exc)
            if meter is not None:
                meter.feed(chunk)
            yield chunk
        if meter is not None:
            meter.end()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.stream.close()
        finally:
            self.owner._closed(self.ticket, self.meter, self.status)
