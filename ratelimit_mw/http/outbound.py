"""What the outbound transports share, without I/O: their options, validated once; a request's
identity and cost; what a response settles at; whether it pauses its key.

The transports are one core (`ratelimit_mw._async.transport`, and its generated sync twin)
bound to each HTTP library by a few lines (`ratelimit_mw.httpx`, `ratelimit_mw.httpx2`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, Literal, TypeAlias, TypeVar

from ratelimit_mw.core import codec
from ratelimit_mw.core.decision import Decision
from ratelimit_mw.core.errors import BackendError, ConfigurationError
from ratelimit_mw.core.policy import Policy, as_policy
from ratelimit_mw.http.usage import Events, Meter, is_event_stream, pause_of
from ratelimit_mw.limiter import AsyncLimiter, Limiter
from ratelimit_mw.log import ThrottledLog

# The request and response are the binding's library's (httpx or httpx2): typed there.
RequestKey: TypeAlias = Callable[[Any], "str | None"]
RequestCost: TypeAlias = Callable[[Any], int]
ResponseCost: TypeAlias = Callable[[Any], "int | None"]
Settle: TypeAlias = "Literal['usage'] | Events | ResponseCost | None"
On429: TypeAlias = Literal["pause", "raise", "pass"]


def host_key(request: Any) -> str:
    """The default key: the request's host, with its port when the URL names a non-default one."""
    return request.url.netloc.decode("ascii")  # type: ignore[no-any-return]


def _obey_pauses() -> None:
    """The penalty of a transport's policy: no ban of its own, but a pause binds it."""
    return None


def obeying_pauses(policy: Policy) -> Policy:
    """`policy`, or its namesake (the same counters) that reads the pauses of its key."""
    if policy.penalty is not None:
        return policy
    return Policy(policy.rates, algorithm=policy.algorithm, name=policy.name,
                  penalty=_obey_pauses, tz=None if policy.tz is None else policy.tz.key)


__all__ = ["Events", "Throttled", "host_key", "obeying_pauses"]

L = TypeVar("L", Limiter, AsyncLimiter)


