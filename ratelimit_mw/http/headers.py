"""Rendering a Decision into HTTP: Retry-After, the IETF RateLimit fields, bodies.

Syntax of draft-ietf-httpapi-ratelimit-headers-10 (Structured Field lists):

    RateLimit-Policy: "minute";q=10;w=60, "hour";q=100;w=3600
    RateLimit: "minute";r=3;t=42

``RateLimit-Policy`` lists every tier that applied to the request; it depends only on which
policies applied, so it is rendered once per set of policies (`PolicyHeader`) and reused.
``RateLimit`` names the governing tier: r is what remains, t is ceil(reset_after) when the
request was admitted and the Retry-After value when it was refused.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence

from ratelimit_mw.core.decision import Decision
from ratelimit_mw.core.policy import Policy

Headers = list[tuple[str, str]]
#: Headers as ASGI sends them: lower-case names (HTTP/2 requires it), latin-1 bytes.
RawHeaders = list[tuple[bytes, bytes]]


def retry_after_seconds(decision: Decision) -> int:
    """Whole seconds, rounded up, at least 1 — never a Retry-After of 0 for a refusal.

    A request whose cost exceeds a limit can never be admitted; its retry_after is infinite,
    which no header can say, so it reports the governing period instead.
    """
    retry = decision.retry_after
    if retry == math.inf:
        retry = decision.rate.period if decision.rate is not None else 60.0
    return max(1, math.ceil(retry))


def _sf_string(text: str) -> str:
    # A Structured Field string: printable ASCII only, with \ and " escaped.
    clean = "".join(ch if " " <= ch <= "~" else "?" for ch in text)
    return '"' + clean.replace("\\", "\\\\").replace('"', '\\"') + '"'


class PolicyHeader:
    """The rendered ``RateLimit-Policy`` of one set of policies, and each tier's name.

    Tier names are the rate's period ("minute", "30s"). When two applied policies have a tier
    of the same period, each is prefixed by its policy's label, a short text a person reads
    ("default", "POST /login", "report"): ``"POST /login minute"``. A policy given without a
    label is labelled by its name.
    """

    __slots__ = ("item", "names", "raw_item", "value")

    def __init__(self, policies: Sequence[Policy | tuple[Policy, str]]) -> None:
        labelled: dict[Policy, str] = {}
        for item in policies:  # one policy applied twice is listed once
            policy, label = item if isinstance(item, tuple) else (item, item.name)
            labelled.setdefault(policy, label)
        periods = [rate.period_ms for policy in labelled for rate in policy.rates]
        clash = len(set(periods)) != len(periods)
        self.names: dict[tuple[int, int], str] = {}
        items = []
        for policy, label in labelled.items():
            for rate in policy.rates:
                name = f"{label} {rate.name}" if clash else rate.name
                quoted = _sf_string(name)
                self.names[(id(policy), rate.period_ms)] = quoted
                items.append(f"{quoted};q={rate.limit};w={rate.period_seconds_ceil}")
        self.value = ", ".join(items)
        # The header as the adapters add it: built once, shared by every response.
        self.item = ("RateLimit-Policy", self.value)
        self.raw_item = (b"ratelimit-policy", self.value.encode("latin-1"))

    def ratelimit(self, decision: Decision) -> str:
        """The ``RateLimit`` value for the governing tier of `decision`."""
        policy, rate = decision.policy, decision.rate
        name = self.names.get((id(policy), rate.period_ms if rate else 0), '"limit"')
        allowed = decision.allowed
        t = math.ceil(decision.reset_after) if allowed else retry_after_seconds(decision)
        return f"{name};r={decision.remaining};t={t}"


def rate_limit_headers(decision: Decision, policy_header: PolicyHeader,
                       legacy: bool = False) -> Headers:
    """The headers for a response the limiter saw (admitted or refused)."""
    headers: Headers = [policy_header.item, ("RateLimit", policy_header.ratelimit(decision))]
    if not decision.allowed:
        headers.append(("Retry-After", str(retry_after_seconds(decision))))
    if legacy:
        reset = retry_after_seconds(decision) if not decision.allowed else math.ceil(
            decision.reset_after
        )
        headers += [
            ("X-RateLimit-Limit", str(decision.limit)),
            ("X-RateLimit-Remaining", str(decision.remaining)),
            ("X-RateLimit-Reset", str(reset)),
        ]
    return headers


def admitted_raw(decision: Decision, policy_header: PolicyHeader) -> RawHeaders:
    """`rate_limit_headers` of an admitted decision (no legacy fields) as `RawHeaders`,
    the policy field's bytes rendered once per set of policies."""
    return [policy_header.raw_item,
            (b"ratelimit", policy_header.ratelimit(decision).encode("latin-1"))]


# Names encoded once: the ones the guard writes up front, any other (an on_blocked
# response's) on first use.
_RAW_NAMES: dict[str, bytes] = {
    name: name.lower().encode("latin-1")
    for name in ("RateLimit-Policy", "RateLimit", "Retry-After", "Cache-Control",
                 "Content-Type", "X-RateLimit-Limit", "X-RateLimit-Remaining",
                 "X-RateLimit-Reset")
}
# Header pairs that repeat whole (a selection's RateLimit-Policy, fixed 429 fields), encoded
# once; bounded, dropped whole when full, like the path caches.
_RAW_PAIRS: dict[tuple[str, str], tuple[bytes, bytes]] = {}
_RAW_PAIRS_SIZE = 1024
_REPEATING = frozenset({"RateLimit-Policy", "Cache-Control", "Content-Type"})


def _raw_name(name: str) -> bytes:
    raw = _RAW_NAMES.get(name)
    if raw is None:
        raw = _RAW_NAMES.setdefault(name, name.lower().encode("latin-1"))
    return raw


def encode_raw(pairs: Headers) -> RawHeaders:
    """Any headers as `RawHeaders`."""
    raw: RawHeaders = []
    for pair in pairs:
        found = _RAW_PAIRS.get(pair)
        if found is None:
            name, value = pair
            found = (_raw_name(name), value.encode("latin-1"))
            if name in _REPEATING:
                if len(_RAW_PAIRS) >= _RAW_PAIRS_SIZE:
                    _RAW_PAIRS.clear()
                _RAW_PAIRS[pair] = found
        raw.append(found)
    return raw


def too_many_requests_body(decision: Decision) -> bytes:
    """The default 429 body: ``{"detail": ..., "retry_after": N}``."""
    if decision.retry_after == math.inf:
        kind = "never"
    elif decision.banned:
        kind = "banned"
    else:
        kind = ""
    return _body(kind, retry_after_seconds(decision))


_DETAILS = {
    "": "Too Many Requests",
    "never": "Too Many Requests: this request costs more than the limit allows",
    "banned": "Too Many Requests: temporarily banned after exceeding the limit",
}


@functools.lru_cache(maxsize=1024)
def _body(kind: str, retry_after: int) -> bytes:
    # A flood refused for the same number of seconds gets the same bytes: render them once.
    return json.dumps(
        {"detail": _DETAILS[kind], "retry_after": retry_after}, separators=(",", ":")
    ).encode()


def unavailable_body(retry_after: int) -> bytes:
    """The 503 body when the store is down and on_backend_error="deny"."""
    return json.dumps(
        {"detail": "Rate limiter unavailable", "retry_after": retry_after}, separators=(",", ":")
    ).encode()
