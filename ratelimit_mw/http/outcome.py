"""What the store's answer, or its failure, makes of a request: the `Admit` of an admitted
decision (its headers, raw or not), the 429 of a refusal (kept while a flood gets the same
decision), shadow mode's report, and the failure policy (the breaker, one per node on a
cluster; the memory stand-in; ``on_backend_error``). `Guard` is made of it (`Outcomes`)
and of what happens after the response (`http.after`).
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter, time
from typing import Any

from ratelimit_mw.backends.memory import MemoryBackend
from ratelimit_mw.core.decision import Decision
from ratelimit_mw.core.errors import BackendError
from ratelimit_mw.http import slots as _slots
from ratelimit_mw.http.breaker import Breaker, Breakers
from ratelimit_mw.http.config import Config
from ratelimit_mw.http.headers import (
    Headers,
    encode_raw,
    rate_limit_headers,
    refusal_shape,
    too_many_requests_body,
    unavailable_body,
)
from ratelimit_mw.http.selection import Selection
from ratelimit_mw.http.verdict import PASS, Admit, Plan, Refuse, Unavailable, admitted
from ratelimit_mw.limiter import Limiter
from ratelimit_mw.log import ThrottledLog, describe
from ratelimit_mw.metrics import BACKEND_ERROR, BREAKER_OPEN, FALLBACK, SHADOW_REFUSED

_NO_STORE = ("Cache-Control", "no-store")
_JSON = ("Content-Type", "application/json")
# NamedTuples built per request skip their generated __new__ (fields given in order).
_new = tuple.__new__


class Outcomes:
    """The part of `Guard` that turns the store's answer, or its failure, into the verdict."""

    config: Config
    limiter: Any
    timeout: float | None
    raw: bool
    headers: bool
    legacy: bool
    shadow: bool
    slots: _slots.Slots
    log_failure: ThrottledLog

    def set_up_outcomes(self, config: Config, limiter: Any, timeout: float | None) -> None:
        """Set up the failure policy: the breaker (one per node on a cluster), the memory
        stand-in, the 503, the last 429 kept."""
        policy = config.on_backend_error
        self.breaker = Breaker(config.backend_cooldown,
                               repr(policy) if isinstance(policy, str) else "<callable>",
                               deadline=timeout)
        self.nodes = Breakers.per_node(self.breaker, limiter)  # None but on a cluster
        # on_backend_error="memory": the store's stand-in while it is out, counting on
        # across outages (see `_fallback_verdict`).
        self.fallback: Any = self._fresh_fallback() if policy == "memory" else None
        retry = self.breaker.retry_after()
        self.unavailable = Unavailable(
            503, [_JSON, _NO_STORE, ("Retry-After", str(retry))], unavailable_body(retry)
        )
        # The last refusal rendered, with what of its Decision it renders (`refusal_shape`)
        # and its Selection: a flood's refusals render alike for up to a second (the
        # Retry-After seconds), whatever the store's milliseconds. One tuple, replaced
        # whole (threads may share the guard).
        self._last_refusal: tuple[tuple[Any, ...], Selection, Refuse] | None = None
        # Handed to an on_backend_error callable while the breaker skips the backend.
        self._cooling = BackendError(
            "the rate-limit backend failed recently; not calling it during the cool-down"
        )

    # -- the backend's answer --------------------------------------------------------------
    def refused(self, request: Any, plan: Plan, decision: Decision, started: float,
                refundable: bool) -> Admit | Refuse:
        """An answer as the response it makes: headers, a 429, shadow mode's report;
        `refundable`: the response's status may give the hit back."""
        selection = plan.selection
        if decision.allowed:
            return self.admitter(selection)(decision, plan if refundable else None)
        self._notify_refusal(request, decision)
        if self.shadow:
            self.observe(SHADOW_REFUSED, [check.policy.name for check in plan.checks
                                           if check.policy is decision.policy],
                          perf_counter() - started if started else 0.0)
            if not self.headers:
                return admitted(decision, None, None)
            return self._headed(decision, self.served_headers(decision, selection), None)
        shape = refusal_shape(decision)
        last = self._last_refusal
        if last is not None and last[1] is selection and last[0] == shape:
            kept = last[2]  # its headers and body; this request's own decision
            return (kept if kept.decision is decision
                    else _new(Refuse, (decision, 429, kept.headers, kept.body)))
        refusal = Refuse(decision, 429, self.refusal_headers(decision, selection),
                         too_many_requests_body(decision))
        self._last_refusal = (shape, selection, refusal)
        return refusal

    def admitter(self, selection: Selection) -> Callable[[Decision, Plan | None], Admit]:
        """How an admitted decision of `selection` becomes its Admit (headers or none, raw or
        not, legacy fields or not), chosen once per selection and guard and kept on it."""
        kept = selection.admit
        if kept is not None and kept[0] is self:
            return kept[1]
        header, legacy = selection.policy_header, self.legacy

        def bare(decision: Decision, refund: Plan | None) -> Admit:
            return admitted(decision, None, refund)

        def headed(decision: Decision, refund: Plan | None) -> Admit:
            # served_headers, less the Retry-After filter an admitted response never needs.
            return self._headed(decision, rate_limit_headers(decision, header, legacy), refund)

        admit: Callable[[Decision, Plan | None], Admit] = (
            bare if not self.headers
            else headed if legacy else header.admitter(admitted, self.raw))
        selection.admit = (self, admit)
        return admit

    def _headed(self, decision: Decision, headers: Headers, refund: Plan | None) -> Admit:
        """An Admit with these headers, in the form the adapter sends (`raw` or not)."""
        if self.raw:
            return admitted(decision, None, refund, encode_raw(headers))
        return admitted(decision, headers, refund)

    def failed(self, request: Any, plan: Plan, exc: BaseException | None, *,
               peek: bool = False) -> Admit | Refuse | Unavailable:
        """The failure policy; `exc` None: the breaker skipped the backend; `peek`: the
        plan was only asked about, so the memory stand-in asks too."""
        names = [policy.name for policy in plan.compiled.policies]
        if exc is None:
            self.observe(BREAKER_OPEN if self.fallback is None else FALLBACK, names, 0.0)
            error: BaseException = self._cooling
        else:
            if not isinstance(exc, BackendError):
                # The limiter reports the BackendErrors it raises; a call cut off by the
                # deadline (or anything else) it never saw end: one event per request.
                self.observe(BACKEND_ERROR, names,
                              self.timeout if isinstance(exc, TimeoutError) and self.timeout
                              else 0.0)
            (self.breaker if self.nodes is None else self.nodes.of(plan.identities)).failed(
                describe(exc, self.timeout), exc)
            error = exc
        if self.fallback is not None:
            return self._fallback_verdict(request, plan, peek)
        return PASS if self._admit_on_error(request, error) else self.unavailable

    def _fresh_fallback(self) -> Any:
        # The limiter's clock as it is at each call (a test's, else this process's) stands in
        # for the store's.
        return Limiter(MemoryBackend(), prefix=getattr(self.limiter, "prefix", "rl"),
                       deny_cache=0,
                       clock=lambda: (getattr(self.limiter, "clock", None) or time)())

    def _fallback_verdict(self, request: Any, plan: Plan, peek: bool) -> Admit | Refuse:
        """on_backend_error="memory": the same checks, decided in this process's memory,
        which keeps what every outage counted until its windows end (per worker: in one
        window the store admits up to the limit and each of N workers up to the limit, so
        (N + 1) x the limit however often the store fails). What it admits is never given
        back (count_when): the store never recorded it. In-flight slots are taken in it too
        (per worker, as the rates), and given back and renewed there (`slots.Slots.local`)."""
        checks, fallback, token = plan.checks, self.fallback, plan.token
        try:
            if peek:
                decision = fallback.peek(*checks[0][:2])
            elif token is None:
                decision = fallback.check(checks)
            else:
                decision = fallback.hit_compiled(*fallback.compiled_checks(checks), token=token)
        except Exception as exc:  # the memory backend's own failure: admit, as "allow"
            self.log_failure("ratelimit_mw in-memory fallback failed; admitting", exc)
            return PASS
        holds = token is not None and not peek and decision.allowed
        if holds:
            self.slots.taken_here(self.limiter, checks, token)  # type: ignore[arg-type]
        return self.refused(request, plan, decision, 0.0, holds)

    def _admit_on_error(self, request: Any, exc: BaseException) -> bool:
        policy = self.config.on_backend_error
        if policy == "allow":
            return True
        if policy == "deny":
            return False
        try:
            return bool(policy(request, exc))  # type: ignore[operator]
        except Exception as hook_exc:
            self.log_failure("ratelimit_mw on_backend_error callable raised; admitting",
                             hook_exc)
            return True

    def _notify_refusal(self, request: Any, decision: Decision) -> None:
        hook = self.config.on_refusal
        if hook is None:
            return
        try:
            hook(request, decision)
        except Exception as exc:
            self.log_failure("ratelimit_mw on_refusal hook raised", exc)

    def observe(self, event: Any, policies: list[str], seconds: float) -> None:
        hook = getattr(self.limiter, "metrics", None)
        if hook is None:
            return
        try:
            for name in dict.fromkeys(policies):
                hook.observe(event, name, seconds)
        except Exception as exc:  # a metrics bug must not fail the request
            self.log_failure("ratelimit_mw metrics hook raised", exc)

    # -- headers ---------------------------------------------------------------------------
    def served_headers(self, decision: Decision, selection: Selection) -> Headers:
        """Headers for a response the app serves (admitted, or refused in shadow mode)."""
        headers = rate_limit_headers(decision, selection.policy_header, self.legacy)
        if not decision.allowed:
            # A shadow refusal was served: Retry-After would tell the client to back off
            # from a response it just got.
            headers = [item for item in headers if item[0] != "Retry-After"]
        return headers

    def refusal_headers(self, decision: Decision, selection: Selection) -> Headers:
        """What every 429 carries: Retry-After, RateLimit, RateLimit-Policy, no caching."""
        return [_NO_STORE, *rate_limit_headers(decision, selection.policy_header,
                                               self.legacy)]
