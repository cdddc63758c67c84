"""What an LLM answer says it used (`ratelimit_mw.http.usage`), however its stream is cut into
chunks, and how long a 429 or a spent RateLimit field asks every caller to stay away."""

from __future__ import annotations

import email.utils

import pytest

from ratelimit_mw.http.usage import Events, Meter, pause_of, usage_of

OPENAI = (b'data: {"choices":[{"delta":{"content":"hi"}}],"usage":null}\n\n'
          b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":5,'
          b'"total_tokens":12}}\n\ndata: [DONE]\n\n')
ANTHROPIC = (b'event: message_start\r\ndata: {"type":"message_start","message":{"usage":'
             b'{"input_tokens":30,"output_tokens":1}}}\r\n\r\n'
             b'event: content_block_delta\r\ndata: {"type":"content_block_delta"}\r\n\r\n'
             b'event: message_delta\r\ndata: {"type":"message_delta","usage":'
             b'{"output_tokens":9}}\r\n\r\nevent: message_stop\r\ndata: {"type":"message_stop"}'
             b'\r\n\r\n')


@pytest.mark.parametrize(("body", "cost"), [(OPENAI, 12), (ANTHROPIC, 39)])
def test_a_stream_says_its_usage_wherever_it_is_cut(body: bytes, cost: int) -> None:
    for cut in range(len(body) + 1):
        meter = Meter(stream=True)
        meter.feed(body[:cut])
        meter.feed(body[cut:])
        assert meter.cost == cost and meter.ended, cut


def test_a_stream_cut_short_says_what_it_saw_and_that_it_did_not_end() -> None:
    meter = Meter(stream=True)
    meter.feed(ANTHROPIC[:ANTHROPIC.index(b"event: content_block_delta")])
    assert meter.cost == 31 and not meter.ended


def test_a_json_body_says_its_usage() -> None:
    assert usage_of({"usage": {"total_tokens": 12, "input_tokens": 1}}) == 12
    assert usage_of({"usage": {"input_tokens": 10, "output_tokens": 4}}) == 14
    assert usage_of({"response": {"usage": {"total_tokens": 3}}}) == 3  # Responses API
    assert usage_of({"usage": None}) is None
    assert usage_of({"usage": {"total_tokens": -1}}) is None
    assert usage_of([1]) is None
    meter = Meter(stream=False)
    meter.feed(b'{"usage": {"total_')
    meter.feed(b'tokens": 9}}')
    meter.end()
    assert meter.cost == 9


def test_a_readers_failure_is_kept_not_raised() -> None:
    def read(event: str, data: str) -> int | None:
        raise ValueError(data)

    meter = Meter(stream=True, reader=Events(read))
    meter.feed(b"data: x\n\n")
    assert meter.cost is None and isinstance(meter.failure, ValueError)


def test_hostile_streams_never_raise() -> None:
    for body in (b"data: {not json _tokens}\n\n", b"data: [1, \"_tokens\"]\n\n",
                 b"\xff\xfe data: \x00\n\n", b'data: {"type":"message_start","message":5,'
                 b'"x":"_tokens"}\n\n'):
        meter = Meter(stream=True)
        meter.feed(body)
        meter.end()
        assert meter.cost is None


def test_the_pause_a_429_asks_for() -> None:
    now = 1_800_000_000.0
    assert pause_of(429, {"retry-after": "2"}, now) == 2.0
    assert pause_of(429, {"retry-after-ms": "1500"}, now) == 1.5
    date = email.utils.formatdate(now + 30, usegmt=True)
    assert pause_of(429, {"retry-after": date}, now) == 30.0
    assert pause_of(429, {}, now) is None  # for how long? it does not say: no pause
    assert pause_of(429, {"retry-after": "soon"}, now) is None
    assert pause_of(429, {"retry-after": "-3"}, now) is None
    assert pause_of(503, {"retry-after": "2"}, now) is None  # not a rate limit
    assert pause_of(429, {"retry-after": "99999999"}, now) == 3600.0  # an hour at most


def test_the_pause_a_spent_ratelimit_field_asks_for() -> None:
    assert pause_of(200, {"ratelimit": "limit=10, remaining=0, reset=5"}) == 5.0
    assert pause_of(200, {"ratelimit": '"default";r=0;t=7'}) == 7.0
    assert pause_of(200, {"ratelimit-remaining": "0", "ratelimit-reset": "4"}) == 4.0
    assert pause_of(200, {"ratelimit": "limit=10, remaining=0, reset=5",
                          "retry-after": "9"}) == 9.0
    assert pause_of(200, {"ratelimit": "limit=10, remaining=3, reset=5"}) is None
    assert pause_of(200, {"ratelimit-remaining": "x"}) is None