class Throttled(Generic[L]):
    """What every transport takes, validated once; the bindings name the limiter and sender."""

    _limiter_type: type[Limiter] | type[AsyncLimiter]
    _sender: type[Any]  # the transport that sends when none is given
    _hint: str

    def __init__(
        self,
        limiter: L,
        policy: Policy | str,
        *,
        key: str | RequestKey | None = None,
        cost: int | RequestCost = 1,
        timeout: float | None = None,
        wait_out: bool = False,
        on_backend_error: str = "allow",
        wrapped: Any = None,
        calls: Policy | str | None = None,
        settle: Settle = None,
        refusals: Literal["free", "estimate"] = "free",
        abandoned: Literal["estimate", "seen"] = "estimate",
        on_429: On429 = "pause",
        concurrency: Policy | int | None = None,
    ) -> None:
        if not isinstance(limiter, self._limiter_type):
            raise ConfigurationError(
                f"{type(self).__name__} needs a {self._limiter_type.__name__}, got "
                f"{limiter!r}; {self._hint}"
            )
        self.limiter: L = limiter
        self.policy = as_policy(policy)
        if key == "" or not (key is None or isinstance(key, str) or callable(key)):
            raise ConfigurationError(
                f"key must be a non-empty identity, a callable (request) -> str | None, or None "
                f'for the host; got {key!r}. e.g. key="payments" or key=lambda r: r.url.host'
            )
        self._key = host_key if key is None else key
        if not callable(cost):
            codec.validate_cost(cost)
        self._cost = cost
        if timeout is not None and (isinstance(timeout, bool)
                                    or not isinstance(timeout, (int, float)) or timeout < 0):
            raise ConfigurationError(
                f"timeout is how many seconds a call may wait for its quota (None: as long as "
                f"it takes, 0: no wait), got {timeout!r}; e.g. timeout=5"
            )
        self.timeout = timeout
        self.wait_out = bool(wait_out)
        if on_backend_error not in ("allow", "raise"):
            raise ConfigurationError(
                f'on_backend_error must be "allow" (send unthrottled, log) or "raise" '
                f"(BackendError), got {on_backend_error!r}"
            )
        self._allow_on_error = on_backend_error == "allow"
        self.calls = None if calls is None else as_policy(calls)
        if not (settle is None or settle == "usage" or isinstance(settle, Events)
                or (callable(settle) and not isinstance(settle, str))):
            raise ConfigurationError(
                f'settle is "usage" (OpenAI\'s and Anthropic\'s usage, from a JSON body or '
                f"the stream's events), Events(read) for another format, or a callable "
                f"(response) -> the actual cost; got {settle!r}. e.g. settle=\"usage\"")
        self._settle = settle
        for name, value, allowed in (("refusals", refusals, ("free", "estimate")),
                                     ("abandoned", abandoned, ("estimate", "seen")),
                                     ("on_429", on_429, ("pause", "raise", "pass"))):
            if value not in allowed:
                raise ConfigurationError(f"{name} is one of {', '.join(map(repr, allowed))}, "
                                         f"got {value!r}; e.g. {name}={allowed[0]!r}")
        self.refusals, self.abandoned, self.on_429 = refusals, abandoned, on_429
        # What each charge reserves under: the policy, reading the pauses a 429 sets.
        self._charged = self.policy if on_429 == "pass" else obeying_pauses(self.policy)
        if concurrency is not None and not isinstance(concurrency, Policy):
            concurrency = Policy.in_flight(concurrency, name=f"{self.policy.name} in flight")
        if concurrency is not None and concurrency.algorithm != "concurrency":
            raise ConfigurationError(f"concurrency is a number of slots or a "
                                     f"Policy.in_flight(...), got {concurrency!r}")
        self.concurrency = concurrency
        self._lease = (concurrency.rates[0].period_ms / 1000 if concurrency is not None
                       else 0.0)
        self._log_failure = ThrottledLog()
        self.wrapped = wrapped if wrapped is not None else self._sender()

    def _quota(self, request: Any) -> tuple[str, int] | None:
        """(identity, cost) of `request`, or None when it is not throttled."""
        identity = self._key if isinstance(self._key, str) else self._key(request)
        if identity is None:
            return None
        if not isinstance(identity, str):
            raise ConfigurationError(f"the key function of the transport must return a "
                                     f"string or None, got {identity!r}")
        if isinstance(self._cost, int):
            return identity, self._cost
        cost = self._cost(request)
        codec.validate_cost(cost)
        return identity, cost

    def _meter(self, response: Any) -> Meter | None:
        """A meter for the body of `response` when the cost is read from it as it passes
        ("usage", Events), else None (no settle, or the user's callable on the whole body)."""
        settle = self._settle
        if settle is None or not (settle == "usage" or isinstance(settle, Events)):
            return None
        return Meter(is_event_stream(response.headers),
                     settle if isinstance(settle, Events) else None)

    def _actual(self, response: Any) -> int | None:
        """What the user's callable makes of the (read) response, or None: it says nothing
        (None, raised: logged unless the response is a refusal)."""
        try:
            actual = self._settle(response)  # type: ignore[misc,operator]
        except Exception as exc:
            if response.status_code < 400:
                self._log_failure("ratelimit_mw: settle= raised; the estimate stays charged",
                                  exc)
            return None
        if actual is None:
            return None
        if isinstance(actual, bool) or not isinstance(actual, int) or actual < 0:
            self._log_failure(f"ratelimit_mw: settle= returned {actual!r}, not a whole cost "
                              ">= 0; the estimate stays charged")
            return None
        return actual

    def _settles_at(self, status: int, said: int | None, ended: bool = True) -> int | None:
        """What a ticket settles at: what the answer said it used; else nothing for a refusal
        (a status >= 400, by default); else, for a stream its caller closed half way,
        `abandoned`'s rule; else None (the estimate stays)."""
        if not ended:
            return said if self.abandoned == "seen" else None
        if said is not None:
            return said
        if status >= 400 and self.refusals == "free":
            return 0
        if status < 400 and self._settle is not None:
            self._log_failure(f"ratelimit_mw: a {status} answer said nothing of its usage "
                              "(settle=); the estimate stays charged")
        return None

    def _pause_for(self, response: Any) -> float | None:
        """The seconds this response pauses its key for, fleet-wide (None: it does not)."""
        if self.on_429 == "pass":
            return None
        status = response.status_code
        if status != 429 and "ratelimit" not in response.headers \
                and "ratelimit-remaining" not in response.headers:
            return None
        return pause_of(status, response.headers)

    def _refused(self, identity: str, seconds: float) -> Decision:
        """The Decision an `on_429="raise"` transport raises: paused for `seconds`."""
        return Decision(False, self.policy.smallest_limit, 0, seconds, seconds, self.policy,
                        self.policy.rates[0], identity, True)

    def _gave_up(self, what: str, exc: Exception) -> None:
        """A slot's release or renewal, a settle or a pause failed: logged, never raised."""
        self._log_failure(f"ratelimit_mw: could not {what}", exc)

    def _failed(self, exc: BackendError) -> None:
        """A backend failure: re-raise, or log (throttled) and let the call through."""
        if not self._allow_on_error:
            raise exc
        self._log_failure("ratelimit_mw: the rate-limit backend failed; sending unthrottled", exc)


