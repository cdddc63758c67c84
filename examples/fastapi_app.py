"""A FastAPI app rate-limited by ratelimit_mw: the README demo.

    uvicorn examples.fastapi_app:app          # or: python examples/fastapi_app.py
    RATELIMIT_REDIS_URL=redis://localhost:6379/0 uvicorn examples.fastapi_app:app

    for i in 1 2 3 4 5 6; do curl -si localhost:8000/search | head -1; done   # 5 x 200, a 429

Limits: GET /search 5 a minute per client; POST /login 5 a minute per client (on top of the
default); GET /reports/{id} 10 an hour per X-Api-Key (per client without one); everything
else 60 a minute per client; /health never.

Without RATELIMIT_REDIS_URL the counters live in process memory (fine for one worker);
with it, every worker and every server shares them through Redis.
"""

from __future__ import annotations

import os

from fastapi import FastAPI, Request

import ratelimit_mw as rl
from ratelimit_mw import keys
from ratelimit_mw.asgi import Config, RateLimitMiddleware, Rule

REDIS_URL = os.environ.get("RATELIMIT_REDIS_URL")
backend = rl.AsyncRedisBackend.from_url(REDIS_URL) if REDIS_URL else rl.MemoryBackend()
limiter = rl.AsyncLimiter(backend, prefix=os.environ.get("RATELIMIT_PREFIX", "demo"))

# Built (and checked) when this module is imported: a mistyped option stops the server at
# start-up instead of answering 500 to every request.
RATE_LIMITS = Config(
    default="60/minute",
    # A rule adds to whatever else applies: at most 5 login attempts a minute per client.
    rules=[Rule("/login", "5/minute", methods=["POST"])],
    # The socket peer. Behind your own proxies, name them so the forwarded client counts:
    # keys.client_ip(trusted_proxies=["10.0.0.0/8"]).
    key=keys.client_ip(),
)

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
# Per API key; a request without one is counted per client address, never unlimited.
@limiter.limit("10/hour", key=keys.first(keys.header("X-Api-Key"), keys.client_ip()))
async def report(report_id: int) -> dict[str, object]:
    return {"report": report_id}


@app.get("/health")
@limiter.exempt  # never limited: load balancers poll it
async def health() -> dict[str, str]:
    return {"status": "ok"}


@app.post("/login")
async def login() -> dict[str, str]:
    return {"token": "demo"}


app.add_middleware(RateLimitMiddleware, limiter=limiter, config=RATE_LIMITS)


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=8000)
