"""What Limiter and AsyncLimiter share: their options, the decorators, the compiled calls, and
the deny cache's and the metrics' bookkeeping around each call. No I/O here.

`AsyncLimiter` (`ratelimit_mw/_async/limiter.py`) is the one source of the I/O: it hands each
`ScriptCall` to the backend and the reply back to the core; `Limiter` is generated from it
(`scripts/unasync.py`), so the two can never drift apart.
"""

from __future__ import annotations

import datetime as _dt
import random
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypedDict, TypeVar

from ratelimit_mw.arguments import at_ms, checked, metrics_hook, validate_prefix
from ratelimit_mw.core import codec
from ratelimit_mw.core.codec import Check, GiveBack, ScriptCall
from ratelimit_mw.core.compiled import Compiled, refunds
from ratelimit_mw.core.decision import Booking, Decision
from ratelimit_mw.core.deny_cache import DEFAULT_MAX_AGE, DenyCache, Lapsed
from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.core.policy import Policy, SharedLogs
from ratelimit_mw.hooks import refuse_async
from ratelimit_mw.log import ThrottledLog
from ratelimit_mw.metrics import ADMITTED, BACKEND_ERROR, REFUSED, Event, MetricsHook
from ratelimit_mw.routing import RouteLimit, exempt, limit_decorator

F = TypeVar("F", bound=Callable[..., Any])

# Distinct (policy, cost) sets compiled and kept: the middleware's selections, plus those
# that dynamic limits and costs make per request; cleared whole when full.
_COMPILED_CACHE_SIZE = 1024

# Every limiter made in this process, for `ratelimit_mw.testing` (weak: never kept alive),
# and what each new one is handed to as its construction ends: the isolations active then,
# so that a limiter an app builds during a test is isolated too.
_LIVE: weakref.WeakSet[_Shared] = weakref.WeakSet()
_ON_NEW: list[Callable[[Any], None]] = []

# What a limiter of each side needs of its backend, and what to write instead.
_BACKEND_NEEDS = {
    "run": "Limiter needs a sync backend (MemoryBackend or RedisBackend), got {!r}; for "
           "redis.asyncio use AsyncLimiter(AsyncRedisBackend(...))",
    "arun": "AsyncLimiter needs an async backend (MemoryBackend or AsyncRedisBackend), got "
            "{!r}; a sync redis.Redis would block the event loop: use "
            "AsyncRedisBackend(redis.asyncio.Redis(...))",
}


class _Switch:
    """Limiting on or off for every middleware, decorator and dependency of the process
    (`Guard.plan` reads it per request); only `ratelimit_mw.testing` turns it off."""

    __slots__ = ("off",)

    def __init__(self) -> None:
        self.off = False


SWITCH = _Switch()


def live_limiters() -> list[_Shared]:
    """The limiters alive in this process."""
    return list(_LIVE)


class LimiterOptions(TypedDict, total=False):
    """The keyword options Limiter and AsyncLimiter share (written once, typed for both)."""

    clock: Callable[[], float] | None
    deny_cache: int
    deny_cache_max_age: float
    metrics: MetricsHook | None


