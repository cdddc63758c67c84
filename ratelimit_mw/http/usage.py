"""What an LLM provider's answer says it cost, and how long it asks us to stay away. No I/O.

- `usage_of(data)`: the tokens of a parsed JSON body or stream event: OpenAI's
  ``usage.total_tokens`` (chat completions; the Responses API's ``response.usage``),
  Anthropic's ``input_tokens + output_tokens``.
- `Meter`: reads a body as it passes, chunk by chunk: server-sent events parsed line by line
  (nothing buffered but the event being read), each event's data handed to a reader; a JSON
  body is one event. The built-in reader keeps the usage the events carry (OpenAI's last chunk
  under ``stream_options={"include_usage": True}``; Anthropic's ``message_start`` input and
  ``message_delta`` output); `Events` takes the user's own.
- `pause_of(status, headers)`: the seconds a 429 (or a RateLimit field with nothing left)
  asks every caller to wait: ``Retry-After`` (seconds or an HTTP date), OpenAI's
  ``retry-after-ms``, the IETF ``RateLimit``/``RateLimit-Reset`` reset; an hour at most.
"""

from __future__ import annotations

import email.utils
import json
import math
import re
import time
from collections.abc import Callable, Mapping

__all__ = ["Events", "Meter", "is_event_stream", "pause_of", "usage_of"]

# The fields of the IETF RateLimit header: draft 7's "limit=10, remaining=0, reset=5" and
# the later drafts' '"default";r=0;t=5'.
# The longest pause an answer can start: a Retry-After of days is a provider's bug (or a
# hostile answer), and would stop every process of the fleet for as long.
MAX_PAUSE = 3600.0
_FIELD = re.compile(r"\b(remaining|reset|r|t)\s*=\s*(\d+(?:\.\d+)?)", re.IGNORECASE)


def _whole(value: object) -> int | None:
    return value if type(value) is int and value >= 0 else None


def usage_of(data: object) -> int | None:
    """The tokens a parsed body or event says were used, or None when it says nothing."""
    if not isinstance(data, dict):
        return None
    usage = data.get("usage")
    if not isinstance(usage, dict):
        inner = data.get("response") or data.get("message")  # Responses API, Anthropic's
        usage = inner.get("usage") if isinstance(inner, dict) else None
        if not isinstance(usage, dict):
            return None
    total = _whole(usage.get("total_tokens"))
    if total is not None:
        return total
    parts = [_whole(usage.get(name)) for name in ("input_tokens", "output_tokens")]
    if parts == [None, None]:
        return None
    return sum(part or 0 for part in parts)


class Events:
    """``settle=Events(read)``: the cost of a response in another format, read as it
    passes. ``read(event, data)`` is called for each server-sent event (its name, "" when
    it has none, and its data text), or once with ("", body) for a body that is not a
    stream; the last whole number >= 0 it returns is the cost (None: it says nothing)."""

    __slots__ = ("read",)

    def __init__(self, read: Callable[[str, str], int | None]) -> None:
        self.read = read


