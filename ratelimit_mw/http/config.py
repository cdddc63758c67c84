"""`Config`: every option of the HTTP middleware, validated once, frozen, shared by all adapters.

Every adapter takes ``config=Config(default="100/minute", ...)`` or the same keywords, which
are checked by building a Config. Build it at import time: a mistyped option then raises
`ConfigurationError` when the module loads, not on the first request (Starlette builds its
middleware stack lazily: an error inside ``add_middleware`` would show as a 500 on every
request).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias, TypedDict

from ratelimit_mw.core.decision import Decision
from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.core.policy import Policy, as_policy, check_shared_logs
from ratelimit_mw.http.rules import Rule, as_rules
from ratelimit_mw.keys import KeyFunc, client_ip
from ratelimit_mw.routing import (
    Predicate,
    in_flight_policy,
    named_in_flight,
    validate_count_when,
    validate_key,
    validate_predicate,
)

ErrorPolicy: TypeAlias = str | Callable[[Any, BaseException], bool]
RateText: TypeAlias = Policy | str | Sequence[Policy | str] | None


def _seconds(name: str, value: object, *, zero: bool) -> float:
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not (value >= 0 if zero else value > 0)):
        raise ConfigurationError(f"{name} must be a number of seconds {'>= 0' if zero else '> 0'}"
                                 f", e.g. {name}=0.1; got {value!r}")
    return float(value)


ENABLED_VARIABLE = "RATELIMIT_ENABLED"
_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on", "")


def _enabled(value: object) -> bool:
    """``enabled`` as given, else as ``RATELIMIT_ENABLED`` says (on when it is not set)."""
    if isinstance(value, bool):
        return value
    if value is not None:
        raise ConfigurationError(f"enabled must be True or False, got {value!r}")
    text = os.environ.get(ENABLED_VARIABLE, "")
    if text.strip().lower() in (*_ON, *_OFF):
        return text.strip().lower() in _ON
    raise ConfigurationError(
        f"{ENABLED_VARIABLE}={text!r} is neither on nor off; write {ENABLED_VARIABLE}=0 "
        f"(or false) to turn rate limiting off, 1 (or true) to keep it on"
    )


def _callable(name: str, value: object, shape: str) -> Any:
    if value is not None and not callable(value):
        raise ConfigurationError(f"{name} must be a callable {shape}, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class Config:
    """The middleware's options (docs/middleware.md has the table), validated once."""

    default: RateText = None  # policy or rate (or several) for requests no decorator limits
    rules: Any = None  # [Rule("/login", "5/minute", methods=["POST"])] or {"/api/*": "..."}
    key: KeyFunc | None = None  # the key function, default keys.client_ip()
    on_backend_error: ErrorPolicy = "allow"  # "deny" (503), "memory" or (request, error) -> bool
    headers: bool = True  # RateLimit fields on admitted responses (429s always carry them)
    legacy_headers: bool = False  # X-RateLimit-Limit/Remaining/Reset too
    mode: str = "enforce"  # "shadow": count and report, never refuse
    on_blocked: Callable[[Any, Decision], Any] | None = None  # (request, decision) -> response
    on_refusal: Callable[[Any, Decision], None] | None = None  # told of every refusal
    count_when: Callable[[int], bool] | None = None  # (status) -> bool; False gives the hit back
    exempt_when: Predicate | None = None  # (request) -> bool; True skips every limit
    per_method: bool = False  # the default counts each HTTP method apart
    charge_preflight: bool = False  # CORS preflights spend quota
    charge_method_not_allowed: bool = False  # 405 answers keep their hit
    backend_timeout: float = 0.1  # deadline of each async backend call, in seconds
    backend_cooldown: float = 1.0  # after a failure, how long until one probe tries again
    enabled: bool | None = None  # False: every limit off; None: RATELIMIT_ENABLED says
    websockets: bool = True  # the ASGI middleware limits WebSocket handshakes as GETs
    # N (or a Policy.in_flight): at most N of a key's requests in flight at once, for
    # requests that no decorator limits (as `default`)
    concurrency: Policy | int | None = None
    # A renewal that finds an in-flight slot gone to another request (the process paused
    # past its lease): "continue" the response without it, or "end" it.
    on_lease_lost: str = "continue"
    # Normalised forms, filled in by __post_init__.
    defaults: tuple[Policy, ...] = field(default=(), init=False, repr=False)
    in_flight: Policy | None = field(default=None, init=False, repr=False)
    rule_list: tuple[Rule, ...] = field(default=(), init=False, repr=False)
    key_func: KeyFunc = field(default=client_ip(), init=False, repr=False)

    def __post_init__(self) -> None:
        put = object.__setattr__
        key = validate_key(self.key)
        put(self, "key_func", client_ip() if key is None else key)
        default = () if self.default is None else self.default
        if not isinstance(default, (Policy, str, Sequence)):
            raise ConfigurationError(
                f'default takes a rate string such as "100/minute", a Policy or a list of '
                f"them, got {default!r}"
            )
        defaults = tuple(map(as_policy, [default] if isinstance(default, (Policy, str))
                             else default))
        put(self, "defaults", defaults)
        in_flight = in_flight_policy(self.concurrency)
        put(self, "in_flight", None if in_flight is None else named_in_flight(in_flight,
                                                                               "default"))
        put(self, "rule_list", as_rules(self.rules))
        check_shared_logs([*defaults, *(rule.policy for rule in self.rule_list
                                        if rule.policy is not None)])
        if not (self.on_backend_error in ("allow", "deny", "memory")
                or callable(self.on_backend_error)):
            raise ConfigurationError(
                f'on_backend_error must be "allow", "deny", "memory" or a callable (request, '
                f"error) -> bool, got {self.on_backend_error!r}"
            )
        if self.on_lease_lost not in ("continue", "end"):
            raise ConfigurationError(
                f'on_lease_lost must be "continue" (the response goes on without its slot) '
                f'or "end" (the response is ended), got {self.on_lease_lost!r}; e.g. '
                f'on_lease_lost="end"')
        if self.mode not in ("enforce", "shadow"):
            raise ConfigurationError(f'mode must be "enforce" or "shadow", got {self.mode!r}')
        for name in ("headers", "legacy_headers", "per_method", "charge_preflight",
                     "charge_method_not_allowed", "websockets"):
            if not isinstance(value := getattr(self, name), bool):
                raise ConfigurationError(f"{name} must be True or False, got {value!r}")
        _callable("on_blocked", self.on_blocked,
                  "(request, decision) -> response, e.g. on_blocked=lambda request, decision: "
                  "PlainTextResponse('slow down', status_code=429)")
        _callable("on_refusal", self.on_refusal, "(request, decision) -> None")
        validate_count_when(self.count_when)
        validate_predicate("exempt_when", self.exempt_when)
        for name, zero in (("backend_timeout", False), ("backend_cooldown", True)):
            put(self, name, _seconds(name, getattr(self, name), zero=zero))
        put(self, "enabled", _enabled(self.enabled))

    @property
    def shadow(self) -> bool:
        return self.mode == "shadow"

    def replace(self, **changes: Any) -> Config:
        """A copy with some options changed (validated again)."""
        return build_config(None, {**self.options(), **changes})

    def options(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(Config) if f.init)


