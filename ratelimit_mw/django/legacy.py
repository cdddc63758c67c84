"""django-ratelimit's spellings, and what to write here instead.

ratelimit_mw.django is a drop-in target for django-ratelimit users, whose code and settings
would otherwise be ignored or fail on a request: its string keys (``"ip"``,
``"post:username"``, a dotted path), its ``(group, request)`` key and rate callables and
its dotted-path rates are refused where they are written (`check_key`, `check_rates`),
and its ``RATELIMIT_*`` settings are named by a system check (`legacy_settings`), each
with the ratelimit_mw spelling.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ratelimit_mw.core.errors import ConfigurationError

_KEYS = {
    "ip": "keys.client_ip() (the default: leave key out; behind proxies "
          "keys.client_ip(trusted_proxies=[...]))",
    "user": "keys.user()",
    "user_or_ip": "ratelimit_mw.django.user_or_ip()",
}
_FIELD_KEYS = {
    "header": 'keys.header("{}")',
    "post": 'ratelimit_mw.django.form_field("{}")',
    "get": 'ratelimit_mw.django.query_param("{}")',
}


def _positional(func: object) -> int:
    """How many positional arguments `func` requires (0 when its signature is unknown)."""
    try:
        parameters = inspect.signature(func).parameters.values()  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0
    return sum(1 for p in parameters
               if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
               and p.default is p.empty)


def _name(func: object) -> str:
    return str(getattr(func, "__qualname__", None) or type(func).__qualname__)


def _key_text(key: str) -> str:
    """What to write instead of django-ratelimit's string key `key`."""
    if key in _KEYS:
        return _KEYS[key]
    kind, colon, field = key.partition(":")
    if colon and kind in _FIELD_KEYS and field:
        return _FIELD_KEYS[kind].format(field)
    if "." in key:
        return (f"the function itself, imported (from {key.rpartition('.')[0]} import "
                f"{key.rpartition('.')[2]}), taking the request only")
    return "a key function (request) -> str, e.g. keys.header(\"X-Api-Key\")"


def check_key(key: object, where: str = "key") -> None:
    """ConfigurationError for a django-ratelimit key: a string, or a ``(group, request)``
    callable (which would only fail on a request, and fall back to the client IP)."""
    if isinstance(key, str):
        raise ConfigurationError(
            f"{where}={key!r} is django-ratelimit's spelling; ratelimit_mw takes a key "
            f"function: write {where}={_key_text(key)}"
        )
    if callable(key) and _positional(key) >= 2:
        raise ConfigurationError(
            f"{where}={_name(key)} takes {_positional(key)} arguments, as django-ratelimit's "
            f"(group, request) keys do; a key function takes the request only: write "
            f"{where}=lambda request: {_name(key)}(GROUP, request), or drop its group argument"
        )


def check_rates(rates: object) -> None:
    """ConfigurationError for a django-ratelimit rate: a dotted path to a callable, or a
    ``(group, request)`` callable."""
    parts = rates.split(".") if isinstance(rates, str) else []
    if len(parts) > 1 and all(part.isidentifier() for part in parts):
        module, _, name = str(rates).rpartition(".")
        raise ConfigurationError(
            f"limit({rates!r}) looks like django-ratelimit's dotted path to a rate callable; "
            f"pass the function itself (from {module} import {name}; limit({name})), which "
            f"takes the request and returns rate text such as \"100/minute\" or None"
        )
    if callable(rates) and not isinstance(rates, str) and _positional(rates) >= 2:
        raise ConfigurationError(
            f"limit({_name(rates)}): the rate callable takes {_positional(rates)} arguments, "
            f"as django-ratelimit's (group, request) rates do; it takes the request only: "
            f"write limit(lambda request: {_name(rates)}(GROUP, request))"
        )


def _enable(value: Any) -> str:
    return ('RATELIMIT = {..., "enabled": False}' if not value
            else 'nothing to write (limiting is on unless RATELIMIT = {..., "enabled": False})')


def _fail_open(value: Any) -> str:
    return ('RATELIMIT = {..., "on_backend_error": "allow"} (the default)' if value
            else 'RATELIMIT = {..., "on_backend_error": "deny"} (django-ratelimit\'s default '
                 'fails closed; ratelimit_mw\'s admits: "allow")')


#: django-ratelimit's settings -> what to write in ``settings.RATELIMIT`` instead, given the
#: value set.
SETTINGS: dict[str, Callable[[Any], str]] = {
    "RATELIMIT_ENABLE": _enable,
    "RATELIMIT_USE_CACHE": lambda value: (
        'RATELIMIT = {..., "backend": "redis://host:6379/0"} (a Redis URL: counts live in '
        "Redis under the prefix, not in Django's cache)"),
    "RATELIMIT_CACHE_PREFIX": lambda value: 'RATELIMIT = {..., "prefix": "rl"}',
    "RATELIMIT_VIEW": lambda value: (
        'RATELIMIT = {..., "on_blocked": ratelimited} with ratelimited(request, decision) '
        "returning the response (the view function itself, not its dotted path)"),
    "RATELIMIT_EXCEPTION_CLASS": lambda value: (
        "nothing is raised: a refusal is the middleware's 429; RATELIMIT = {..., "
        '"on_blocked": ...} returns your own response'),
    "RATELIMIT_FAIL_OPEN": _fail_open,
    "RATELIMIT_IP_META_KEY": lambda value: (
        'RATELIMIT = {..., "key": keys.client_ip(trusted_proxies=[...])} naming your '
        "proxies (Forwarded / X-Forwarded-For are walked from the right), and the same key "
        "on any limit(...) that sets its own"),
    "RATELIMIT_IPV4_MASK": lambda value: (
        "no counterpart: an IPv4 client counts by its address (/32); group addresses with a "
        "key function of your own"),
    "RATELIMIT_IPV6_MASK": lambda value: (
        f'RATELIMIT = {{..., "key": keys.client_ip(ipv6_prefix={value!r})}} (the default '
        "groups IPv6 by /64)"),
    "RATELIMIT_HASH_ALGORITHM": lambda value: (
        "nothing to write: ratelimit_mw encodes (and hashes where needed) its own "
        "identities"),
    "RATELIMIT_BACKEND": lambda value: (
        'RATELIMIT = {..., "backend": "redis://host:6379/0"}, or "limiter" / '
        '"async_limiter" for a limiter of your own'),
}


def legacy_settings(settings: Any) -> list[tuple[str, str]]:
    """(name, what to write instead) for every django-ratelimit setting that is set."""
    return [(name, instead(getattr(settings, name))) for name, instead in SETTINGS.items()
            if hasattr(settings, name)]
