"""The HTTP handlers against the general semantics: a differential test (issue #44, item 4).

Hypothesis draws an app's limits (a default rate and/or in-flight slots, up to two path rules
with their own rate and/or slots, key, cost and count_when, up to two decorated routes with a
rate and/or slots, ``methods=``, or ``exempt``; the middleware's count_when, shadow mode,
charge_method_not_allowed, charge_preflight, headers and legacy_headers) and a sequence of
requests (method, path, client, team header or none, the handler's status, held open or not,
a CORS preflight or not), clock advances and ends of held responses. Each request goes
through the real middleware, ASGI (Starlette) and plain WSGI, on memory and on the real
Redis, through the public API only; `Model` (below) says from the docs what the answer must
be: which limits apply (a decorator replaces the default part by part, rules add, ``exempt``
drops the default, a limit whose key says None does not apply), per (policy, identity)
fixed-window counters and held slots on the test's clock, admitted iff every check admits (a
refusal records nothing), the response status giving its hits back (count_when False, a 405
unless charged), shadow mode serving what it would refuse. Every response's status,
RateLimit, RateLimit-Policy, Retry-After and X-RateLimit-* fields and 429 body, and then
every counter (`peek`), must be the model's.

Where the docs leave a choice open (the governing tier among tiers tied on what decides it,
the order of RateLimit-Policy's items) the model accepts each answer the docs allow. The
departures from the docs it found are held by the single cases at the end of this file.
Decorators need a router: under plain WSGI the decorated paths are plain routes.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import uuid
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
import redis.asyncio
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from support import REDIS_URL

import ratelimit_mw as rl
from ratelimit_mw import keys
from ratelimit_mw.asgi import Config, Rule

# Per adapter and store; RATELIMIT_HANDLERS_EXAMPLES=5000 for a longer search.
EXAMPLES = int(os.environ.get("RATELIMIT_HANDLERS_EXAMPLES", "300"))
START_MS = 1_800_000_000_000  # a whole minute: windows of 10 s and 60 s start on it
# Longer than any example's clock runs (and a third of it too: no renewal is ever due), so a
# slot is held exactly from its admission to its response's end.
LEASE_S = 3600
PERIODS_MS = [10_000, 60_000]
CLIENTS = ["a", "b", "c"]
TEAMS = ["x", "y"]
KEYS: dict[str, keys.KeyFunc] = {"client": keys.header("X-Client"),
                                 "team": keys.header("X-Team")}
# The app's routes: path -> methods (HEAD is served with GET); /d0 and /d1 may be decorated.
ROUTES = {"/a": ("GET", "POST"), "/b": ("GET",), "/d0": ("GET", "POST"),
          "/d1": ("GET", "POST")}
RULE_PATHS = ["/a", "/d0", "/*", "/b", "/nowhere", "/{segment}"]
METHODS = ["GET", "GET", "POST", "HEAD", "OPTIONS", "PURGE"]
PATHS = ["/a", "/a", "/b", "/d0", "/d0", "/d1", "/nowhere"]


def counts_ok(status: int) -> bool:
    return status < 400


def counts_failures(status: int) -> bool:
    return status >= 400


def counts_but_errors(status: int) -> bool:
    return status < 500


COUNT_WHEN: dict[str | None, Callable[[int], bool] | None] = {
    None: None, "ok": counts_ok, "fail": counts_failures, "not5xx": counts_but_errors}


# -- what is drawn ---------------------------------------------------------------------------


Tiers = tuple[tuple[int, int], ...]  # (limit, period in ms) of each tier


@dataclass(frozen=True)
class LimitSpec:
    """A rule's or a decorator's limit: a fixed-window rate and/or in-flight slots."""

    rate: Tiers | None
    slots: int | None
    key: str | None  # a name in KEYS; None: the middleware's
    cost: int
    count_when: str | None
    methods: tuple[str, ...] | None
    path: str = ""  # a rule's


@dataclass(frozen=True)
class AppSpec:
    default: Tiers | None
    default_slots: int | None
    rules: tuple[LimitSpec, ...]
    decorators: dict[str, LimitSpec | str]  # path -> limit or "exempt"
    count_when: str | None
    shadow: bool
    charge_405: bool
    charge_preflight: bool
    headers: bool = True
    legacy_headers: bool = False


@dataclass(frozen=True)
class Step:
    kind: str  # "request", "advance", "close"
    method: str = "GET"
    path: str = "/"
    client: str = "a"
    team: str | None = "x"  # None: no X-Team header
    status: int = 200
    hold: bool = False
    # With Access-Control-Request-Method: a CORS preflight when the method is OPTIONS.
    preflight: bool = False
    ms: int = 0
    which: int = 0  # "close": which held response (modulo how many)


# One tier, or two (a 10 s and a minute window, e.g. "2/10 seconds;3/minute").
RATES: list[Tiers] = [((limit, period),) for limit in (1, 2, 3) for period in PERIODS_MS] + [
    ((short, 10_000), (long, 60_000)) for short in (1, 2) for long in (2, 3)]
rates = st.sampled_from(RATES)
slots = st.integers(1, 2)


@st.composite
def limit_specs(draw: st.DrawFn, rule: bool) -> LimitSpec:
    rate = draw(st.none() | rates)
    slot = draw(slots) if rate is None else draw(st.none() | slots)
    return LimitSpec(
        rate=rate, slots=slot,
        key=draw(st.sampled_from([None, None, "client", "team"])),
        # A cost above the limit is refused at configuration (it could never be admitted).
        cost=draw(st.integers(1, min(limit for limit, _ in rate))) if rate is not None else 1,
        count_when=draw(st.sampled_from([None, None, "ok", "fail"])),
        methods=draw(st.sampled_from([None, None, ("POST",), ("GET",)])),
        path=draw(st.sampled_from(RULE_PATHS)) if rule else "",
    )


@st.composite
def app_specs(draw: st.DrawFn) -> AppSpec:
    decorators: dict[str, LimitSpec | str] = {}
    for path in ("/d0", "/d1"):
        choice = draw(st.sampled_from(["none", "limit", "limit", "exempt"]))
        if choice == "exempt":
            decorators[path] = "exempt"
        elif choice == "limit":
            decorators[path] = draw(limit_specs(rule=False))
    return AppSpec(
        default=draw(st.sampled_from([None, *RATES])),
        default_slots=draw(st.sampled_from([None, None, 1, 2])),
        rules=tuple(draw(st.lists(limit_specs(rule=True), max_size=2))),
        decorators=decorators,
        count_when=draw(st.sampled_from(list(COUNT_WHEN))),
        shadow=draw(st.sampled_from([False, False, False, True])),
        charge_405=draw(st.booleans()),
        charge_preflight=draw(st.booleans()),
        headers=draw(st.sampled_from([True, True, True, False])),
        legacy_headers=draw(st.booleans()),
    )


requests = st.builds(
    Step, kind=st.just("request"), method=st.sampled_from(METHODS),
    # Mostly one client and one team, so that limits run out.
    path=st.sampled_from(PATHS), client=st.sampled_from(["a", "a", "a", *CLIENTS]),
    team=st.sampled_from(["x", "x", None, *TEAMS]),
    status=st.sampled_from([200, 200, 201, 404, 405, 500]),
    hold=st.sampled_from([False, False, False, True]),
    preflight=st.sampled_from([False, False, False, True]))
advances = st.builds(Step, kind=st.just("advance"),
                     ms=st.sampled_from([1, 999, 1_000, 5_000, 9_999, 10_000, 60_000]))
closes = st.builds(Step, kind=st.just("close"), which=st.integers(0, 3))
steps = st.lists(st.one_of(requests, requests, requests, requests, advances, closes),
                 min_size=8, max_size=30)


# -- the policies, as the library is given them and as the model sees them --------------------


@dataclass(frozen=True)
class MPolicy:
    name: str
    label: str  # what RateLimit fields prefix its tiers with when two tiers' names clash
    tiers: Tiers  # slots: one tier, (slots, lease)
    slots: bool

    def tier_name(self, period_ms: int) -> str:
        if self.slots:
            return "in flight"
        return "minute" if period_ms == 60_000 else f"{period_ms // 1000}s"

    def policy(self) -> rl.Policy:
        if self.slots:
            return rl.Policy.in_flight(self.tiers[0][0], lease=LEASE_S, name=self.name)
        return rl.Policy([rl.Rate(limit, period) for limit, period in self.tiers],
                         algorithm="fixed-window", name=self.name)


@dataclass(frozen=True)
class Limits:
    """One place's limits (the default, a rule, a decorator): what a request it covers
    checks, with which key, cost and count_when."""

    rate: MPolicy | None
    slots: MPolicy | None
    key: str | None
    cost: int
    count_when: str | None
    methods: tuple[str, ...] | None
    path: str = ""
    label: str = "default"

    def covers(self, method: str) -> bool:
        # HEAD counts as GET.
        return self.methods is None or method in self.methods or (
            method == "HEAD" and "GET" in self.methods)


def _policies(name: str, label: str, spec: LimitSpec) -> Limits:
    rate = None if spec.rate is None else MPolicy(name, label, spec.rate, slots=False)
    slot = None if spec.slots is None else MPolicy(
        f"{name} slots", label, ((spec.slots, LEASE_S * 1000),), slots=True)
    return Limits(rate, slot, spec.key, spec.cost, spec.count_when, spec.methods, spec.path,
                  label)


@dataclass(frozen=True)
class Plan:
    """The limits of an app, built once from its spec, for the library and the model."""

    spec: AppSpec
    default: Limits
    rules: tuple[Limits, ...]
    decorators: dict[str, Limits | str]

    @classmethod
    def of(cls, spec: AppSpec) -> Plan:
        default = Limits(
            None if spec.default is None else MPolicy("dflt", "default", spec.default,
                                                      slots=False),
            None if spec.default_slots is None else MPolicy(
                "dflt slots", "default", ((spec.default_slots, LEASE_S * 1000),), slots=True),
            None, 1, None, None)
        rules = tuple(_policies(f"r{i}", f"r{i}", rule) for i, rule in enumerate(spec.rules))
        decorators = {path: (limit if isinstance(limit, str)
                             else _policies(path[1:], path[1:], limit))
                      for path, limit in spec.decorators.items()}
        return cls(spec, default, rules, decorators)

    def policies(self) -> list[MPolicy]:
        places = [self.default, *self.rules,
                  *(d for d in self.decorators.values() if not isinstance(d, str))]
        return [p for place in places for p in (place.rate, place.slots) if p is not None]

    def config(self) -> Config:
        default = self.default
        rules = [Rule(rule.path, None if rule.rate is None else rule.rate.policy(),
                      methods=rule.methods, key=None if rule.key is None else KEYS[rule.key],
                      cost=rule.cost, name=rule.label, count_when=COUNT_WHEN[rule.count_when],
                      concurrency=None if rule.slots is None else rule.slots.policy())
                 for rule in self.rules]
        return Config(
            default=None if default.rate is None else default.rate.policy(),
            concurrency=None if default.slots is None else default.slots.policy(),
            rules=rules, key=KEYS["client"], count_when=COUNT_WHEN[self.spec.count_when],
            mode="shadow" if self.spec.shadow else "enforce",
            charge_method_not_allowed=self.spec.charge_405,
            charge_preflight=self.spec.charge_preflight, headers=self.spec.headers,
            legacy_headers=self.spec.legacy_headers)

    def decorate(self, limiter: Any, path: str, endpoint: Any) -> Any:
        limits = self.decorators.get(path)
        if limits is None:
            return endpoint
        if isinstance(limits, str):
            return limiter.exempt(endpoint)
        return limiter.limit(
            None if limits.rate is None else limits.rate.policy(),
            key=None if limits.key is None else KEYS[limits.key], cost=limits.cost,
            name=path[1:], methods=limits.methods, count_when=COUNT_WHEN[limits.count_when],
            concurrency=None if limits.slots is None else limits.slots.policy())(endpoint)


# -- the model -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    policy: MPolicy
    identity: str
    cost: int
    count_when: str | None


@dataclass(frozen=True)
class Answer:
    """What a response must say: its status and one of the rate-limit fields' renderings
    the docs allow (more than one only where tiers tie)."""

    status: int
    policy_items: frozenset[str] | None  # RateLimit-Policy's items; None: no fields at all
    fields: frozenset[Fields]


@dataclass(frozen=True)
class Fields:
    """One governing tier's rendering: RateLimit, Retry-After (a 429's), the 429's body,
    and X-RateLimit-Limit, -Remaining, -Reset (with legacy_headers)."""

    ratelimit: str
    retry_after: str | None = None
    body: bytes | None = None
    legacy: tuple[str, str, str] | None = None


@dataclass
class Admission:
    """A request the model admitted: what it recorded, and when, to give back when it
    ends."""

    status: int
    hits: list[Check]
    slots: list[Check]
    at_ms: int = 0


def _status(adapter: str, method: str, path: str, wanted: int) -> tuple[int, bool]:
    """The response's status, and whether the route's endpoint (and so its decorator)
    takes the request: the router answers 404 and 405 itself."""
    methods = ROUTES.get(path)
    if methods is None:
        return 404, False
    if method not in methods and not (method == "HEAD" and "GET" in methods):
        return 405, False
    return wanted, adapter == "asgi"


def _sf(text: str) -> str:
    return '"' + text + '"'


@dataclass
class Model:
    plan: Plan
    adapter: str
    now_ms: int = START_MS
    # (policy, identity, period) -> (window, count); (policy, identity) -> slots held
    counts: dict[tuple[str, str, int], tuple[int, int]] = field(default_factory=dict)
    held: dict[tuple[str, str], int] = field(default_factory=dict)

    def identity(self, key: str | None, step: Step) -> str | None:
        """What the limit's key says: None for a team key without the header."""
        if key == "team":
            return None if step.team is None else f"h:x-team:{step.team}"
        return f"h:x-client:{step.client}"

    def checks(self, step: Step) -> tuple[int, list[Check], list[MPolicy]]:
        """The response's status, the checks of the request, and the policies its
        RateLimit-Policy lists: those of every limit selected by path, method and route
        that applies (a rule or default whose key said None does not)."""
        status, routed = _status(self.adapter, step.method, step.path, step.status)
        plan = self.plan
        if step.preflight and step.method == "OPTIONS" and not plan.spec.charge_preflight:
            return status, [], []  # a CORS preflight is not charged
        rate, slots = plan.default.rate, plan.default.slots
        limits: list[tuple[MPolicy | None, Limits]] = []
        decorator = plan.decorators.get(step.path) if routed else None
        if decorator == "exempt":
            rate = slots = None
        elif (isinstance(decorator, Limits) and decorator.covers(step.method)
              # A limit whose key says None does not apply: the route falls back to the
              # default.
              and self.identity(decorator.key, step) is not None):
            # A decorator replaces what it sets and keeps what it does not.
            if decorator.rate is not None:
                rate = None
                limits.append((decorator.rate, decorator))
            if decorator.slots is not None:
                slots = None
                limits.append((decorator.slots, decorator))
        limits += [(rate, plan.default), (slots, plan.default)]
        for rule in plan.rules:
            if rule.covers(step.method) and _matches(rule.path, step.path):
                limits += [(rule.rate, rule), (rule.slots, rule)]
        checks = []
        for policy, place in limits:
            identity = self.identity(place.key, step)  # None: this limit does not apply
            if policy is not None and identity is not None:
                checks.append(Check(policy, identity, 1 if policy.slots else place.cost,
                                    place.count_when))
        return status, checks, [policy for policy, place in limits if policy is not None
                                and self.identity(place.key, step) is not None]

    def _count(self, check: Check, period_ms: int) -> int:
        """What the check's tier of `period_ms` holds in its current window."""
        window, count = self.counts.get((check.policy.name, check.identity, period_ms), (0, 0))
        return count if window == self.now_ms // period_ms else 0

    def request(self, step: Step) -> tuple[Answer, Admission | None]:
        status, checks, listed = self.checks(step)
        if not checks:
            return Answer(status, None, frozenset()), Admission(status, [], [])
        spec = self.plan.spec
        # Each refusing tier: (wait in ms, check, limit, period, remaining).
        refusals: list[tuple[float, Check, int, int, int]] = []
        for check in checks:
            policy = check.policy
            for limit, period in policy.tiers:
                if policy.slots:
                    if self.held.get((policy.name, check.identity), 0) + 1 > limit:
                        # The first lease end, at most 1 s.
                        refusals.append((1000, check, limit, period, 0))
                    continue
                count = self._count(check, period)
                if count + check.cost > limit:
                    end = (self.now_ms // period + 1) * period
                    wait = math.inf if check.cost > limit else end - self.now_ms
                    refusals.append((wait, check, limit, period, max(0, limit - count)))
        items = self._policy_items(listed)
        names = self._names(listed)
        if refusals:
            # The refusing tier with the longest wait governs.
            longest = max(wait for wait, *_ in refusals)
            fields: set[Fields] = set()
            for wait, check, limit, period, remaining in refusals:
                if wait != longest:
                    continue
                retry = period // 1000 if wait == math.inf else max(1, math.ceil(wait / 1000))
                ratelimit = f"{names[check.policy, period]};r={remaining};t={retry}"
                legacy = ((str(limit), str(remaining), str(retry))
                          if spec.legacy_headers else None)
                if spec.shadow:  # served: no Retry-After, which would say to back off
                    fields.add(Fields(ratelimit, legacy=legacy))
                else:
                    fields.add(Fields(ratelimit, str(retry), _body(check, limit, wait, retry),
                                      legacy))
            if not spec.shadow:
                return Answer(429, items, frozenset(fields)), None
            # Shadow mode serves what it would refuse, recording nothing; a served response
            # carries the fields only with headers=True.
            return (Answer(status, items if spec.headers else None,
                           frozenset(fields) if spec.headers else frozenset()),
                    Admission(status, [], []))
        admission = Admission(status, [], [], self.now_ms)
        # Each tier after the hit: (policy, limit, period, remaining, seconds until whole).
        after: list[tuple[MPolicy, int, int, int, int]] = []
        for check in checks:
            policy = check.policy
            if policy.slots:
                key = (policy.name, check.identity)
                self.held[key] = self.held.get(key, 0) + 1
                admission.slots.append(check)
                limit, period = policy.tiers[0]
                after.append((policy, limit, period, limit - self.held[key], LEASE_S))
                continue
            admission.hits.append(check)
            for limit, period in policy.tiers:
                count = self._count(check, period) + check.cost
                window = self.now_ms // period
                self.counts[policy.name, check.identity, period] = (window, count)
                whole = math.ceil(((window + 1) * period - self.now_ms) / 1000)
                after.append((policy, limit, period, limit - count, whole))
        if not spec.headers:
            return Answer(status, None, frozenset()), admission
        # The rates govern an admitted response, the tier with the least remaining; with no
        # rate, the slots, likewise (a tie: any of them, the docs leave it open).
        governing = [tier for tier in after if not tier[0].slots] or after
        least = min(tier[3] for tier in governing)
        fields = {Fields(f"{names[policy, period]};r={remaining};t={t}", legacy=(
                      (str(limit), str(remaining), str(t)) if spec.legacy_headers else None))
                  for policy, limit, period, remaining, t in governing if remaining == least}
        return Answer(status, items, frozenset(fields)), admission

    def _names(self, policies: list[MPolicy]) -> dict[tuple[MPolicy, int], str]:
        """Each tier's name: its period ("10s", "minute", "in flight"), prefixed by its
        limit's label when two listed tiers have one name."""
        tiers = [policy.tier_name(period) for policy in policies for _, period in policy.tiers]
        clash = len(set(tiers)) != len(tiers)
        return {(policy, period): _sf(f"{policy.label} {policy.tier_name(period)}" if clash
                                      else policy.tier_name(period))
                for policy in policies for _, period in policy.tiers}

    def _policy_items(self, policies: list[MPolicy]) -> frozenset[str]:
        names = self._names(policies)
        items = set()
        for policy in policies:
            for limit, period in policy.tiers:
                if policy.slots:
                    items.add(f'{names[policy, period]};q={limit};qu="concurrent-requests"')
                else:
                    items.add(f"{names[policy, period]};q={limit};w={period // 1000}")
        return frozenset(items)

    def end(self, admission: Admission) -> None:
        """The response has ended: its slots come back, and the hits its status gives back.

        A hit is given back only within the window it was charged in (docs/settle.md): a
        response that ends in a later window gives nothing back from that one (the hit
        was spent with its window), and never below zero."""
        status = admission.status
        for check in admission.slots:
            self.held[check.policy.name, check.identity] -= 1
        for check in admission.hits:
            count_when = COUNT_WHEN[check.count_when or self.plan.spec.count_when]
            kept = (count_when is None or count_when(status)) and (
                status != 405 or self.plan.spec.charge_405)
            if kept:
                continue
            for _, period in check.policy.tiers:
                if self.now_ms // period != admission.at_ms // period:
                    continue  # charged in a window that has ended
                self.counts[check.policy.name, check.identity, period] = (
                    self.now_ms // period, max(0, self._count(check, period) - check.cost))

    def peek(self, policy: MPolicy, identity: str) -> int:
        """What `peek` says remains: the tier with the least left (none below zero)."""
        if policy.slots:
            return policy.tiers[0][0] - self.held.get((policy.name, identity), 0)
        check = Check(policy, identity, 1, None)
        return max(0, min(limit - self._count(check, period) for limit, period in policy.tiers))


def _matches(pattern: str, path: str) -> bool:
    """A rule's path: exact, ``*`` for anything, ``{name}`` for one segment."""
    if pattern.endswith("*"):
        return path.startswith(pattern[:-1])
    if pattern == "/{segment}":
        return path.count("/") == 1 and len(path) > 1
    return pattern == path


def _body(check: Check, limit: int, wait: float, retry: int) -> bytes:
    if wait == math.inf:
        detail = "Too Many Requests: this request costs more than the limit allows"
    elif check.policy.slots:
        detail = (f"Too Many Requests: {limit} requests in flight at most; "
                  "retry when one has ended")
    else:
        detail = "Too Many Requests"
    return json.dumps({"detail": detail, "retry_after": retry},
                      separators=(",", ":")).encode()


# -- the apps --------------------------------------------------------------------------------


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes


class Clock:
    """Whole microseconds, moved only by the test: a window's end is never a float's
    rounding away."""

    def __init__(self) -> None:
        self.us = START_MS * 1000

    def __call__(self) -> float:
        return self.us / 1_000_000

    def advance_ms(self, ms: int) -> None:
        self.us += ms * 1000


def _headers(step: Step, gate: str | None) -> dict[str, str]:
    headers = {"x-client": step.client, "x-status": str(step.status)}
    if step.team is not None:
        headers["x-team"] = step.team
    if step.preflight:
        headers["origin"] = "https://example.org"
        headers["access-control-request-method"] = "POST"
    if gate is not None:
        headers["x-hold"] = gate
    return headers


class AsgiApp:
    """A Starlette app behind the ASGI middleware, driven at the ASGI level on one event loop,
    so that responses can be held open (their slots held)."""

    def __init__(self, plan: Plan, store: str, prefix: str, clock: Clock) -> None:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import Response
        from starlette.routing import Route

        from ratelimit_mw.asgi import RateLimitMiddleware

        self.loop = asyncio.new_event_loop()
        backend: Any = (rl.MemoryBackend() if store == "memory" else
                        rl.AsyncRedisBackend(redis.asyncio.Redis.from_url(REDIS_URL)))
        self.limiter = rl.AsyncLimiter(backend, prefix=prefix, clock=clock)
        self.gates: dict[str, asyncio.Event] = {}
        self.entered: dict[str, asyncio.Future[None]] = {}

        def endpoint_for(path: str) -> Any:
            async def endpoint(request: Request) -> Response:
                gate = request.headers.get("x-hold")
                if gate is not None:
                    self.entered[gate].set_result(None)
                    await self.gates[gate].wait()
                return Response(b"ok", status_code=int(request.headers["x-status"]))

            endpoint.__name__ = endpoint.__qualname__ = "view" + path.replace("/", "_")
            return plan.decorate(self.limiter, path, endpoint)

        routes = [Route(path, endpoint_for(path), methods=list(methods))
                  for path, methods in ROUTES.items()]
        self.app = RateLimitMiddleware(Starlette(routes=routes), self.limiter,
                                       config=plan.config())

    async def _exchange(self, step: Step, gate: str | None) -> Reply:
        messages: list[dict[str, Any]] = []
        scope = {"type": "http", "method": step.method, "path": step.path,
                 "raw_path": step.path.encode(), "root_path": "", "query_string": b"",
                 "headers": [(k.encode(), v.encode()) for k, v in _headers(step, gate).items()],
                 "scheme": "http", "server": ("t", 80), "client": ("10.0.0.1", 1234),
                 "http_version": "1.1", "asgi": {"version": "3.0"}}
        received = False

        async def receive() -> dict[str, Any]:
            nonlocal received
            if not received:
                received = True
                return {"type": "http.request", "body": b"", "more_body": False}
            await asyncio.Event().wait()  # the client stays
            raise AssertionError("unreachable")

        async def send(message: MutableMapping[str, Any]) -> None:
            messages.append(dict(message))

        await self.app(scope, receive, send)
        return Reply(int(messages[0]["status"]),
                     {k.decode(): v.decode() for k, v in messages[0]["headers"]},
                     b"".join(m.get("body", b"") for m in messages[1:]))

    def request(self, step: Step) -> Reply | Held:
        if not step.hold:
            return self.loop.run_until_complete(self._exchange(step, None))
        gate = uuid.uuid4().hex
        self.gates[gate], self.entered[gate] = asyncio.Event(), self.loop.create_future()
        task = self.loop.create_task(self._exchange(step, gate))
        either: list[asyncio.Future[Any]] = [task, self.entered[gate]]
        self.loop.run_until_complete(asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED))
        if task.done():  # refused, or answered by the router
            return task.result()
        return Held(lambda: self._close(gate, task))

    def _close(self, gate: str, task: asyncio.Task[Reply]) -> Reply:
        self.gates[gate].set()
        return self.loop.run_until_complete(task)

    def peek(self, policy: rl.Policy, identity: str) -> rl.Decision:
        return self.loop.run_until_complete(self.limiter.peek(policy, identity))

    def close(self) -> None:
        backend = self.limiter.backend
        if isinstance(backend, rl.AsyncRedisBackend):
            self.loop.run_until_complete(backend.aclose())
        self.loop.close()


class WsgiApp:
    """A plain WSGI app (no router: decorated paths are plain routes) behind the WSGI
    middleware, through werkzeug's test client; a held response is one whose body the
    client has not closed yet."""

    def __init__(self, plan: Plan, store: str, prefix: str, clock: Clock) -> None:
        from werkzeug.test import Client

        from ratelimit_mw.wsgi import RateLimitMiddleware

        backend: Any = (rl.MemoryBackend() if store == "memory" else
                        rl.RedisBackend(redis.Redis.from_url(REDIS_URL)))
        self.limiter = rl.Limiter(backend, prefix=prefix, clock=clock)

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
            path = environ.get("PATH_INFO") or "/"
            wanted = int(environ["HTTP_X_STATUS"])
            status, _ = _status("wsgi", environ["REQUEST_METHOD"], path, wanted)
            start_response(f"{status} X", [("Content-Type", "text/plain")])
            return [b"ok"]

        self.client = Client(RateLimitMiddleware(app, self.limiter, config=plan.config()))

    def request(self, step: Step) -> Reply | Held:
        response = self.client.open(step.path, method=step.method, headers=_headers(step, None),
                                    buffered=False)
        reply = Reply(response.status_code,
                      {k.lower(): v for k, v in response.headers.items()}, response.get_data())
        if not step.hold:
            response.close()  # what a WSGI server does once the body is sent
            return reply

        def close() -> Reply:
            response.close()
            return reply

        return Held(close)

    def peek(self, policy: rl.Policy, identity: str) -> rl.Decision:
        return self.limiter.peek(policy, identity)

    def close(self) -> None:
        backend = self.limiter.backend
        if isinstance(backend, rl.RedisBackend):
            backend.close()


@dataclass
class Held:
    """A response still running (its slots held); `end()` lets it finish: its reply."""

    end: Callable[[], Reply]


# -- the comparison ----------------------------------------------------------------------------


def _assert_answer(reply: Reply, answer: Answer, what: str) -> None:
    assert reply.status == answer.status, what
    headers = reply.headers
    if answer.policy_items is None:
        assert not {"ratelimit", "ratelimit-policy", "retry-after", *LEGACY} & set(headers), what
        return
    assert frozenset(headers["ratelimit-policy"].split(", ")) == answer.policy_items, what
    body = reply.body if reply.status == 429 else None
    if body is not None:
        assert headers["cache-control"] == "no-store", what
        assert headers["content-type"] == "application/json", what
    legacy = tuple(headers[name] for name in LEGACY) if LEGACY[0] in headers else None
    got = Fields(headers["ratelimit"], headers.get("retry-after"), body, legacy)  # type: ignore[arg-type]
    assert got in answer.fields, f"{what}: {got} not among {sorted(answer.fields, key=str)}"


LEGACY = ("x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset")


def _identities() -> list[str]:
    return [f"h:x-client:{c}" for c in CLIENTS] + [f"h:x-team:{t}" for t in TEAMS]


def _assert_stored(app: AsgiApp | WsgiApp, model: Model, plan: Plan, what: str) -> None:
    for policy in plan.policies():
        for identity in _identities():
            decision = app.peek(policy.policy(), identity)
            expected = model.peek(policy, identity)
            assert (decision.remaining, decision.allowed) == (expected, expected > 0), (
                f"{what}: peek {policy.name} {identity}")


def run(adapter: str, store: str, spec: AppSpec, script: list[Step]) -> None:
    plan = Plan.of(spec)
    clock = Clock()
    prefix = "thd" + uuid.uuid4().hex[:12]
    app: AsgiApp | WsgiApp = (AsgiApp if adapter == "asgi" else WsgiApp)(plan, store, prefix,
                                                                         clock)
    model = Model(plan, adapter)
    held: list[tuple[Held, Answer, Admission | None, str]] = []
    try:
        for number, step in enumerate(script):
            what = f"step {number}: {step}"
            if step.kind == "advance":
                ms = _advance(model.now_ms, step.ms, store)
                clock.advance_ms(ms)
                model.now_ms += ms
            elif step.kind == "close":
                if held:
                    _end(held.pop(step.which % len(held)), model)
            else:
                answer, admission = model.request(step)
                _report(answer, admission, step)
                reply = app.request(step)
                if isinstance(reply, Held):
                    held.append((reply, answer, admission, what))
                    continue
                _assert_answer(reply, answer, what)
                if admission is not None:
                    model.end(admission)
        _assert_stored(app, model, plan, "with the held responses")
        while held:
            _end(held.pop(), model)
        _assert_stored(app, model, plan, "at the end")
    finally:
        for each, _, _, _ in held:
            each.end()
        _forget(app, store, prefix)


def _advance(now_ms: int, ms: int, store: str) -> int:
    """How far the clock moves for a drawn advance of `ms`. Redis expires keys by its own
    clock, which stands still while the test's moves: a window written 1 ms before its end
    (by the test's clock) would vanish before the next request, which never happens where
    both clocks are Redis's. So on Redis the clock never stops in the last 5 s of a 10 s
    window (nor, as 60 s is a multiple, of a minute); it goes on to the next window's first
    half."""
    if store == "redis" and (now_ms + ms) % 10_000 > 5_000:
        return ms + 5_000
    return ms


def _report(answer: Answer, admission: Admission | None, step: Step) -> None:
    """What the example exercised (shown by --hypothesis-show-statistics)."""
    if answer.status == 429:
        event("refused" + (" for a slot" if any("in flight" in f.ratelimit
                                                for f in answer.fields) else ""))
    elif admission is not None and answer.policy_items is not None and any(
            f.retry_after is None and ";r=0;" in f.ratelimit for f in answer.fields):
        event("admitted with r=0 (or served in shadow)")
    if len(answer.fields) > 1:
        event("tied tiers")
    if step.hold and admission is not None and admission.slots:
        event("held a slot")
    if answer.policy_items is None:
        event("no limit applied")


def _end(held: tuple[Held, Answer, Admission | None, str], model: Model) -> None:
    response, answer, admission, what = held
    _assert_answer(response.end(), answer, what + " (held)")
    if admission is not None:
        model.end(admission)


@pytest.mark.parametrize("store", ["memory", "redis"])
@pytest.mark.parametrize("adapter", ["asgi", "wsgi"])
@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(spec=app_specs(), script=steps)
def test_every_answer_and_counter_is_the_general_semantics(
        adapter: str, store: str, spec: AppSpec, script: list[Step]) -> None:
    run(adapter, store, spec, script)


# -- where the library and its docs disagree ---------------------------------------------------


def _app(adapter: str, store: str, spec: AppSpec) -> tuple[AsgiApp | WsgiApp, Plan, Clock, str]:
    plan, clock = Plan.of(spec), Clock()
    prefix = "thd" + uuid.uuid4().hex[:12]
    app = (AsgiApp if adapter == "asgi" else WsgiApp)(plan, store, prefix, clock)
    return app, plan, clock, prefix


def _forget(app: AsgiApp | WsgiApp, store: str, prefix: str) -> None:
    app.close()
    if store == "redis":
        client = redis.Redis.from_url(REDIS_URL)
        try:
            for key in client.scan_iter(f"{prefix}:*"):
                client.delete(key)
        finally:
            client.close()


def _spec(**changes: Any) -> AppSpec:
    base: dict[str, Any] = {"default": None, "default_slots": None, "rules": (),
                            "decorators": {}, "count_when": None, "shadow": False,
                            "charge_405": False, "charge_preflight": False}
    return AppSpec(**{**base, **changes})


def _rule(path: str, **changes: Any) -> LimitSpec:
    base: dict[str, Any] = {"rate": None, "slots": None, "key": None, "cost": 1,
                            "count_when": None, "methods": None, "path": path}
    return LimitSpec(**{**base, **changes})


ADAPTERS_STORES = [(adapter, store) for adapter in ("asgi", "wsgi")
                   for store in ("memory", "redis")]


@pytest.mark.parametrize(("adapter", "store"), ADAPTERS_STORES)
def test_of_several_in_flight_limits_the_one_with_the_least_left_governs(
        adapter: str, store: str) -> None:
    app, _, _, prefix = _app(adapter, store, _spec(
        default_slots=2, rules=(_rule("/a", slots=1),)))
    try:
        reply = app.request(Step("request", path="/a"))
        assert isinstance(reply, Reply)
        # Default: 2 slots, 1 taken (r=1); the rule's: 1 slot, 1 taken (r=0).
        assert reply.headers["ratelimit"] == '"r0 in flight";r=0;t=3600'
    finally:
        _forget(app, store, prefix)


@pytest.mark.parametrize("slots", [2, None], ids=["holding-a-slot", "rate-only"])
@pytest.mark.parametrize(("adapter", "store"), ADAPTERS_STORES)
def test_a_response_ending_in_a_later_window_gives_back_only_its_own_hit(
        adapter: str, store: str, slots: int | None) -> None:
    # It gave its hit back from the window it ended in, taking another request's hit.
    app, plan, clock, prefix = _app(adapter, store, _spec(default=((2, 10_000),),
                                                          default_slots=slots))
    try:
        held = app.request(Step("request", path="/a", status=405, hold=True))
        assert isinstance(held, Held)
        clock.advance_ms(10_000)  # the next window
        assert app.request(Step("request", path="/a")).status == 200  # type: ignore[union-attr]
        assert held.end().status == 405  # a 405 gives its hit back: the previous window's
        assert plan.default.rate is not None
        # The next window holds the second request's hit: 1 of 2 left.
        assert app.peek(plan.default.rate.policy(), "h:x-client:a").remaining == 1
    finally:
        _forget(app, store, prefix)


@pytest.mark.parametrize(("adapter", "store"), ADAPTERS_STORES)
def test_a_rule_whose_key_says_none_is_not_listed(adapter: str, store: str) -> None:
    app, _, _, prefix = _app(adapter, store, _spec(
        default=((3, 60_000),), rules=(_rule("/a", rate=((1, 10_000),), key="team"),)))
    try:
        reply = app.request(Step("request", path="/a", team=None))
        assert isinstance(reply, Reply)
        assert reply.headers["ratelimit-policy"] == '"minute";q=3;w=60'
    finally:
        _forget(app, store, prefix)
