"""Penalty: "10 likes in 10 seconds, then banned for an hour".

A policy with ``penalty`` bans an identity as soon as it is refused: every hit is refused
until the ban ends, and ``retry_after`` (the 429's Retry-After) is the ban left. The ban is
started by the same atomic script that refuses, lives in the store with its own TTL, and
``limiter.reset`` lifts it. The end is a duration, or an absolute time from a callable: here
a second policy bans spammy commenters until the next local midnight.

    python examples/penalty_ban.py                      # in memory
    RATELIMIT_REDIS_URL=redis://localhost:6379/0 python examples/penalty_ban.py

In a web app, give the same policy to the middleware:
``RateLimitMiddleware(app, limiter, rules=[Rule("/like", LIKES, methods=["POST"])])``.
"""

from __future__ import annotations

import datetime as dt
import math
import os
from collections.abc import Callable
from zoneinfo import ZoneInfo

import ratelimit_mw as rl

LIKES = rl.Policy("10/10 seconds", name="likes", penalty="1 hour")


def until_local_midnight(zone: str, now: Callable[[], float] | None = None
                         ) -> Callable[[], dt.datetime]:
    """A penalty callable: the ban ends at the next midnight in `zone` (an aware datetime)."""
    tz = ZoneInfo(zone)

    def end() -> dt.datetime:
        today = (dt.datetime.now(tz) if now is None
                 else dt.datetime.fromtimestamp(now(), tz)).date()
        return dt.datetime.combine(today + dt.timedelta(days=1), dt.time(), tzinfo=tz)

    return end


COMMENTS = rl.Policy("3/minute", name="comments", penalty=until_local_midnight("Asia/Shanghai"))


def like(limiter: rl.Limiter, user: str, policy: rl.Policy = LIKES) -> str:
    decision = limiter.hit(policy, user)
    if decision.allowed:
        return f"liked ({decision.remaining} left in this window)"
    if decision.banned:
        return f"banned: try again in {math.ceil(decision.retry_after)} s"
    return f"slow down: try again in {math.ceil(decision.retry_after)} s"


def make_limiter() -> rl.Limiter:
    url = os.environ.get("RATELIMIT_REDIS_URL")
    return rl.Limiter(rl.RedisBackend.from_url(url)) if url else rl.Limiter()


def main() -> None:
    limiter = make_limiter()
    limiter.reset(LIKES, "alice")
    for n in range(1, 13):
        print(f"like {n:2}: {like(limiter, 'alice')}")
    print("an admin forgives alice:", end=" ")
    limiter.reset(LIKES, "alice")
    print(like(limiter, "alice"))
    limiter.reset(LIKES, "alice")


if __name__ == "__main__":
    main()