class ConfigOptions(TypedDict, total=False):
    """Config's options as keywords, typed: what the adapters take besides ``config=``
    (``**options: Unpack[ConfigOptions]``, so that ``app.add_middleware(RateLimitMiddleware,
    ...)`` type-checks under mypy --strict; tests/test_http.py holds it to Config)."""

    default: RateText
    rules: Any
    key: KeyFunc | None
    on_backend_error: ErrorPolicy
    headers: bool
    legacy_headers: bool
    mode: str
    on_blocked: Callable[[Any, Decision], Any] | None
    on_refusal: Callable[[Any, Decision], None] | None
    count_when: Callable[[int], bool] | None
    exempt_when: Predicate | None
    per_method: bool
    charge_preflight: bool
    charge_method_not_allowed: bool
    backend_timeout: float
    backend_cooldown: float
    enabled: bool | None
    websockets: bool
    concurrency: Policy | int | None
    on_lease_lost: str


_dataclass_init = Config.__init__


@functools.wraps(_dataclass_init)
def _checked_init(self: Config, *args: Any, **options: Any) -> None:
    # The generated __init__ answers a misspelt option with a bare TypeError; a user who
    # builds Config(...) at import time should get the same ConfigurationError (with the
    # closest option named) as one who passes keywords to an adapter.
    if args:
        raise ConfigurationError(
            f"Config takes keyword options only, e.g. Config(default=\"60/minute\"); got "
            f"{len(args)} positional argument(s)"
        )
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        hints = [f"{name!r}" + "".join(f" (did you mean {close!r}?)" for close in
                                       difflib.get_close_matches(name, OPTION_NAMES, n=1))
                 for name in unknown]
        raise ConfigurationError(f"unknown rate-limit option {', '.join(hints)}; the options "
                                 f"are {', '.join(OPTION_NAMES)}")
    _dataclass_init(self, **options)


setattr(Config, "__init__", _checked_init)  # noqa: B010 - mypy forbids assigning a method


def build_config(config: Config | None, options: Mapping[str, Any]) -> Config:
    """What an adapter's constructor does with ``config=`` and its keywords: either, not both
    (so that no option silently wins over another)."""
    if config is not None:
        if not isinstance(config, Config):
            raise ConfigurationError(f"config must be a ratelimit_mw Config, got {config!r}")
        if options:
            raise ConfigurationError(
                f"give either config= or options, not both (got config and "
                f"{', '.join(sorted(options))}); write config=config.replace(...)"
            )
        return config
    return Config(**options)


__all__ = ["OPTION_NAMES", "Config", "ConfigOptions", "ErrorPolicy", "Rule", "build_config"]
