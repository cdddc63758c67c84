"""`Config`: every option of the HTTP middleware, validated once, frozen, shared by all adapters.

    from ratelimit_mw.http.config import Config      # also ratelimit_mw.asgi.Config etc.

    RATE_LIMITS = Config(default="100/minute",
                         rules=[Rule("/login", "5/minute", methods=["POST"])])
    app.add_middleware(RateLimitMiddleware, limiter=limiter, config=RATE_LIMITS)

Build it at import time: a mistyped option raises `ConfigurationError` when the module loads,
not on the first request (Starlette builds its middleware stack lazily, so an error raised
inside ``add_middleware`` would only show as a 500 on every request). Every adapter
(``ratelimit_mw.asgi``, ``.wsgi``, ``.flask``, ``.fastapi``) takes ``config=`` or the same
keywords, which are checked by building a Config.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias, TypedDict

from ratelimit_mw.core.decision import Decision
from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.core.policy import Policy, as_policy, check_shared_logs
from ratelimit_mw.http.rules import Rule, as_rules
from ratelimit_mw.keys import KeyFunc, client_ip
from ratelimit_mw.routing import Predicate, validate_key, validate_predicate

ErrorPolicy: TypeAlias = str | Callable[[Any, BaseException], bool]
RateText: TypeAlias = Policy | str | Sequence[Policy | str] | None

MODES = ("enforce", "shadow")


def _seconds(name: str, value: object, *, zero: bool) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if not ok or not (value >= 0 if zero else value > 0):  # type: ignore[operator]
        bound = ">= 0" if zero else "> 0"
        raise ConfigurationError(
            f"{name} must be a number of seconds {bound}, e.g. {name}=0.1; got {value!r}"
        )
    return float(value)  # type: ignore[arg-type]


ENABLED_VARIABLE = "RATELIMIT_ENABLED"
_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on", "")


def _enabled(value: object) -> bool:
    """``enabled`` as given, else as ``RATELIMIT_ENABLED`` says (on when it is not set)."""
    if isinstance(value, bool):
        return value
    if value is not None:
        raise ConfigurationError(f"enabled must be True or False, got {value!r}")
    text = os.environ.get(ENABLED_VARIABLE)
    if text is None or text.strip().lower() in _ON:
        return True
    if text.strip().lower() in _OFF:
        return False
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
    """The middleware's options (see the module docstring for how to pass them).

    - ``default``: policy or rate string (or several) for every request whose route carries
      no decorator; ``None`` limits only decorated routes and rules.
    - ``per_method``: the default limit counts each HTTP method apart (GET and POST of one
      client spend two quotas); default False: one quota per client.
    - ``rules``: ``[Rule("/login", "5/minute", methods=["POST"])]`` or ``{"/api/*": "..."}``;
      they apply to every matching request, decorated or not.
    - ``key``: key function, default ``keys.client_ip()``.
    - ``on_backend_error``: ``"allow"`` (admit, log), ``"deny"`` (503 with Retry-After),
      ``"memory"`` (decide in this process's memory while the store is out) or a callable
      ``(request, error) -> bool`` (True admits).
    - ``headers``: ``RateLimit``/``RateLimit-Policy`` on admitted responses (429s always
      carry them); ``legacy_headers`` adds ``X-RateLimit-Limit/Remaining/Reset``.
    - ``mode``: ``"enforce"`` or ``"shadow"`` (count and report, never refuse).
    - ``on_blocked``: ``(request, decision) -> response`` for refusals instead of the JSON
      429 (an ASGI app, a WSGI app or a Flask view return value, per adapter).
    - ``on_refusal``: ``(request, decision) -> None``, told of every refusal, shadow or real.
    - ``count_when``: ``(status) -> bool``; a response for which it is False gives its hit
      back (recorded before the app runs, refunded after).
    - ``exempt_when``: ``(request) -> bool``; True skips every limit for the request
      (allow-listed addresses, admins).
    - ``charge_preflight``: CORS preflights (``OPTIONS`` with
      ``Access-Control-Request-Method``) spend quota; default False.
    - ``charge_method_not_allowed``: 405 answers keep their hit; default False (given back).
    - ``backend_timeout``: deadline of every async backend call (seconds; the sync adapters
      rely on the client's own timeouts); ``backend_cooldown``: how long to skip the
      backend after a failure before one probe tries it again.
    - ``enabled``: False turns every limit off (requests pass untouched, no headers); when
      not given, the environment variable ``RATELIMIT_ENABLED`` decides (``0``, ``false``,
      ``no``, ``off`` turn it off), read once, when the configuration is made.
    - ``websockets``: the ASGI middleware limits WebSocket handshakes as GETs to their path
      (default True); False leaves them alone.
    """

    default: RateText = None
    rules: Any = None
    key: KeyFunc | None = None
    on_backend_error: ErrorPolicy = "allow"
    headers: bool = True
    legacy_headers: bool = False
    mode: str = "enforce"
    on_blocked: Callable[[Any, Decision], Any] | None = None
    on_refusal: Callable[[Any, Decision], None] | None = None
    count_when: Callable[[int], bool] | None = None
    exempt_when: Predicate | None = None
    per_method: bool = False
    charge_preflight: bool = False
    charge_method_not_allowed: bool = False
    backend_timeout: float = 0.1
    backend_cooldown: float = 1.0
    enabled: bool | None = None
    websockets: bool = True
    # Normalised forms, filled in by __post_init__.
    defaults: tuple[Policy, ...] = field(default=(), init=False, repr=False)
    rule_list: tuple[Rule, ...] = field(default=(), init=False, repr=False)
    key_func: KeyFunc = field(default=client_ip(), init=False, repr=False)

    def __post_init__(self) -> None:
        put = object.__setattr__
        key = validate_key(self.key)
        put(self, "key_func", client_ip() if key is None else key)
        default = self.default
        if default is None:
            defaults: tuple[Policy, ...] = ()
        elif isinstance(default, (Policy, str)):
            defaults = (as_policy(default),)
        elif isinstance(default, Sequence):
            defaults = tuple(as_policy(p) for p in default)
        else:
            raise ConfigurationError(
                f'default takes a rate string such as "100/minute", a Policy or a list of '
                f"them, got {default!r}"
            )
        put(self, "defaults", defaults)
        put(self, "rule_list", as_rules(self.rules))
        check_shared_logs([*defaults, *(rule.policy for rule in self.rule_list
                                        if rule.policy is not None)])
        if not (self.on_backend_error in ("allow", "deny", "memory")
                or callable(self.on_backend_error)):
            raise ConfigurationError(
                f'on_backend_error must be "allow", "deny", "memory" or a callable (request, '
                f"error) -> bool, got {self.on_backend_error!r}"
            )
        if self.mode not in MODES:
            raise ConfigurationError(f'mode must be "enforce" or "shadow", got {self.mode!r}')
        for name in ("headers", "legacy_headers", "per_method", "charge_preflight",
                     "charge_method_not_allowed", "websockets"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigurationError(
                    f"{name} must be True or False, got {getattr(self, name)!r}"
                )
        _callable("on_blocked", self.on_blocked,
                  "(request, decision) -> response, e.g. on_blocked=lambda request, decision: "
                  "PlainTextResponse('slow down', status_code=429)")
        _callable("on_refusal", self.on_refusal, "(request, decision) -> None")
        _callable("count_when", self.count_when,
                  "(status) -> bool, e.g. count_when=lambda status: status >= 400")
        validate_predicate("exempt_when", self.exempt_when)
        put(self, "backend_timeout", _seconds("backend_timeout", self.backend_timeout,
                                              zero=False))
        put(self, "backend_cooldown", _seconds("backend_cooldown", self.backend_cooldown,
                                               zero=True))
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


def _unknown_options(names: Iterable[str]) -> ConfigurationError:
    hints = []
    for name in sorted(names):
        close = difflib.get_close_matches(name, OPTION_NAMES, n=1)
        hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return ConfigurationError(
        f"unknown rate-limit option {', '.join(hints)}; the options are "
        f"{', '.join(OPTION_NAMES)}"
    )


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
    unknown = set(options) - set(OPTION_NAMES)
    if unknown:
        raise _unknown_options(unknown)
    _dataclass_init(self, **options)


setattr(Config, "__init__", _checked_init)  # noqa: B010 - mypy forbids assigning a method


def build_config(config: Config | None, options: Mapping[str, Any]) -> Config:
    """What an adapter's constructor does with ``config=`` and its keywords.

    Either a Config or keywords (not both, so that no option silently wins over another),
    and an unknown keyword is named with the closest option.
    """
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
