"""What happens after an admitted response: the hits its status gives back (a 405 not
charged, a count_when that says no), the in-flight slots it held, given back together by
the hit's token, and whether the store may be asked now. `Guard` is made of it
(`AfterResponse`); the calls themselves are in `http.slots`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ratelimit_mw.core.codec import Check
from ratelimit_mw.core.policy import CONCURRENCY
from ratelimit_mw.http.breaker import Breaker
from ratelimit_mw.http.verdict import Admit, Held, give_back_of
from ratelimit_mw.log import ThrottledLog, describe


class AfterResponse:
    """The part of `Guard` that says what an admitted response gives back when it ends."""

    limiter: Any
    timeout: float | None
    charge_405: bool
    count_when: Callable[[int], bool] | None
    breaker: Breaker
    log_failure: ThrottledLog

    def given_back(self, admit: Admit, status: int) -> tuple[Check, ...]:
        """The hits an admitted response with this status gives back: every one for a 405
        not charged; else each whose count_when (its limit's own, or the middleware's) says
        False. Empty for most responses, and then nothing is sent."""
        plan = admit.plan
        if plan is None:
            return ()
        if status == 405 and not self.charge_405:
            return plan.checks
        whens = plan.whens
        if whens is None:
            count_when = self.count_when  # None for most: nothing to ask
            return (plan.checks if count_when is not None and self._given_back(count_when, status)
                    else ())
        checks = plan.checks
        return tuple(check for check, when in zip(checks, whens, strict=True)
                     if self._given_back(when or self.count_when, status))

    def released(self, admit: Admit, status: int) -> tuple[Check, ...]:
        """What an admitted response with this status sends back when it ends: the hits it
        gives back (`given_back`) and every in-flight slot it holds (given back together,
        by the hit's token)."""
        back = self.given_back(admit, status)
        plan = admit.plan
        if plan is None or plan.token is None or len(back) == len(plan.identities):
            return back
        return tuple(check for check in plan.checks
                     if check.policy.algorithm == CONCURRENCY or check in back)

    give_back_of = staticmethod(give_back_of)

    def holding(self, admit: Admit) -> Held | None:
        """The slots an admitted request holds while its response runs (None: none)."""
        plan = admit.plan
        if plan is None or plan.token is None:
            return None
        return Held(admit, self.limiter.monotonic)

    def _given_back(self, count_when: Callable[[int], bool] | None, status: int) -> bool:
        if count_when is None:
            return False
        try:
            return not count_when(status)
        except Exception as exc:
            self.log_failure("ratelimit_mw count_when raised; keeping the hit", exc)
            return False

    def may_refund(self) -> bool:
        """Whether to try a refund now: not while the breaker skips a backend known down."""
        if self.breaker.is_open:
            self.log_failure("ratelimit_mw: backend cooling down; a hit that should have been "
                             "given back stays counted (in-flight slots: until it answers)")
            return False
        return True

    def refund_failed(self, exc: BaseException) -> None:
        self.breaker.failed(describe(exc, self.timeout), exc)
        self.log_failure("ratelimit_mw: could not give back a hit; it stays counted (in-flight "
                         "slots: until the store answers)", exc)