class Meter:
    """One response's body as it passes: `feed` each chunk, `end` when it ended by itself;
    `cost` is what the events said (None: nothing). A stream of server-sent events is read
    event by event; anything else is kept whole (a JSON body) and read at its end."""

    __slots__ = ("_buffer", "_data", "_event", "_input", "_output", "_reader", "_total",
                 "cost", "ended", "failure", "stream")

    def __init__(self, stream: bool, reader: Events | None = None) -> None:
        self.stream = stream
        self._reader = reader
        self._buffer = b""
        self._event = ""
        self._data: list[str] = []
        self._total: int | None = None  # OpenAI's total
        self._input: int | None = None  # Anthropic's parts
        self._output: int | None = None
        self.cost: int | None = None
        self.ended = False
        self.failure: Exception | None = None  # what the user's reader raised, if anything

    def feed(self, chunk: bytes) -> None:
        if not self.stream:
            self._buffer += chunk
            return
        buffer = self._buffer + chunk if self._buffer else chunk
        start = 0
        while (stop := buffer.find(b"\n", start)) >= 0:
            self._line(buffer[start:stop].rstrip(b"\r"))
            start = stop + 1
        self._buffer = buffer[start:]

    def end(self) -> None:
        """The body was read to its end (a stream's last event need not end with a blank
        line)."""
        if self.stream:
            if self._buffer:
                self._line(self._buffer)
            self._line(b"")
        else:
            self._dispatch("", self._buffer.decode("utf-8", "replace"))
        self._buffer = b""
        self.ended = True

    def _line(self, line: bytes) -> None:
        if not line:
            if self._data:
                self._dispatch(self._event, "\n".join(self._data))
            self._event, self._data = "", []
        elif line.startswith(b"data:"):
            self._data.append(line[5:].removeprefix(b" ").decode("utf-8", "replace"))
        elif line.startswith(b"event:"):
            self._event = line[6:].strip().decode("utf-8", "replace")

    def _dispatch(self, event: str, data: str) -> None:
        if data == "[DONE]" or event == "message_stop":  # OpenAI's and Anthropic's last
            self.ended = True
        if self._reader is not None:
            try:
                found = self._reader.read(event, data)
            except Exception as exc:
                self.failure = exc
                return
            if _whole(found) is not None:
                self.cost = found
            return
        if "_tokens" not in data:  # most chunks carry no usage: not parsed at all
            return
        try:
            parsed = json.loads(data)
        except ValueError:
            return
        if not isinstance(parsed, dict):
            return
        kind = parsed.get("type")
        if kind in ("message_start", "message_delta"):  # Anthropic's stream
            holder = parsed.get("message") if kind == "message_start" else parsed
            usage = holder.get("usage") if isinstance(holder, dict) else None
            if isinstance(usage, dict):
                self._input = _whole(usage.get("input_tokens")) or self._input
                self._output = _whole(usage.get("output_tokens")) or self._output
        else:
            total = usage_of(parsed)
            if total is not None:
                self._total = total
        if self._total is not None:
            self.cost = self._total
        elif self._input is not None or self._output is not None:
            self.cost = (self._input or 0) + (self._output or 0)


def _seconds(text: str | None, now: float) -> float | None:
    """Retry-After: delay-seconds, or an HTTP date (from `now`, epoch seconds)."""
    if text is None:
        return None
    text = text.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            return None
        seconds = when.timestamp() - now
    return min(seconds, MAX_PAUSE) if 0 < seconds < math.inf else None


def pause_of(status: int, headers: Mapping[str, str], now: float | None = None) -> float | None:
    """How many seconds the provider asks every caller to stay away, or None.

    A 429 says so with ``Retry-After`` (or OpenAI's ``retry-after-ms``); any answer may say
    its quota is spent with a RateLimit field whose remaining is 0, and then its reset (or
    its Retry-After) is the pause. A 429 that does not say for how long pauses nothing."""
    now = time.time() if now is None else now
    seconds = _seconds(headers.get("retry-after"), now)
    if seconds is None and (ms := headers.get("retry-after-ms")) is not None:
        found = _seconds(ms, now)
        seconds = None if found is None else found / 1000
    if status == 429:
        return seconds
    remaining = reset = None
    for name in ("ratelimit", "ratelimit-remaining", "ratelimit-reset"):
        value = headers.get(name)
        if value is None:
            continue
        fields = {key.lower(): float(number) for key, number in _FIELD.findall(value)}
        if name == "ratelimit-remaining":
            fields = {"remaining": float(value)} if value.strip().isdigit() else {}
        elif name == "ratelimit-reset":
            fields = {"reset": float(value)} if value.strip().isdigit() else {}
        remaining = fields.get("remaining", fields.get("r", remaining))
        reset = fields.get("reset", fields.get("t", reset))
    if remaining != 0:
        return None
    if seconds is None and reset is not None and reset > 0:
        seconds = min(reset, MAX_PAUSE)
    return seconds


def is_event_stream(headers: Mapping[str, str]) -> bool:
    return headers.get("content-type", "").lower().startswith("text/event-stream")
