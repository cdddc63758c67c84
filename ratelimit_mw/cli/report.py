"""What the commands print: the facts they gathered (a peek, Redis's clock, the keys found)
shaped into one dict per command (the ``--json`` output), and that dict rendered as text."""

from __future__ import annotations

import datetime as _dt
import math
from collections.abc import Iterable
from typing import Any, NamedTuple

from ratelimit_mw.core import wire
from ratelimit_mw.core.decision import Decision
from ratelimit_mw.core.identity import decode_segment, encode_identity
from ratelimit_mw.core.policy import Policy

_ALGORITHM_OF_CODE = {code: name for name, code in wire.CODES.items()}
HASHED_NOTE = ("identities starting with '#' are stored hashed (unsafe or long values); the "
               "original text cannot be recovered: inspect or reset them by the original value")


def iso(ms: int) -> str:
    utc = _dt.datetime.fromtimestamp(ms / 1000, _dt.timezone.utc)
    return utc.isoformat(timespec="milliseconds")


def _seconds(value: float) -> float | None:
    """Seconds for JSON (which has no infinity: None means never)."""
    return None if math.isinf(value) else round(value, 3)


def _at(now_ms: int, seconds: float) -> str | None:
    return None if math.isinf(seconds) else iso(now_ms + round(seconds * 1000))


def policy_summary(policy: Policy) -> dict[str, Any]:
    return {"name": policy.name, "algorithm": policy.algorithm,
            "rates": [str(rate) for rate in policy.rates]}


def inspect_report(policy: Policy, identity: str, decision: Decision, ban_end_ms: int | None,
                   now_ms: int) -> dict[str, Any]:
    """The state of every tier as a peek saw it, and the ban as its key holds it."""
    tiers = [{
        "rate": str(tier.rate), "limit": tier.rate.limit, "used": tier.rate.limit - tier.remaining,
        "remaining": tier.remaining, "allowed": tier.allowed, "banned": tier.banned,
        "retry_after": 0.0 if tier.allowed else _seconds(tier.retry_after),
        "retry_at": None if tier.allowed else _at(now_ms, tier.retry_after),
        "reset_after": _seconds(tier.reset_after), "reset_at": _at(now_ms, tier.reset_after),
    } for tier in decision.tiers]
    ban = None
    if ban_end_ms is not None and ban_end_ms > now_ms:
        ban = {"ends_at": iso(ban_end_ms), "left": round((ban_end_ms - now_ms) / 1000, 3)}
    return {"policy": policy_summary(policy), "identity": identity,
            "stored_as": encode_identity(identity), "now": iso(now_ms),
            "allowed": decision.allowed and ban is None, "tiers": tiers, "ban": ban}


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}min"
    return f"{seconds / 3600:.1f}h"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in [header, *rows]]


def render_inspect(report: dict[str, Any]) -> str:
    policy = report["policy"]
    lines = [
        f"policy    {policy['name']} ({policy['algorithm']}: {';'.join(policy['rates'])})",
        f"identity  {report['identity']}"
        + ("" if report["stored_as"] == report["identity"]
           else f" (stored hashed as {report['stored_as']})"),
        f"now       {report['now']} (Redis clock)",
        f"next hit  {'ADMITTED' if report['allowed'] else 'REFUSED'}",
    ]
    rows = []
    for tier in report["tiers"]:
        retry = "-" if tier["allowed"] else f"{_duration(tier['retry_after'])} ({tier['retry_at']})"
        # Under a ban the limiter answers "nothing remains", not the counts.
        used = "banned" if tier["banned"] else f"{tier['used']}/{tier['limit']}"
        rows.append([tier["rate"], used, str(tier["remaining"]),
                     retry, f"{_duration(tier['reset_after'])} ({tier['reset_at']})"])
    lines += _table(["tier", "used", "remaining", "retry in", "whole again in"], rows)
    ban = report["ban"]
    lines.append("ban       none" if ban is None
                 else f"ban       until {ban['ends_at']} ({_duration(ban['left'])} left)")
    if not report.get("stored", True):
        lines.append(f"note      nothing is stored for {report['identity']} under "
                     f"{policy['name']!r}: the quota above is a fresh one")
        others = report.get("stored_under_other_names") or []
        if others:
            lines.append(f"          this identity holds state under: {', '.join(others)}")
    return "\n".join(lines)


