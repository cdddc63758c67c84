"""One late answer costs the request it was late for, not a cool-down of everything.

A private Redis is paused (SIGSTOP) for longer than the middleware's deadline while one
request's call is out: that request takes the failure policy (here "allow"), its hit still
reaches the store once Redis runs again (the script runs when the server reads it), and
the very next request is decided by the store, not admitted by a breaker opened over one
late answer (efbcb84: the breaker opened on the first timeout and the next second of
requests was admitted uncounted). A Redis that stays hung still opens it (after
breaker.TIMEOUTS timeouts in a row): tests/metrics/test_through_the_limiter.py.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import httpx
import pytest
from starlette.responses import PlainTextResponse

import ratelimit_mw as rl
from ratelimit_mw import asgi, keys
from reliability._apps import remaining
from reliability._support import PrivateRedis

pytestmark = pytest.mark.slow


async def test_one_late_answer_does_not_turn_limiting_off(
        private_redis: Callable[..., PrivateRedis], prefix: str) -> None:
    server = private_redis()
    backend = rl.AsyncRedisBackend.from_url(server.url)
    middleware = asgi.RateLimitMiddleware(
        PlainTextResponse("ok"), rl.AsyncLimiter(backend, prefix=prefix),
        default="100/minute", key=keys.header("x-client"),
        # "allow" and a 1 s cool-down, the defaults; a deadline the reconnect after the pause
        # meets on a loaded machine (the paused request misses any deadline).
        backend_timeout=0.5)
    transport = httpx.ASGITransport(app=middleware)
    pid = server.proc.pid  # type: ignore[union-attr]
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            async def get() -> httpx.Response:
                return await client.get("/", headers={"x-client": "one"})

            first = await get()
            assert (first.status_code, remaining(first.headers)) == (200, 99)
            os.kill(pid, signal.SIGSTOP)  # Redis answers nothing for now
            try:
                late = await get()  # its call outlasts the deadline
            finally:
                os.kill(pid, signal.SIGCONT)
            # Admitted by on_backend_error="allow": no answer, so no RateLimit fields.
            assert (late.status_code, remaining(late.headers)) == (200, None)
            after = await get()
    finally:
        os.kill(pid, signal.SIGCONT)
        await backend.aclose()
    # Decided by the store (efbcb84: admitted by the open breaker, no fields, uncounted),
    # which counted the late request's hit too: 100 - 3.
    assert (after.status_code, remaining(after.headers)) == (200, 97)
    assert not middleware.guard.breaker.is_open
