"""Scheduled bookings: "push at most 1 message a minute, 5 an hour, 10 a day per user, for
messages scheduled at arbitrary times".

``limiter.reserve(policy, user, at=when)`` admits a booking only if EVERY window of every tier
that contains ``when`` stays within its limit, counting the bookings already made before and
after it (and the hits: they share one log). A refused booking's ``retry_after`` is how much
later the same booking would first fit, so the scheduler can offer that slot instead. An
admitted booking's ``decision.booking`` is what ``limiter.cancel`` needs to take it back.

    python examples/scheduled_push.py                   # in memory
    RATELIMIT_REDIS_URL=redis://localhost:6379/0 python examples/scheduled_push.py
"""

from __future__ import annotations

import datetime as dt
import math
import os

import ratelimit_mw as rl

PUSH = rl.Policy("1/minute;5/hour;10/day", name="push")  # sliding-log: the default


def schedule(limiter: rl.Limiter, user: str, wanted: dt.datetime
             ) -> tuple[dt.datetime, rl.Booking] | None:
    """Book a push at `wanted`, or at the first later time that fits; None if it never will."""
    decision = limiter.reserve(PUSH, user, at=wanted)
    if not decision.allowed:
        if decision.retry_after == math.inf:
            return None
        wanted += dt.timedelta(seconds=decision.retry_after)
        decision = limiter.reserve(PUSH, user, at=wanted)  # fits, unless someone just took it
    if decision.booking is None:
        return None
    return wanted, decision.booking


def make_limiter() -> rl.Limiter:
    url = os.environ.get("RATELIMIT_REDIS_URL")
    return rl.Limiter(rl.RedisBackend.from_url(url)) if url else rl.Limiter()


def main() -> None:
    limiter = make_limiter()
    limiter.reset(PUSH, "carol")
    start = dt.datetime.now(dt.timezone.utc).replace(microsecond=0) + dt.timedelta(hours=1)
    requests = [start + dt.timedelta(minutes=m) for m in (0, 0.5, 10, 20, 30, 40, 45, 50)]
    booked = []
    for wanted in requests:
        result = schedule(limiter, "carol", wanted)
        if result is None:
            print(f"wanted {wanted:%H:%M:%S}: cannot be sent")
            continue
        when, booking = result
        booked.append(booking)
        moved = "" if when == wanted else f" (moved from {wanted:%H:%M:%S})"
        print(f"wanted {wanted:%H:%M:%S}: booked for {when:%H:%M:%S}{moved}")
    limiter.cancel(booked[0])
    print("cancelled the first push; its slot is free again:",
          limiter.reserve(PUSH, "carol", at=requests[0]).allowed)
    limiter.reset(PUSH, "carol")


if __name__ == "__main__":
    main()
