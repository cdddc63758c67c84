"""Rendering a Decision into HTTP: Retry-After, the IETF RateLimit fields, bodies.

Syntax of draft-ietf-httpapi-ratelimit-headers-10 (Structured Field lists):

    RateLimit-Policy: "minute";q=10;w=60, "hour";q=100;w=3600
    RateLimit: "minute";r=3;t=42

``RateLimit-Policy`` lists every tier that applied, rendered once per set of policies
(`PolicyHeader`). ``RateLimit`` names the governing tier: r is what remains, t is
ceil(reset_after) when the request was admitted, the Retry-After value when refused.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ratelimit_mw.core.decision import Decision
from ratelimit_mw.core.policy import CONCURRENCY, Policy

Headers = list[tuple[str, str]]
IN_FLIGHT = "in flight"  # an in-flight limit's item in the RateLimit fields
#: Headers as ASGI sends them: lower-case names (HTTP/2 requires it), latin-1 bytes.
RawHeaders = list[tuple[bytes, bytes]]
T = TypeVar("T")


def retry_after_seconds(decision: Decision) -> int:
    """Whole seconds, rounded up, at least 1 — never a Retry-After of 0 for a refusal. A
    request whose cost exceeds a limit is never admitted (retry_after infinite, which no
    header can say): it reports the governing period instead."""
    retry = decision.retry_after
    if retry == math.inf:
        retry = decision.rate.period if decision.rate is not None else 60.0
    return max(1, math.ceil(retry))


def _sf_string(text: str) -> str:
    # A Structured Field string: printable ASCII only, with \ and " escaped.
    clean = "".join(ch if " " <= ch <= "~" else "?" for ch in text)
    return '"' + clean.replace("\\", "\\\\").replace('"', '\\"') + '"'


class PolicyHeader:
    """The rendered ``RateLimit-Policy`` of one set of policies, and each tier's name: the
    rate's period ("minute", "30s"), prefixed by its policy's label (what a person reads,
    "POST /login minute"; a policy given without one by its name) when two applied policies
    have a tier of the same period."""

    __slots__ = ("item", "names", "raw_item", "raw_names", "value")

    def __init__(self, policies: Sequence[Policy | tuple[Policy, str]]) -> None:
        labelled: dict[Policy, str] = {}
        for item in policies:  # one policy applied twice is listed once
            policy, label = item if isinstance(item, tuple) else (item, item.name)
            labelled.setdefault(policy, label)
        tiers = [IN_FLIGHT if policy.algorithm == CONCURRENCY else rate.name
                 for policy in labelled for rate in policy.rates]
        clash = len(set(tiers)) != len(tiers)
        self.names: dict[tuple[int, int], str] = {}
        items = []
        for policy, label in labelled.items():
            for rate in policy.rates:
                if policy.algorithm == CONCURRENCY:
                    # Requests at once, not per window: the draft's quota unit says so.
                    quoted = _sf_string(f"{label} {IN_FLIGHT}" if clash else IN_FLIGHT)
                    items.append(f'{quoted};q={rate.limit};qu="concurrent-requests"')
                else:
                    quoted = _sf_string(f"{label} {rate.name}" if clash else rate.name)
                    items.append(f"{quoted};q={rate.limit};w={rate.period_seconds_ceil}")
                self.names[(id(policy), rate.period_ms)] = quoted
        self.value = ", ".join(items)
        # The header as the adapters add it: built once, shared by every response.
        self.item = ("RateLimit-Policy", self.value)
        self.raw_item = (b"ratelimit-policy", self.value.encode("latin-1"))
        self.raw_names = {tier: name.encode("latin-1") for tier, name in self.names.items()}

    def ratelimit(self, decision: Decision) -> str:
        """The ``RateLimit`` value for the governing tier of `decision`."""
        rate = decision.rate
        name = self.names.get((id(decision.policy), rate.period_ms if rate else 0), '"limit"')
        t = math.ceil(decision.reset_after) if decision.allowed else retry_after_seconds(decision)
        return f"{name};r={decision.remaining};t={t}"

    def admitter(self, build: Callable[[Decision, Headers | None, Any, RawHeaders | None], T],
                 raw: bool) -> Callable[[Decision, Any], T]:
        """How an admitted decision becomes what ``build(decision, headers, refund, raw)``
        makes, with `rate_limit_headers` (no legacy fields), as `RawHeaders` (`raw`) or as
        `Headers`: the policy field and each tier's name rendered once, one format for the
        numbers; one call per admitted response."""
        ceil = math.ceil
        if raw:
            names, item = self.raw_names, self.raw_item

            def admit_raw(decision: Decision, refund: Any) -> T:
                rate = decision.rate
                name = names.get((id(decision.policy), rate.period_ms if rate else 0),
                                 b'"limit"')
                return build(decision, None, refund, [item, (
                    b"ratelimit", b"%s;r=%d;t=%d" % (name, decision.remaining,
                                                     ceil(decision.reset_after)))])
            return admit_raw
        text_names, text_item = self.names, self.item

        def admit(decision: Decision, refund: Any) -> T:
            rate = decision.rate
            name = text_names.get((id(decision.policy), rate.period_ms if rate else 0),
                                  '"limit"')
            return build(decision, [text_item, (
                "RateLimit", f"{name};r={decision.remaining};t={ceil(decision.reset_after)}")],
                refund, None)
        return admit


def rate_limit_headers(decision: Decision, policy_header: PolicyHeader,
                       legacy: bool = False) -> Headers:
    """The headers for a response the limiter saw (admitted or refused)."""
    headers: Headers = [policy_header.item, ("RateLimit", policy_header.ratelimit(decision))]
    if not decision.allowed:
        headers.append(("Retry-After", str(retry_after_seconds(decision))))
    if legacy:
        reset = math.ceil(decision.reset_after) if decision.allowed else retry_after_seconds(
            decision)
        headers += [("X-RateLimit-Limit", str(decision.limit)),
                    ("X-RateLimit-Remaining", str(decision.remaining)),
                    ("X-RateLimit-Reset", str(reset))]
    return headers


# Header names, and the pairs that repeat whole (a selection's RateLimit-Policy, fixed 429
# fields), encoded once; the pairs bounded, dropped whole when full, like the path caches.
_RAW_NAMES: dict[str, bytes] = {}
_RAW_PAIRS: dict[tuple[str, str], tuple[bytes, bytes]] = {}
_RAW_PAIRS_SIZE = 1024
_REPEATING = frozenset({"RateLimit-Policy", "Cache-Control", "Content-Type"})


def encode_raw(pairs: Headers) -> RawHeaders:
    """Any headers as `RawHeaders`."""
    raw: RawHeaders = []
    for pair in pairs:
        found = _RAW_PAIRS.get(pair)
        if found is None:
            name, value = pair
            raw_name = _RAW_NAMES.get(name) or _RAW_NAMES.setdefault(
                name, name.lower().encode("latin-1"))
            found = (raw_name, value.encode("latin-1"))
            if name in _REPEATING:
                if len(_RAW_PAIRS) >= _RAW_PAIRS_SIZE:
                    _RAW_PAIRS.clear()
                _RAW_PAIRS[pair] = found
        raw.append(found)
    return raw


def refusal_shape(decision: Decision) -> tuple[Any, ...]:
    """Everything of a refused `decision` that its 429 renders (`rate_limit_headers`, legacy
    fields or not, and `too_many_requests_body`): two refusals of one selection with equal
    shapes answer the same bytes (tests/test_http_caches.py holds the two to it)."""
    retry = decision.retry_after
    return (id(decision.policy), decision.rate, decision.remaining, decision.banned,
            decision.limit, retry == math.inf, retry_after_seconds(decision))


def too_many_requests_body(decision: Decision) -> bytes:
    """The default 429 body: ``{"detail": ..., "retry_after": N}``."""
    if decision.retry_after == math.inf:
        detail = "Too Many Requests: this request costs more than the limit allows"
    elif decision.banned:
        detail = "Too Many Requests: temporarily banned after exceeding the limit"
    elif decision.policy is not None and decision.policy.algorithm == CONCURRENCY:
        detail = (f"Too Many Requests: {decision.limit} requests in flight at most; retry "
                  "when one has ended")
    else:
        detail = "Too Many Requests"
    return _body(detail, retry_after_seconds(decision))


def unavailable_body(retry_after: int) -> bytes:
    """The 503 body when the store is down and on_backend_error="deny"."""
    return _body("Rate limiter unavailable", retry_after)


@functools.lru_cache(maxsize=1024)
def _body(detail: str, retry_after: int) -> bytes:
    # A flood refused for the same number of seconds gets the same bytes: render them once.
    body = {"detail": detail, "retry_after": retry_after}
    return json.dumps(body, separators=(",", ":")).encode()


_SCHEMA_HEADERS = {
    "Retry-After": ("Seconds until a retry can be admitted (whole seconds, at least 1)",
                    "integer"),
    "RateLimit": ('The governing limit: "<name>";r=<remaining>;t=<seconds> (IETF draft)',
                  "string"),
    "RateLimit-Policy": ('Every limit that applies: "<name>";q=<quota>;w=<window seconds>',
                         "string"),
}
#: The 429 as an OpenAPI response object: what FastAPI's and Litestar's schemas document.
TOO_MANY_REQUESTS: dict[str, Any] = {
    "description": "Too Many Requests: a rate limit is exhausted; retry after Retry-After "
                   "seconds",
    "headers": {name: {"description": text, "schema": {"type": kind}}
                for name, (text, kind) in _SCHEMA_HEADERS.items()},
    "content": {"application/json": {"schema": {
        "type": "object",
        "properties": {"detail": {"type": "string"}, "retry_after": {"type": "integer"}},
    }}},
}