class _Shared:
    """The options, the compiled calls and the bookkeeping around each call (see the module
    docstring); `asynchronous` says which side a limiter is."""

    asynchronous: bool

    def __init__(
        self,
        backend: Any,
        prefix: str,
        *,
        needs: str,
        sleep: Callable[[float], Any],
        clock: Callable[[], float] | None = None,
        deny_cache: int = 10_000,
        deny_cache_max_age: float = DEFAULT_MAX_AGE,
        metrics: MetricsHook | None = None,
    ) -> None:
        if not callable(getattr(backend, needs, None)):
            raise ConfigurationError(_BACKEND_NEEDS[needs].format(backend))
        self._backend = backend
        # The store answers in this process (`backends.base`): decided once per store.
        self.local_store = bool(getattr(backend, "in_process", False))
        # Bumped when the store, the clock or the metrics hook is replaced
        # (`ratelimit_mw.testing`, a test's recorder): what was built for the old ones
        # (`in_process`, a handler) is built again. `_built` names the current set.
        self.generation = 0
        self._built = object()
        self.prefix = validate_prefix(prefix)
        self._clock = clock
        self._sleep = sleep
        self._metrics = metrics_hook(metrics)
        self._metrics_failed = ThrottledLog()
        # Sliding-log policies of one name share one log in the store: every policy
        # configured on this limiter (decorators, a middleware's) must keep it as long.
        self.shared_logs = SharedLogs()
        self._rng = random.Random()
        if isinstance(deny_cache, bool) or not isinstance(deny_cache, int) or deny_cache < 0:
            raise ConfigurationError(
                f"deny_cache is the number of refusals remembered in process (0 turns it off), "
                f"got {deny_cache!r}; e.g. deny_cache=10_000"
            )
        deny = DenyCache(deny_cache, deny_cache_max_age)  # validates the age even when off
        self._deny = deny if deny_cache else None
        self._compiled: dict[tuple[tuple[Policy, int], ...], Compiled] = {}
        # `hit`'s in-process decision of a cost of one, by the policy (or its text) as given:
        # one lookup per hit (`_here_of`).
        self._hits_here: dict[Policy | str, Callable[[Sequence[str], str | None],
                                                     Decision]] = {}
        self._semaphores: dict[tuple[str, int, float], Policy] = {}
        # Last: everything an isolation saves and replaces is set by now.
        _LIVE.add(self)
        for isolate in list(_ON_NEW):  # noqa: PERF101 - a copy: one may end meanwhile
            isolate(self)

    @property
    def backend(self) -> Any:
        """The store; assigning another one routes every later call to it (and empties the
        deny cache: its refusals were the other store's)."""
        return self._backend

    @backend.setter
    def backend(self, backend: Any) -> None:
        self._backend = backend
        self.local_store = bool(getattr(backend, "in_process", False))
        self._rebuild()
        deny = self._deny
        if deny is not None:  # what it holds, the other store said
            self._deny = DenyCache(deny.size, deny.max_age_us / 1e6, deny.max_bytes)

    @property
    def clock(self) -> Callable[[], float] | None:
        """The clock the store is given instead of its own (tests), in seconds; None: the
        store's."""
        return self._clock

    @clock.setter
    def clock(self, clock: Callable[[], float] | None) -> None:
        self._clock = clock
        self._rebuild()

    @property
    def metrics(self) -> MetricsHook | None:
        """The hook told of every hit (`ratelimit_mw.metrics`); None: none."""
        return self._metrics

    @metrics.setter
    def metrics(self, metrics: MetricsHook | None) -> None:
        self._metrics = metrics_hook(metrics)
        self._rebuild()

    def _rebuild(self) -> None:
        """What was built around the store, its clock and the metrics hook is built again."""
        self.generation += 1
        self._built = object()
        self._hits_here = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.backend!r}, prefix={self.prefix!r})"

    # -- decorators (metadata only; the middleware enforces) -----------------------------
    def limit(
        self,
        rates: Policy | str | Callable[[Any], str | None] | None = None,
        *,
        key: Callable[[Any], str | None] | None = None,
        cost: int | Callable[[Any], int] = 1,
        name: str | None = None,
        methods: Sequence[str] | None = None,
        exempt_when: Callable[[Any], bool] | None = None,
        count_when: Callable[[int], bool] | None = None,
        concurrency: Policy | int | None = None,
    ) -> Callable[[F], F]:
        """Limit one route: ``@limiter.limit("5/minute")`` on a view or endpoint;
        ``count_when(status) -> bool``: a response for which it is False gives this limit's
        hit back; ``concurrency=N`` (or a `Policy.in_flight`): at most N of the key's
        requests in flight at once, beside the rate or alone (``limit(concurrency=4)``).
        A sync Limiter's routes are WSGI or Flask views, which cannot await an async
        hook."""
        if not self.asynchronous:
            refuse_async("a Limiter's routes (WSGI, Flask)", [
                ("key", key), ("exempt_when", exempt_when),
                ("cost", cost if callable(cost) else None),
                ("rates", rates if callable(rates) and not isinstance(rates, Policy) else None)])
        return limit_decorator(RouteLimit.make(rates, key=key, cost=cost, name=name,
                                               methods=methods, exempt_when=exempt_when,
                                               count_when=count_when, concurrency=concurrency),
                               self.shared_logs)

    def exempt(self, func: F) -> F:
        """Exempt one route from the middleware's default limits."""
        return exempt(func)

    # -- clocks ------------------------------------------------------------------------------
    def _now_us(self) -> int | None:
        """The `now` a call carries: None (the store's clock) unless a test gave a clock."""
        clock = self._clock
        return None if clock is None else round(clock() * 1_000_000)

    def _clock_ms(self) -> int:
        return int((self._clock or time.time)() * 1000)

    def monotonic(self) -> float:
        return time.monotonic() if self._clock is None else self._clock()

    def _cache_now(self) -> int:
        """The deny cache's clock in µs: the test clock (exactly the `now` the store is given),
        else a monotonic one (an answer counts down from its call's send: never past the
        store's own)."""
        return time.monotonic_ns() // 1000 if self._clock is None else round(self._clock() * 1e6)

    # -- building calls ----------------------------------------------------------------------
    def compile(self, items: Sequence[tuple[Policy, int]]) -> Compiled:
        """The `Compiled` calls of these (policy, cost) pairs under this limiter's prefix, built
        once per distinct set (a bounded cache: dynamic limits and costs make new sets)."""
        key = tuple(items)
        found = self._compiled.get(key)
        if found is None:
            found = Compiled(key, self.prefix)
            if len(self._compiled) >= _COMPILED_CACHE_SIZE:
                self._compiled.clear()
            self._compiled[key] = found
        return found

    def _in_flight(self, name: str, slots: int, lease: float) -> Policy:
        """The in-flight policy of a named semaphore, one per (name, slots, lease): its
        compiled calls are then built once."""
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f'a semaphore is named by a non-empty string, got {name!r}; '
                                     'e.g. concurrent("vendor", 50)')
        key = (name, slots, lease)
        found = self._semaphores.get(key)
        if found is None:
            found = Policy.in_flight(slots, lease=lease, name=name)
            if len(self._semaphores) >= _COMPILED_CACHE_SIZE:
                self._semaphores.clear()
            self._semaphores[key] = found
        return found

    def _compiled_hit(self, policy: Policy | str, identity: str, cost: int) -> Compiled:
        """One check's compiled calls, its arguments checked as `checked` does: a Check is
        built only to raise, or to parse a policy given as text."""
        if (type(policy) is not Policy or type(identity) is not str or type(cost) is not int
                or cost < 1 or cost > policy.max_cost):
            policy = checked(policy, identity, cost).policy
        items = ((policy, cost),)
        found = self._compiled.get(items)  # `compile`, its cache asked here
        return found if found is not None else self.compile(items)

    def compiled_checks(self, checks: Sequence[Check]) -> tuple[Compiled, tuple[str, ...]]:
        """`checks` as the compiled calls and their identities."""
        if len(checks) == 1:  # most give-backs: one policy's slots, or one hit
            policy, identity, cost = checks[0]
            items = ((policy, cost),)
            found = self._compiled.get(items)  # `compile`, its cache asked here
            return found if found is not None else self.compile(items), (identity,)
        return (self.compile([(check.policy, check.cost) for check in checks]),
                tuple(check.identity for check in checks))

    def _call(self, compiled: Compiled, identities: Sequence[str], op: str = codec.HIT,
              at_ms: int | str | None = None, token: str | None = None) -> ScriptCall:
        """`compiled`'s call of `op` for these identities, on this limiter's clock."""
        return compiled.call(identities, self._now_us(), token,
                             0 if compiled.static else self._clock_ms(), op, at_ms)

    def _slot_calls(self, op: str, checks: Sequence[Check], token: str | None = None,
                    at: str | None = None) -> list[ScriptCall]:
        """The calls of `op` for `checks`: one, or on a cluster one per identity's slot."""
        groups: Sequence[Sequence[Check]] = (codec.group_by_slot(checks)
                                             if self._backend.is_cluster else [checks])
        return [self._call(*self.compiled_checks(group), op, at, token) for group in groups]

    def _release_calls(self, hits: Sequence[GiveBack],
                       charge: str | None = None) -> list[ScriptCall]:
        """The calls giving back these hits: those with a token batched in one call (one per
        identity's slot on a cluster), a lone hit its own (memoised) call; each names when
        its hit was charged (lua/main.lua's ARGV[4]). The deny cache forgets every check,
        since the store changes under it. `charge`: a settle's give-back of one hit,
        "<µs>:<estimate>"."""
        if len(hits) == 1:
            checks, token, at_us = hits[0]
            self._forget(checks)
            return self._slot_calls(codec.REFUND, checks, token,
                                    charge or (str(at_us) if at_us else None))
        cluster = self._backend.is_cluster
        # Off a cluster, one call of the hits' kept keys where `refunds` can put it
        # together (each selection whole, each hit by a token of its own); else built here.
        if not cluster:
            parts = [(*self.compiled_checks(checks), token or "", str(at_us) if at_us else "-")
                     for checks, token, at_us in hits if checks]
            together = refunds(parts, self._now_us()) if parts else None
            if together is not None:
                for checks, _, _ in hits:
                    self._forget(checks)
                return [together]
        calls: list[ScriptCall] = []
        batches: dict[str, tuple[list[Check], list[str], list[str]]] = {}
        for checks, token, at_us in hits:
            self._forget(checks)
            if not token:
                calls += self._slot_calls(codec.REFUND, checks, None,
                                          str(at_us) if at_us else None)
                continue
            charged = str(at_us) if at_us else "-"
            for check in checks:
                batch = batches.setdefault(check.identity if cluster else "", ([], [], []))
                batch[0].append(check)
                batch[1].append(token)
                batch[2].append(charged)
        return calls + [codec.build(codec.REFUND, checks, self.prefix, now_us=self._now_us(),
                                    clock_ms=self._clock_ms, tokens=tokens, charges=charges)
                        for checks, tokens, charges in batches.values()]

    def _single(self, op: str, policy: Policy | str, identity: str, cost: int = 1,
                at: _dt.datetime | None = None, token: str | None = None) -> ScriptCall:
        """The call of `op` (peek, reset, refund, book, cancel) for one check; the deny
        cache forgets that check, since the store is asked, never the cache."""
        check = checked(policy, identity, cost)
        if op == codec.BOOK and check.policy.algorithm != "sliding-log":
            raise ConfigurationError(
                f"reserve needs a sliding-log policy (it checks every window around the "
                f"booked time), got algorithm={check.policy.algorithm!r}; write "
                f'Policy("1/minute;5/hour;10/day", algorithm="sliding-log")'
            )
        self._forget((check,))
        return self._call(self.compile(((check.policy, check.cost),)), (identity,), op,
                          None if at is None else at_ms(at), token)

    def _cancel_call(self, booking: Booking) -> ScriptCall:
        return self._single(codec.CANCEL, booking.policy, booking.identity, booking.cost,
                            token=booking.token)

    # -- around each hit: the deny cache and the metrics -----------------------------------
    def _cached(self, deny: DenyCache, compiled: Compiled, identities: Sequence[str]
                ) -> tuple[tuple[Check, ...], Decision | Lapsed | None]:
        """The hit's checks and the deny cache's answer to them: a refusal (reported as
        one), a lapsed one to ask the store about, or None."""
        checks = compiled.checks(identities)
        found = deny.find(checks, self._cache_now())
        if type(found) is Decision:
            self._report(checks, REFUSED, 0.0)
        return checks, found

    def _forget(self, checks: Sequence[Check]) -> None:
        if self._deny is not None:
            self._deny.forget(checks)

    def _settled(self, call: ScriptCall, compiled: Compiled, identities: Sequence[str],
                 checks: tuple[Check, ...] | None, reply: list[int], sent: int, cached: bool,
                 started: float) -> Decision:
        """The store's reply to a hit as a Decision (for a refusal, metrics or a non-empty deny
        cache). The deny cache keeps a refusal, and an admitted hit drops what it held for its
        pairs; asked after the reply, so a refusal recorded meanwhile is forgotten too."""
        deny = self._deny
        if checks is None:
            checks = compiled.checks(identities)
        if cached and deny is not None and (reply[0] != 1 or deny.index):
            deny.record(checks, call.layout, reply, sent)
        decision = codec.decoded(call, reply)
        if self._metrics is not None:
            self._report(checks, ADMITTED if decision.allowed else REFUSED,
                         time.perf_counter() - started)
        return decision

    def _here_of(self, compiled: Compiled, policy: Policy | str, cost: int
                 ) -> Callable[[Sequence[str], str | None], Decision] | None:
        """`_here` of `hit`'s `compiled`, kept by the policy as it was given where the cost is
        one (bounded: texts may vary)."""
        hits = self._hits_here  # read first: one replaced while building is not written
        kept = compiled.here
        here = kept[1] if kept[0] is self._built else self._here(compiled)
        if here is not None and cost == 1:
            if len(hits) >= _COMPILED_CACHE_SIZE:
                hits.clear()
            hits[policy] = here
        return here

    def _here(self, compiled: Compiled) -> Callable[[Sequence[str], str | None],
                                                    Decision] | None:
        """`in_process` of `compiled`, kept on it for this limiter's store, clock and metrics
        hook (`_built`)."""
        built = self._built  # read first: a clock or hook replaced meanwhile builds again
        here = self.in_process(compiled)
        compiled.here = (built, here)
        return here

    def give_back_here(self, hits: Sequence[GiveBack]) -> bool:
        """The give-back of one response's hits where the store is in this process: done
        now, no call built, with this limiter's deny cache and clock around the store's own
        `releaser`. False: several, or the store runs the refund's call."""
        if len(hits) != 1 or not self.local_store:
            return False
        checks, token, at_us = hits[0]
        compiled, identities = self.compiled_checks(checks)
        release = self._released_here(compiled)
        if release is None:  # a selection the store does not type (a calendar's, a penalty's)
            return False
        deny = self._deny
        if deny is not None:
            deny.forget(checks)
        clock = self._clock
        release(identities, token or "", None if clock is None else round(clock() * 1_000_000),
                at_us)
        return True

    def give_back_held(self, compiled: Compiled, identities: Sequence[str], token: str | None,
                       at_us: int) -> bool:
        """`give_back_here` of the in-flight slots alone of a hit of `compiled` (what most
        holders give back when their response ends), by the hit's own identities: the
        store's slots-only ``releaser``, kept on `compiled` with the store it is of."""
        if not self.local_store:
            return False
        backend = self._backend
        kept = compiled.held_release
        if kept[0] is backend:
            release = kept[1]
        else:
            make = getattr(backend, "releaser", None)
            release = make(compiled, slots_only=True) if make is not None else None
            compiled.held_release = (backend, release)
        if release is None:  # a selection the store does not type (a calendar's, a penalty's)
            return False
        # No deny-cache entry to forget: a refusal with slots is never kept (one frees
        # whenever a response ends).
        clock = self._clock
        release(identities, token or "", None if clock is None else round(clock() * 1_000_000),
                at_us)
        return True

    def _released_here(self, compiled: Compiled) -> Callable[[Sequence[str], str,
                                                             int | None, int], None] | None:
        """The in-process store's own give-back of a hit of `compiled` (its ``releaser``),
        kept on it with the store it is of; None: the store runs the refund's call."""
        backend = self._backend
        kept = compiled.release_of
        if kept[0] is backend:
            return kept[1]  # type: ignore[no-any-return]
        make = getattr(backend, "releaser", None)
        release = make(compiled) if make is not None else None
        compiled.release_of = (backend, release)
        return release

    def in_process(self, compiled: Compiled) -> Callable[[Sequence[str], str | None],
                                                         Decision] | None:
        """How the store decides `compiled` when it is in this process (the memory store's
        own typed hit, its ``hitter``), on this limiter's clock, with the metrics hook told:
        ``here(identities, token)``, no I/O and no deadline, the same on both sides. None:
        the store is elsewhere (or does not type this hit), and `hit_compiled` asks it.
        Built once per compiled hit, store, clock and metrics hook (a middleware's handler
        keeps it while `generation` stands). No deny cache stands in front of it: the
        store's own refusal costs less than the cache's lookup. Without metrics the store's
        hit is the decision: nothing is wrapped around it."""
        make = getattr(self._backend, "hitter", None)
        if make is None:
            return None
        clock = self._clock
        clock_us = None if clock is None else (lambda: round(clock() * 1_000_000))
        hit: Callable[[Sequence[str], str | None], Decision] | None = make(compiled, clock_us)
        if hit is None or self._metrics is None:
            return hit

        def here(identities: Sequence[str], token: str | None) -> Decision:
            started = time.perf_counter()
            decision = hit(identities, token)
            self._report(compiled.checks(identities), ADMITTED if decision.allowed else REFUSED,
                         time.perf_counter() - started)
            return decision

        return here

    def _failed(self, checks: Sequence[Check], started: float) -> None:
        self._report(checks, BACKEND_ERROR, time.perf_counter() - started)

    def _report(self, checks: Sequence[Check], event: Event, seconds: float) -> None:
        """One event per policy of the call (a refused call is refused under each)."""
        metrics = self._metrics
        if metrics is None:
            return
        names: list[str] = []
        try:
            for check in checks:
                name = check.policy.name
                if name not in names:
                    names.append(name)
                    metrics.observe(event, name, seconds)
        except Exception as exc:
            # A metrics bug must not change the answer: raised from here it would look like a
            # store failure, and on_backend_error="allow" would admit everyone.
            self._metrics_failed("ratelimit_mw metrics hook raised", exc)

