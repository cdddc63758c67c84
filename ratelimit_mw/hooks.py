"""The app's hooks (key functions, exempt_when, dynamic limits, costs), sync or async.

The guard decides without I/O. Under ASGI an ``async def`` hook is awaited by the adapter
before the guard plans (`ratelimit_mw._async.hooks.answer_all_async`), and the guard reads
its answer instead of calling it (`ask`). Under WSGI and Flask an async hook is a
ConfigurationError at configuration (`refuse_async`), and one that slips through (a plain
function returning a coroutine) fails like a hook that raised: a coroutine object is never
taken for a value (it is truthy: as ``exempt_when`` it would switch the limit off).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from ratelimit_mw.core.errors import ConfigurationError

Answers = dict[int, Any]  # id(hook) -> its answer for one request, or Raised


class Raised:
    """What a hook raised while it was answered ahead of the plan: raised again where the
    guard asks it, so that its failure is handled as if it had been called there."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


_MISSING = object()


def is_async(hook: object) -> bool:
    """Whether calling `hook` gives a coroutine: an ``async def`` (also behind
    functools.partial) or an object whose ``__call__`` is one."""
    if hook is None:
        return False
    return inspect.iscoroutinefunction(hook) or inspect.iscoroutinefunction(
        getattr(hook, "__call__", None))  # noqa: B004 - the method, not callable()


def name_of(hook: object) -> str:
    """A hook's name for messages: its function's, or its class's for a callable object."""
    return str(getattr(hook, "__qualname__", None) or type(hook).__qualname__)


def unawaited(hook: object, value: Any) -> TypeError:
    """The error for an awaitable that no one here can await (closed, so that Python does
    not warn that it was never awaited)."""
    close = getattr(value, "close", None)
    if close is not None:
        close()
    return TypeError(f"{name_of(hook)} returned an awaitable, which nothing here awaits")


async def awaited_async(hook: object, value: Any) -> Any:
    """What an async hook's answer comes to, on the async side (`_async/hooks.py`; its sync
    twin, written by hand as it cannot be generated, is `awaited_sync`)."""
    return await value


def awaited_sync(hook: object, value: Any) -> Any:
    """An async hook's answer on the sync side, where there is no loop to await it on."""
    raise unawaited(hook, value)


def ask(hook: Callable[[Any], Any], request: Any, answers: Answers | None) -> Any:
    """`hook`'s answer for `request`: awaited ahead of time when `answers` has it, else
    called now. A coroutine got here (no one to await it) is closed and raises TypeError."""
    if answers is not None:
        found = answers.get(id(hook), _MISSING)
        if found is not _MISSING:
            if type(found) is Raised:
                raise found.error
            return found
    value = hook(request)
    if inspect.isawaitable(value):
        raise unawaited(hook, value)
    return value


def refuse_async(where: str, hooks: Iterable[tuple[str, object]]) -> None:
    """ConfigurationError for the first async hook among (`option`, hook) pairs: `where`
    (WSGI, Flask) calls hooks without an event loop to await them on."""
    for option, hook in hooks:
        if is_async(hook):
            raise ConfigurationError(
                f"{option}={name_of(hook)} is async, which {where} cannot await "
                f"(there is no event loop to run it on); write it as a plain def, or use the "
                f"ASGI middleware, which awaits async hooks"
            )