def reset_report(policy: Policy, identity: str, removed: list[str]) -> dict[str, Any]:
    return {"policy": policy_summary(policy), "identity": identity,
            "stored_as": encode_identity(identity), "removed": removed}


def render_reset(report: dict[str, Any]) -> str:
    who = f"{report['identity']} under {report['policy']['name']} ({report['policy']['algorithm']})"
    if not report["removed"]:
        return f"nothing to reset: {who} holds no counters and no ban"
    return "\n".join([f"reset {who}; removed {len(report['removed'])} key(s):",
                      *(f"  {key}" for key in report["removed"])])


class StoredKey(NamedTuple):
    """A limiter key read back: ``<prefix>:{<identity>}:<name>.<algo code>:<tier>``."""

    identity: str
    name: str
    algorithm: str
    tier: str  # a period in ms, "log" (sliding-log) or "ban"


def parse_key(prefix: str, key: str) -> StoredKey | None:
    """The parts of a limiter key, or None for a key this prefix's limiter never writes. The
    identity holds no braces (core.identity); the policy name may hold ``:`` and ``.``, so it
    is read from the right."""
    head = prefix + ":{"
    if not key.startswith(head):
        return None
    close = key.find("}:", len(head))
    if close < 0:
        return None
    identity = key[len(head):close]
    segment, sep, tier = key[close + 2:].rpartition(":")
    name, dot, code = segment.rpartition(".")
    if not identity or not sep or not dot or not name or code not in _ALGORITHM_OF_CODE:
        return None
    return StoredKey(identity, name, _ALGORITHM_OF_CODE[code], tier)


def scan_pattern(prefix: str, policy: Policy | None) -> str:
    """The SCAN MATCH pattern. Prefixes, encoded identities and policy segments hold no glob
    characters (``*?[]\\``), so they can be written into the pattern as they are."""
    return f"{prefix}:{{*" if policy is None else f"{prefix}:{{*}}:{wire.wire(policy).segment}:*"


def list_report(prefix: str, keys: Iterable[str], limit: int,
                policy: Policy | None) -> dict[str, Any]:
    """Identities holding state, grouped from the keys found, at most `limit` of them."""
    found: dict[str, dict[str, Any]] = {}
    truncated = False
    for key in keys:
        parts = parse_key(prefix, key)
        if parts is None:
            continue
        entry = found.get(parts.identity)
        if entry is None:
            if len(found) >= limit:
                truncated = True
                break
            entry = found[parts.identity] = {
                "identity": parts.identity, "hashed": parts.identity.startswith("#"),
                "policies": [], "keys": 0, "banned": False}
        label = f"{decode_segment(parts.name) or parts.name} ({parts.algorithm})"
        if label not in entry["policies"]:
            entry["policies"].append(label)
        entry["keys"] += 1
        entry["banned"] = entry["banned"] or parts.tier == "ban"
    identities = sorted(found.values(), key=lambda e: e["identity"])
    for entry in identities:
        entry["policies"].sort()
    return {"prefix": prefix, "policy": None if policy is None else policy_summary(policy),
            "identities": identities, "truncated": truncated,
            "note": HASHED_NOTE if any(e["hashed"] for e in identities) else None}


def render_list(report: dict[str, Any]) -> str:
    identities = report["identities"]
    if not identities:
        policy = "" if report["policy"] is None else f", policy {report['policy']['name']!r}"
        return f"no identity holds state (prefix {report['prefix']!r}{policy})"
    rows = [[e["identity"], str(e["keys"]), "banned" if e["banned"] else "",
             ", ".join(e["policies"])] for e in identities]
    lines = _table(["identity (as stored)", "keys", "ban", "policies"], rows)
    if report["truncated"]:
        lines.append(f"... stopped at --limit {len(identities)}; more identities hold state")
    if report["note"]:
        lines.append(f"note: {report['note']}")
    return "\n".join(lines)


def render_ping(url: str, report: dict[str, Any]) -> str:
    server = "Valkey" if report.get("server") == "valkey" else "Redis"
    kind = f"{server} Cluster" if report["cluster"] else server
    nodes = report["nodes"]
    return (f"{url}: {kind} {report['version']}, {nodes} primar{'y' if nodes == 1 else 'ies'}\n"
            f"round trip {report['rtt_ms']:.3f} ms; script loaded (sha1 {report['script_sha']})")
