"""For view code that decides itself: `is_ratelimited` and its async twin.

    from ratelimit_mw.django import is_ratelimited

    def login(request):
        if is_ratelimited(request, "5/minute", key=keys.client_ip(), name="login"):
            return HttpResponse("slow down", status=429)

The limiters are those of ``settings.RATELIMIT``. ``name`` names the counter: calls with the
same name (and algorithm) count together, so give each use its own. ``increment=False``
asks without counting. The Decision is left on ``request.ratelimit``; with the settings'
``enabled`` off nothing is limited. A store that fails
applies ``on_backend_error`` from the settings: ``"allow"`` (and ``"memory"``) say "not
limited", ``"deny"`` says "limited", a callable decides.
"""

from __future__ import annotations

import functools
from typing import Any

from ratelimit_mw.core.decision import Decision
from ratelimit_mw.core.errors import BackendError
from ratelimit_mw.core.policy import Policy, as_policy
from ratelimit_mw.django import conf
from ratelimit_mw.http.log import ThrottledLog
from ratelimit_mw.keys import KeyFunc, client_ip, reads

_DEFAULT_KEY = client_ip()
_log = ThrottledLog()


@functools.lru_cache(maxsize=256)
def _policy(rates: str, name: str | None) -> Policy:
    return as_policy(rates) if name is None else Policy(rates, name=name)


def _asked(request: Any, rates: Policy | str, key: KeyFunc | None, name: str | None
           ) -> tuple[Policy, str] | None:
    """The policy and the identity to count, or None: nothing to limit (the key said None,
    or the settings turned limiting off)."""
    policy = rates if isinstance(rates, Policy) else _policy(rates, name)
    identity = (key or _DEFAULT_KEY)(request)
    if identity is None or not conf.current().settings.config.enabled:
        return None
    return policy, identity


def _limited(request: Any, decision: Decision | None, error: BaseException | None) -> bool:
    if error is None:
        request.ratelimit = decision
        return decision is not None and not decision.allowed
    request.ratelimit = None
    policy = conf.current().settings.config.on_backend_error
    _log("ratelimit_mw is_ratelimited: the store failed", error)
    if policy == "deny":
        return True
    if callable(policy):
        try:
            return not policy(request, error)
        except Exception as exc:
            _log("ratelimit_mw on_backend_error callable raised; not limiting", exc)
    return False


def is_ratelimited(request: Any, rates: Policy | str, *, key: KeyFunc | None = None,
                   cost: int = 1, name: str | None = None, increment: bool = True) -> bool:
    """Whether this request is over `rates` for its key (default: the client IP); a key
    that says None is never limited. ``increment=False`` peeks."""
    asked = _asked(request, rates, key, name)
    if asked is None:
        return _limited(request, None, None)
    limiter = conf.current().sync()
    try:
        decision = limiter.hit(*asked, cost) if increment else limiter.peek(*asked)
    except BackendError as exc:
        return _limited(request, None, exc)
    return _limited(request, decision, None)


async def ais_ratelimited(request: Any, rates: Policy | str, *, key: KeyFunc | None = None,
                          cost: int = 1, name: str | None = None,
                          increment: bool = True) -> bool:
    """`is_ratelimited` for async views, on the settings' AsyncLimiter."""
    if hasattr(request, "auser") and "user" in reads(key or _DEFAULT_KEY):
        request.user = await request.auser()  # the lazy user cannot load on the loop
    asked = _asked(request, rates, key, name)
    if asked is None:
        return _limited(request, None, None)
    limiter = conf.current().asynchronous()
    try:
        return _limited(request, await (limiter.hit(*asked, cost) if increment
                                        else limiter.peek(*asked)), None)
    except BackendError as exc:
        return _limited(request, None, exc)
