"""In-flight limits under Django's middleware, sync (WSGI) and async (ASGI): a slot is held
until Django closes the response (a streamed body: once it has been read), given back when
the view raises, and a streamed body renews its lease as it is read (the test clock)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from support.django_site import configure

import ratelimit_mw as rl
from ratelimit_mw.django import limit

configure()

from django.http import HttpResponse, StreamingHttpResponse  # noqa: E402
from django.urls import path  # noqa: E402


def test_a_streamed_slot_is_held_until_the_body_has_been_read(open_site: Any,
                                                              mode: str) -> None:
    clock_now = [1_800_000_000.0]

    def advance() -> None:
        clock_now[0] += 1.5

    def rows() -> Iterator[bytes]:
        for n in range(6):  # 9 s of a 3 s lease: renewed as it is read
            advance()
            yield b"%d\n" % n

    async def arows() -> AsyncIterator[bytes]:
        for row in rows():
            yield row

    @limit("10/minute", concurrency=rl.Policy.in_flight(1, lease=3))
    def export(request: Any) -> StreamingHttpResponse:
        return StreamingHttpResponse(arows() if mode == "asgi" else rows())

    @limit(concurrency=1)
    def broken(request: Any) -> HttpResponse:
        raise RuntimeError("boom")

    asynchronous = mode == "asgi"
    limiter = (rl.AsyncLimiter if asynchronous else rl.Limiter)(
        prefix="t" + uuid.uuid4().hex[:12], clock=lambda: clock_now[0])
    site = open_site([path("export", export), path("broken", broken)],
                     **{"async_limiter" if asynchronous else "limiter": limiter})

    def read(response: Any) -> bytes:
        if asynchronous:
            async def collect() -> bytes:
                return b"".join([chunk async for chunk in response.streaming_content])

            return site.run(collect())  # type: ignore[no-any-return]
        return b"".join(response.streaming_content)

    first = site.request("GET", "/export")
    assert first.status_code == 200
    refused = site.request("GET", "/export")
    assert (refused.status_code, refused["RateLimit"]) == (429, '"in flight";r=0;t=1')
    assert read(first) == b"0\n1\n2\n3\n4\n5\n"
    again = site.request("GET", "/export")
    assert (again.status_code, again["RateLimit"]) == (200, '"minute";r=8;t=60')
    read(again)
    site.client.raise_request_exception = False  # the 500 a server would send
    assert [site.request("GET", "/broken").status_code for _ in range(3)] == [500] * 3
