"""`bounded`: the deadline around a call that has no give-up time of its own (a cluster's,
a refusal asked about again, redis-py's), with the loop's one look before it cancels."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
from backends.loops import event_loops, io_callback, run_on

from ratelimit_mw.backends.base import TURNS, bounded
from ratelimit_mw.backends.pipeline import SETUP_TURNS

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11),
                                reason="Python 3.10's bounded is asyncio.wait_for, no look")


async def answered_by_io_while_busy(deadline: float, busy: float) -> Any:
    """`bounded` around a future that an I/O callback resolves; the loop is busy past the
    deadline (in a callback) just as the bytes that resolve it arrive."""
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[str] = loop.create_future()
    with io_callback(lambda: answer.set_result("answer")) as make_readable:

        def busy_loop() -> None:
            make_readable()  # the answer is in: read at the loop's next poll
            time.sleep(busy)

        loop.call_soon(busy_loop)
        return await bounded(answer, deadline)


@pytest.mark.parametrize("new_loop", event_loops())
def test_an_answer_that_came_while_the_loop_was_busy_past_the_deadline_is_taken(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    """asyncio runs due timers after the I/O callbacks of their iteration but before the
    task they woke; uvloop runs the timers that fell due during a callback before it polls
    again: either way a plain ``asyncio.timeout`` cancels a call whose answer is there."""
    assert run_on(new_loop, lambda: answered_by_io_while_busy(0.02, 0.05)) == "answer"


@pytest.mark.parametrize("turns", [TURNS, SETUP_TURNS])
@pytest.mark.parametrize("new_loop", event_loops())
def test_no_answer_by_the_look_is_a_timeout_and_the_task_is_not_left_cancelling(
    new_loop: Callable[[], asyncio.AbstractEventLoop], turns: int,
) -> None:
    """On an idle loop the turns a deadline waits for take no time: a server that does not
    answer fails the call (a set-up's turns included) long before its late answer."""
    async def main() -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        late: asyncio.Future[str] = loop.create_future()
        loop.call_later(0.2, late.set_result, "too late")  # the loop idles meanwhile
        try:
            await bounded(late, 0.02, turns)
        except TimeoutError as exc:
            outcome = type(exc).__name__
        else:
            outcome = "answered"
        task = asyncio.current_task()
        assert task is not None
        return outcome, task.cancelling()

    assert run_on(new_loop, main) == ("TimeoutError", 0)


@pytest.mark.parametrize("new_loop", event_loops())
def test_a_cancellation_from_outside_stays_a_cancellation(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    async def main() -> str:
        loop = asyncio.get_running_loop()
        waiting = loop.create_task(bounded(loop.create_future(), 10))
        await asyncio.sleep(0.01)
        waiting.cancel()
        try:
            await waiting
        except asyncio.CancelledError:
            return "cancelled"
        return "not cancelled"

    assert run_on(new_loop, main) == "cancelled"


@pytest.mark.parametrize("new_loop", event_loops())
def test_no_deadline_waits_as_long_as_it_takes(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    async def main() -> str:
        loop = asyncio.get_running_loop()
        slow: asyncio.Future[str] = loop.create_future()
        loop.call_later(0.05, slow.set_result, "answer")
        return await bounded(slow, None)

    assert run_on(new_loop, main) == "answer"


async def exchange_on_a_busy_loop(hops: int, turns: int) -> str:
    """`bounded` (20 ms deadline) around an exchange that takes `hops` turns of the loop (a
    set-up's round trips, each answer handed on by a callback), on a loop whose every turn a
    busy task makes 10 ms long."""
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[str] = loop.create_future()
    busy = True

    async def hold() -> None:
        while busy:
            time.sleep(0.01)
            await asyncio.sleep(0)

    def hop(left: int) -> None:
        if answer.done():  # given up on: the exchange stops
            return
        if left:
            loop.call_soon(hop, left - 1)
        else:
            answer.set_result("set up")

    holder = loop.create_task(hold())
    hop(hops)
    try:
        return await bounded(answer, 0.02, turns)
    except TimeoutError:
        return "timed out"
    finally:
        busy = False
        await holder


@pytest.mark.parametrize("new_loop", event_loops())
def test_an_exchange_of_many_turns_on_a_busy_loop_is_given_its_turns(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    """Turns of 10 ms outlast the 20 ms deadline: a call waiting for its usual two turns (and
    the look after them) is cut after twenty although nothing is wrong with the server; one
    given a set-up's turns is answered after ten (fewer than those turns: the look after
    them, as long again as they took, is not counted on)."""
    assert run_on(new_loop, lambda: exchange_on_a_busy_loop(20, TURNS)) == "timed out"
    assert run_on(new_loop, lambda: exchange_on_a_busy_loop(10, SETUP_TURNS)) == "set up"
