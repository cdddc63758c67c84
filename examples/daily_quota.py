"""Calendar windows: "100 uploads a day, reset at local midnight".

A fixed-window policy with ``tz=`` runs each whole-day tier from local midnight to local
midnight in that IANA zone (a 23- or 25-hour day across a DST change), so the quota a user
sees matches their calendar, and a refusal's Retry-After points at that midnight. Tiers
shorter than a day stay aligned to the epoch; week tiers start on Monday.

    python examples/daily_quota.py                      # in memory
    RATELIMIT_REDIS_URL=redis://localhost:6379/0 python examples/daily_quota.py
"""

from __future__ import annotations

import datetime as dt
import os

import ratelimit_mw as rl

ZONE = "Asia/Shanghai"
UPLOADS = rl.Policy("100/day", algorithm="fixed-window", tz=ZONE, name="uploads")


def upload(limiter: rl.Limiter, user: str, now: dt.datetime | None = None) -> str:
    """Count one upload; `now` (aware, for the message only) defaults to the current time."""
    decision = limiter.hit(UPLOADS, user)
    if decision.allowed:
        return f"uploaded ({decision.remaining} left today)"
    now = now or dt.datetime.now(dt.timezone.utc)
    resets = (now + dt.timedelta(seconds=decision.retry_after)).astimezone(UPLOADS.tz)
    return f"daily quota used up; it resets at {resets:%Y-%m-%d %H:%M %Z}"


def make_limiter() -> rl.Limiter:
    url = os.environ.get("RATELIMIT_REDIS_URL")
    return rl.Limiter(rl.RedisBackend.from_url(url)) if url else rl.Limiter()


def main() -> None:
    limiter = make_limiter()
    limiter.reset(UPLOADS, "bob")
    for n in range(1, 102):
        message = upload(limiter, "bob")
        if n in (1, 2, 100, 101):
            print(f"upload {n:3}: {message}")
    limiter.reset(UPLOADS, "bob")


if __name__ == "__main__":
    main()
