"""ratelimit_mw.hooks, and the answers ratelimit_mw._async.hooks (and its sync twin) gather
ahead of the plan: a hook's answer is a value, never a coroutine taken for one (a coroutine
is truthy: as exempt_when it would switch a limit off)."""

from __future__ import annotations

import asyncio
import warnings
from typing import Any

import pytest

from ratelimit_mw._async.hooks import answer_all_async
from ratelimit_mw._sync.hooks import answer_all_sync
from ratelimit_mw.hooks import Raised, ask


async def _async_exempt(request: Any) -> bool:
    return False


def _plain_exempt(request: Any) -> bool:
    return request == "admin"


def test_the_async_side_awaits_an_async_hook() -> None:
    answers = asyncio.run(answer_all_async([_async_exempt, _plain_exempt], "admin"))
    assert answers == {id(_async_exempt): False, id(_plain_exempt): True}


def test_the_sync_side_fails_an_async_hook_as_if_it_had_raised() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a coroutine left unawaited would warn
        answers = answer_all_sync([_async_exempt, _plain_exempt], "admin")
    raised = answers[id(_async_exempt)]
    assert type(raised) is Raised and isinstance(raised.error, TypeError)
    assert answers[id(_plain_exempt)] is True
    with pytest.raises(TypeError, match="_async_exempt returned an awaitable"):
        ask(_async_exempt, "admin", answers)


def test_a_hook_asked_directly_refuses_an_awaitable() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(TypeError, match="nothing here awaits"):
            ask(_async_exempt, "x", None)
    assert ask(_plain_exempt, "admin", None) is True
