"""In-flight limits (``concurrency=``) behind every adapter, on every store: a request's
slot is taken with its rate in one call and given back when its response has ended, so
requests one after another never run out of slots; a refusal for a slot charges no rate.
(Requests held open at once are tested per adapter: tests/asgi, tests/wsgi, tests/djangoapp.)"""

from __future__ import annotations

from support.driver import Driver

import ratelimit_mw as rl
from ratelimit_mw.http.config import Config
from ratelimit_mw.http.rules import Rule

SLOT = '"in flight";q=1;qu="concurrent-requests"'


def test_a_default_slot_comes_back_after_each_response(driver: Driver) -> None:
    driver.build(Config(default="100/minute", concurrency=1))
    replies = [driver.request() for _ in range(4)]
    assert [reply.status for reply in replies] == [200] * 4
    # The rate governs an admitted response's RateLimit; the policy lists both.
    assert replies[-1].headers["ratelimit"] == '"minute";r=96;t=60'
    assert replies[-1].headers["ratelimit-policy"] == f'"minute";q=100;w=60, {SLOT}'


def test_a_response_that_fails_gives_its_slot_back_too(driver: Driver) -> None:
    driver.build(Config(default="100/minute", concurrency=1))
    assert driver.statuses(3, path="/status/500") == [500] * 3
    assert driver.request().status == 200


def test_a_slot_alone_with_a_count_when_gives_back_in_the_same_call(driver: Driver) -> None:
    driver.build(Config(default="3/minute", concurrency=rl.Policy.in_flight(1, lease=300),
                        count_when=lambda status: status < 400))
    # Every 404 gives back its hit and its slot: the 3/minute is never spent.
    assert driver.statuses(5, path="/status/404") == [404] * 5
    assert driver.statuses(4) == [200, 200, 200, 429]


def test_a_route_and_a_rule_hold_slots_of_their_own(routed: Driver) -> None:
    routed.build(Config(rules=[Rule("/items", concurrency=1)]), route_rates="5/minute",
                 route_options={"concurrency": 1})
    assert routed.statuses(3, path="/keyed") == [200] * 3
    assert routed.statuses(3, path="/items") == [200] * 3
    reply = routed.request(path="/keyed")
    assert reply.headers["ratelimit"] == '"minute";r=1;t=60'


def test_a_decorator_with_only_slots_keeps_the_default_rate(routed: Driver) -> None:
    # The most expensive route must not leave the default rate by gaining a slot limit.
    routed.build(Config(default="3/minute"), route_rates=None, route_options={"concurrency": 2})
    assert routed.statuses(3) == [200] * 3
    reply = routed.request(path="/keyed")
    assert reply.status == 429
    assert reply.headers["ratelimit"] == '"minute";r=0;t=60'
    assert reply.headers["ratelimit-policy"] == f'{SLOT.replace("q=1", "q=2")}, "minute";q=3;w=60'


def test_a_decorator_with_only_a_rate_keeps_the_default_slots(routed: Driver) -> None:
    routed.build(Config(default="100/minute", concurrency=1), route_rates="5/minute")
    replies = [routed.request(path="/keyed") for _ in range(3)]
    assert [reply.status for reply in replies] == [200] * 3  # each slot came back
    policy = replies[-1].headers["ratelimit-policy"]
    assert SLOT in policy and "q=5;w=60" in policy and "q=100" not in policy
    assert replies[-1].headers["ratelimit"].endswith("r=2;t=60")
