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


def skewed_hammer(url: str, prefix: str, identity: str, skew: float, start_at: float,
                  attempts: int) -> dict[str, Any]:
    """An app process whose clock is `skew` seconds off: hit every policy `attempts` times.

    ``time.time`` is replaced for the whole process, as a misconfigured server would have it;
    the limiter is built without ``clock=``, as in production, so Redis's clock decides.
    """
    real = time.time
    time.time = lambda: real() + skew
    try:
        backend = rl.RedisBackend.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        limiter = rl.Limiter(backend, prefix=prefix)
        policies = skew_policies()
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
