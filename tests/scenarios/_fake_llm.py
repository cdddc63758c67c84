"""A fake LLM provider speaking OpenAI's and Anthropic's wire formats, for the SDK tests and
the fleet proof: chat completions and messages, as JSON or as server-sent events (each event
its own chunk, and some events split across two), with the usage each format carries.

`FakeLLM(usage)` is an httpx2/httpx MockTransport handler (``usage()`` draws each answer's
(input, output) tokens); `answers` lists what it answered, `refuse` queues statuses (429 with
Retry-After, 500) for the next calls.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx2


class Chunks(httpx2.SyncByteStream, httpx2.AsyncByteStream):
    """A body sent as these chunks, sync or async (as a server's stream arrives)."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.sent = 0

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.chunks:
            self.sent += 1
            yield chunk

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            self.sent += 1
            yield chunk


def _sse(events: list[tuple[str | None, Any]]) -> list[bytes]:
    """Each event as one chunk, but every third one split in the middle of its data."""
    chunks: list[bytes] = []
    for i, (name, data) in enumerate(events):
        text = (f"event: {name}\n" if name else "") + "data: " + (
            data if isinstance(data, str) else json.dumps(data)) + "\n\n"
        raw = text.encode()
        if i % 3 == 2:
            chunks += [raw[: len(raw) // 2], raw[len(raw) // 2:]]
        else:
            chunks.append(raw)
    return chunks


def openai_json(tokens_in: int, tokens_out: int) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "gpt-test",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "hello"}}],
            "usage": {"prompt_tokens": tokens_in, "completion_tokens": tokens_out,
                      "total_tokens": tokens_in + tokens_out}}


def openai_stream(tokens_in: int, tokens_out: int, include_usage: bool) -> list[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0,
                "model": "gpt-test", "usage": None,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    events: list[tuple[str | None, Any]] = [
        (None, chunk({"role": "assistant", "content": ""}, None)),
        *[(None, chunk({"content": word}, None)) for word in ("he", "llo", " there")],
        (None, chunk({}, "stop")),
    ]
    if include_usage:
        events.append((None, {"id": "chatcmpl-1", "object": "chat.completion.chunk",
                              "created": 0, "model": "gpt-test", "choices": [],
                              "usage": {"prompt_tokens": tokens_in,
                                        "completion_tokens": tokens_out,
                                        "total_tokens": tokens_in + tokens_out}}))
    events.append((None, "[DONE]"))
    return _sse(events)


def anthropic_json(tokens_in: int, tokens_out: int) -> dict[str, Any]:
    return {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-test",
            "content": [{"type": "text", "text": "hello"}], "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": tokens_in, "output_tokens": tokens_out}}


def anthropic_stream(tokens_in: int, tokens_out: int) -> list[bytes]:
    start = {**anthropic_json(tokens_in, 1), "content": [], "stop_reason": None}
    return _sse([
        ("message_start", {"type": "message_start", "message": start}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
        *[("content_block_delta", {"type": "content_block_delta", "index": 0,
                                   "delta": {"type": "text_delta", "text": word}})
          for word in ("he", "llo")],
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta",
                           "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                           "usage": {"output_tokens": tokens_out}}),
        ("message_stop", {"type": "message_stop"}),
    ])


class FakeLLM:
    """The provider: answers /v1/chat/completions (OpenAI) and /v1/messages (Anthropic)."""

    def __init__(self, usage: Callable[[], tuple[int, int]]) -> None:
        self.usage = usage
        self.answers: list[tuple[int, int]] = []  # (status, tokens used)
        self.refuse: list[tuple[int, dict[str, str]]] = []
        self.bodies: list[Chunks] = []

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        if self.refuse:
            status, headers = self.refuse.pop(0)
            self.answers.append((status, 0))
            return httpx2.Response(status, headers=headers,
                                   json={"error": {"message": "no", "type": "x"}})
        body = json.loads(request.content)
        tokens_in, tokens_out = self.usage()
        self.answers.append((200, tokens_in + tokens_out))
        anthropic = request.url.path.endswith("/messages")
        if body.get("stream"):
            include = bool((body.get("stream_options") or {}).get("include_usage"))
            stream = Chunks(anthropic_stream(tokens_in, tokens_out) if anthropic
                            else openai_stream(tokens_in, tokens_out, include))
            self.bodies.append(stream)
            return httpx2.Response(200, headers={"content-type": "text/event-stream"},
                                   stream=stream)
        data = anthropic_json(tokens_in, tokens_out) if anthropic else openai_json(
            tokens_in, tokens_out)
        return httpx2.Response(200, json=data)

    @property
    def used(self) -> int:
        return sum(tokens for _, tokens in self.answers)
