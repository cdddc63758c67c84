"""A FastAPI app rate-limited by ratelimit_mw: the README demo.

    uvicorn examples.fastapi_app:app          # or: python examples/fastapi_app.py
    RATELIMIT_REDIS_URL=redis://localhost:6379/0 uvicorn examples.fastapi_app:app

Without RATELIMIT_REDIS_URL the counters live in process memory (fine for one worker);
with it, every worker and every server shares them through Redis.
"""

from __future__ import annotations

import os

from fastapi import FastAPI, Request

import ratelimit_mw as rl
from ratelimit_mw import keys
from ratelimit_mw.asgi import RateLimitMiddleware, Rule

REDIS_URL = os.environ.get("RATELIMIT_REDIS_URL")
backend = rl.AsyncRedisBackend.from_url(REDIS_URL) if REDIS_URL else rl.MemoryBackend()
limiter = rl.AsyncLimiter(backend, prefix=os.environ.get("RATELIMIT_PREFIX", "demo"))

app = FastAPI(title="ratelimit_mw demo")


@app.get("/")
async def index(request: Request) -> dict[str, object]:
    """The default limit: 60 a minute per client IP. The decision is in request.state."""
    decision = request.state.ratelimit
    return {"hello": "world", "remaining": decision.remaining if decision else None}


@app.get("/search")
@limiter.limit("5/minute")  # this route alone: 5 a minute per client, instead of the default
async def search(q: str = "") -> dict[str, object]:
    return {"query": q, "results": []}


@app.get("/reports/{report_id}")
@limiter.limit("10/hour", key=keys.header("X-Api-Key", required=True))  # per API key
async def report(report_id: int) -> dict[str, object]:
    return {"report": report_id}


@app.get("/health")
@limiter.exempt  # never limited: load balancers poll it
async def health() -> dict[str, str]:
    return {"status": "ok"}


@app.post("/login")
async def login() -> dict[str, str]:
    return {"token": "demo"}


app.add_middleware(
    RateLimitMiddleware,
    limiter=limiter,
    default="60/minute",
    # A rule adds to whatever else applies: at most 5 login attempts a minute per client.
    rules=[Rule("/login", "5/minute", methods=["POST"])],
    # The socket peer. Behind your own proxies, name them so the forwarded client counts:
    # keys.client_ip(trusted_proxies=["10.0.0.0/8"]).
    key=keys.client_ip(),
)


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=8000)
