"""Functions the reliability tests run in spawned processes (importable, no pytest)."""

from __future__ import annotations

import time
from typing import Any

import ratelimit_mw as rl

SKEW_LIMIT = 7


def skew_policies() -> dict[str, rl.Policy]:
    """One policy per algorithm, plus calendar days whose boundaries the app's clock picks."""
    out = {code: rl.Policy(f"{SKEW_LIMIT}/day", algorithm=name, name="skew")
           for code, name in {"fw": "fixed-window", "sl": "sliding-log",
                              "sw": "sliding-window", "gc": "gcra"}.items()}
    out["fw-tz"] = rl.Policy(f"{SKEW_LIMIT}/day", algorithm="fixed-window",
                             tz="Asia/Shanghai", name="skew-tz")
    return out


def calendar_policies() -> dict[str, rl.Policy]:
    """Calendar days and weeks (fixed-window with tz=), in zones with and without DST."""
    return {
        "shanghai-day": rl.Policy(f"{SKEW_LIMIT}/day", algorithm="fixed-window",
                                  tz="Asia/Shanghai", name="cal-sh"),
        "new-york-day": rl.Policy(f"{SKEW_LIMIT}/day", algorithm="fixed-window",
                                  tz="America/New_York", name="cal-ny"),
        "paris-week": rl.Policy(f"{SKEW_LIMIT}/week", algorithm="fixed-window",
                                tz="Europe/Paris", name="cal-paris"),
    }


def skewed_hammer(url: str, prefix: str, identity: str, skew: float, start_at: float,
                  attempts: int, calendar: bool = False) -> dict[str, Any]:
    """An app process whose clock is `skew` seconds off: hit every policy `attempts` times.

    ``time.time`` is replaced for the whole process, as a misconfigured server would have it;
    ``calendar`` hits `calendar_policies` instead of one policy per algorithm;
    the limiter is built without ``clock=``, as in production, so Redis's clock decides.
    """
    real = time.time
    time.time = lambda: real() + skew
    try:
        backend = rl.RedisBackend.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        limiter = rl.Limiter(backend, prefix=prefix)
        policies = calendar_policies() if calendar else skew_policies()
        for policy in policies.values():
            limiter.peek(policy, identity)  # connected and scripts loaded before the start
        while real() < start_at:
            time.sleep(0.001)
        admitted = dict.fromkeys(policies, 0)
        last: dict[str, float] = {}
        for _ in range(attempts):
            for name, policy in policies.items():
                decision = limiter.hit(policy, identity)
                admitted[name] += decision.allowed
                if decision.allowed:
                    last[name] = decision.reset_after
        backend.close()
        return {"clock_offset": time.time() - real(), "admitted": admitted,
                "reset_after": last}
    finally:
        time.time = real
