"""The app's hooks answered ahead of the guard's plan, for one request (hooks.py has the rest).

A hook's answer that is awaitable is awaited here on the async side (`awaited_async`); on the
sync side it fails as the hook raising would (`awaited_sync`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from ratelimit_mw.hooks import Answers, Raised, awaited_async


async def answer_all_async(hooks: Iterable[Callable[[Any], Any]], request: Any) -> Answers:
    """Each hook's answer for `request`, awaited on the async side (a coroutine on the sync
    side fails as the hook raising would); what one raises is kept as Raised."""
    found: Answers = {}
    for hook in hooks:
        try:
            value = hook(request)
            if inspect.isawaitable(value):
                value = await awaited_async(hook, value)
        except Exception as exc:
            value = Raised(exc)
        found[id(hook)] = value
    return found

