"""Count only what should count: "5 failed logins per 15 minutes per client".

Every login attempt is counted when it arrives (so a burst of parallel attempts cannot slip
past), and ``count_when`` gives the hit back after the response unless it was a failure: a
user who types the right password never uses up the quota, while a password guesser is
refused after five misses, even when the sixth guess is right.

    pip install 'ratelimit_mw[starlette]'
    python examples/failed_logins.py                    # in memory
    RATELIMIT_REDIS_URL=redis://localhost:6379/0 python examples/failed_logins.py
    uvicorn examples.failed_logins:app                  # serve it

Without the middleware, the same pattern by hand: ``decision = limiter.hit(policy, ip)``
before checking the password, and ``limiter.refund(policy, ip)`` after a success.
"""

from __future__ import annotations

import asyncio
import os

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import ratelimit_mw as rl
from ratelimit_mw.asgi import Config, RateLimitMiddleware, Rule

FAILED_LOGINS = rl.Policy("5/15 minutes", name="failed-logins")
CLIENT = "203.0.113.7"  # the demo's client address; keys.client_ip() keys it "ip:203.0.113.7"
USERS = {"dana": "correct horse battery staple"}
# Built at import time, so a mistake shows when the module loads.
RATE_LIMITS = Config(
    rules=[Rule("/login", FAILED_LOGINS, methods=["POST"])],
    count_when=lambda status: status == 401,  # only failures use up the quota
)


async def login(request: Request) -> JSONResponse:
    body = await request.json()
    if USERS.get(body.get("username")) == body.get("password"):
        return JSONResponse({"token": "..."})
    return JSONResponse({"detail": "wrong username or password"}, status_code=401)


def build_app(limiter: rl.AsyncLimiter) -> Starlette:
    app = Starlette(routes=[Route("/login", login, methods=["POST"])])
    app.add_middleware(RateLimitMiddleware, limiter=limiter, config=RATE_LIMITS)
    return app


def make_limiter() -> rl.AsyncLimiter:
    url = os.environ.get("RATELIMIT_REDIS_URL")
    return rl.AsyncLimiter(rl.AsyncRedisBackend.from_url(url)) if url else rl.AsyncLimiter()


app = build_app(make_limiter())


async def demo(app: Starlette) -> list[int]:
    """Three good logins, six bad ones, then the right password: the statuses returned."""
    good = {"username": "dana", "password": "correct horse battery staple"}
    bad = {"username": "dana", "password": "hunter2"}
    transport = httpx.ASGITransport(app=app, client=(CLIENT, 4242))
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        return [(await client.post("/login", json=body)).status_code
                for body in [good] * 3 + [bad] * 6 + [good]]


def main() -> None:
    limiter = make_limiter()

    async def run() -> list[int]:
        await limiter.reset(FAILED_LOGINS, f"ip:{CLIENT}")  # a clean slate for the demo
        return await demo(build_app(limiter))

    statuses = asyncio.run(run())
    print("3 good, 6 bad, then good again:", statuses)
    print("(200 = logged in, 401 = wrong password, 429 = too many failures)")


if __name__ == "__main__":
    main()
