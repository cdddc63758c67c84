"""The openai and anthropic SDKs, as people write them today (on httpx2), through the
transports of `ratelimit_mw.httpx2`: each call charges an estimate, and settles what the
answer says it used, from a JSON body or from the stream's events as the SDK reads them.

The provider is `_fake_llm.FakeLLM`, an httpx2.MockTransport handler wrapped by the transport;
the limiter sleeps on the fake clock, so waits cost no real time.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("httpx2")  # Python 3.11+ (the test extra installs it there)

import anthropic
import httpx2
import openai

import ratelimit_mw as rl
from ratelimit_mw.httpx2 import AsyncRateLimitTransport, Events, RateLimitTransport

from ._fake_llm import FakeLLM

TOKENS = rl.Policy("100000/minute", name="tokens")
CALLS = rl.Policy("500/minute", name="calls")
ESTIMATE = 1000
LIMIT = TOKENS.rates[0].limit
MESSAGES = [{"role": "user", "content": "hi"}]


def fake() -> FakeLLM:
    draws = itertools.cycle([(120, 30), (700, 900), (5, 0), (40, 2500)])
    return FakeLLM(lambda: next(draws))


def transport(limiter: Any, provider: FakeLLM, **options: Any) -> Any:
    kind = AsyncRateLimitTransport if isinstance(limiter, rl.AsyncLimiter) else \
        RateLimitTransport
    return kind(limiter, TOKENS, key="llm", cost=ESTIMATE, calls=CALLS, settle="usage",
                wrapped=httpx2.MockTransport(provider), **options)


def openai_client(limiter: rl.Limiter, provider: FakeLLM, **options: Any) -> openai.OpenAI:
    return openai.OpenAI(api_key="k", base_url="https://api.openai.test/v1", max_retries=0,
                         http_client=httpx2.Client(
                             transport=transport(limiter, provider, **options)))


def anthropic_client(limiter: rl.Limiter, provider: FakeLLM,
                     **options: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key="k", base_url="https://api.anthropic.test",
                               max_retries=0, http_client=httpx2.Client(
                                   transport=transport(limiter, provider, **options)))


def left(limiter: rl.Limiter) -> int:
    return limiter.peek(TOKENS, "llm").remaining


def test_openai_calls_settle_what_they_used_plain_and_streamed(limiter: rl.Limiter) -> None:
    provider = fake()
    client = openai_client(limiter, provider)
    answer = client.chat.completions.create(model="gpt-test", messages=MESSAGES)  # type: ignore[arg-type]
    assert answer.usage is not None and answer.usage.total_tokens == 150
    chunks = list(client.chat.completions.create(
        model="gpt-test", messages=MESSAGES, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 1600
    assert provider.used == 1750
    assert left(limiter) == LIMIT - 1750  # charged what was used, not 2 x the estimate
    assert limiter.peek(CALLS, "llm").remaining == 498


def test_anthropic_calls_settle_input_plus_output_plain_and_streamed(
        limiter: rl.Limiter) -> None:
    provider = fake()
    client = anthropic_client(limiter, provider)
    message = client.messages.create(model="claude-test", max_tokens=10, messages=MESSAGES)  # type: ignore[arg-type]
    assert message.usage.input_tokens + message.usage.output_tokens == 150
    with client.messages.stream(model="claude-test", max_tokens=10,
                                messages=MESSAGES) as stream:  # type: ignore[arg-type]
        assert stream.get_final_text() == "hello"
    assert provider.used == 1750
    assert left(limiter) == LIMIT - 1750


async def test_the_async_sdks_settle_alike(alimiter: rl.AsyncLimiter) -> None:
    provider = fake()
    http = httpx2.AsyncClient(transport=transport(alimiter, provider))
    oa = openai.AsyncOpenAI(api_key="k", base_url="https://api.openai.test/v1",
                            max_retries=0, http_client=http)
    await oa.chat.completions.create(model="gpt-test", messages=MESSAGES)  # type: ignore[arg-type]
    stream = await oa.chat.completions.create(
        model="gpt-test", messages=MESSAGES, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True})
    async for _ in stream:
        pass
    ant = anthropic.AsyncAnthropic(api_key="k", base_url="https://api.anthropic.test",
                                   max_retries=0, http_client=http)
    await ant.messages.create(model="claude-test", max_tokens=10, messages=MESSAGES)  # type: ignore[arg-type]
    async with ant.messages.stream(model="claude-test", max_tokens=10,
                                   messages=MESSAGES) as events:  # type: ignore[arg-type]
        await events.get_final_message()
    assert provider.used == 150 + 1600 + 5 + 2540
    assert (await alimiter.peek(TOKENS, "llm")).remaining == LIMIT - provider.used


def test_a_stream_is_read_as_it_passes_not_before(limiter: rl.Limiter) -> None:
    provider = fake()
    client = openai_client(limiter, provider)
    stream = client.chat.completions.create(
        model="gpt-test", messages=MESSAGES, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True})
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    body = provider.bodies[0]
    assert body.sent < len(body.chunks)  # the transport has not read ahead
    assert left(limiter) == LIMIT - ESTIMATE  # not settled before the stream ends
    for _ in stream:
        pass
    assert left(limiter) == LIMIT - 150


def test_a_stream_closed_half_way_keeps_its_estimate_or_what_it_said(
        limiter: rl.Limiter) -> None:
    provider = fake()
    client = anthropic_client(limiter, provider)
    with client.messages.stream(model="claude-test", max_tokens=10,
                                messages=MESSAGES) as stream:  # type: ignore[arg-type]
        next(iter(stream))  # message_start only: 120 input tokens
    assert left(limiter) == LIMIT - ESTIMATE
    client = anthropic_client(limiter, provider, abandoned="seen")
    with client.messages.stream(model="claude-test", max_tokens=10,
                                messages=MESSAGES) as stream:  # type: ignore[arg-type]
        next(iter(stream))  # 700 input tokens, and the 1 output token of message_start
    assert left(limiter) == LIMIT - ESTIMATE - 701


def test_an_openai_stream_without_usage_keeps_its_estimate(limiter: rl.Limiter,
                                                           caplog: Any) -> None:
    client = openai_client(limiter, fake())
    for _ in client.chat.completions.create(model="gpt-test", messages=MESSAGES,  # type: ignore[arg-type]
                                            stream=True):
        pass
    assert left(limiter) == LIMIT - ESTIMATE
    assert "said nothing of its usage" in caplog.text


def test_the_providers_refusals_cost_nothing(limiter: rl.Limiter) -> None:
    provider = fake()
    provider.refuse = [(500, {}), (400, {}), (429, {"retry-after": "1"})]
    client = openai_client(limiter, provider)
    for error in (openai.InternalServerError, openai.BadRequestError, openai.RateLimitError):
        with pytest.raises(error):
            client.chat.completions.create(model="gpt-test", messages=MESSAGES)  # type: ignore[arg-type]
    assert left(limiter) == LIMIT  # no tokens used, none charged
    assert limiter.peek(CALLS, "llm").remaining == 497  # the requests were made


def test_a_429_pauses_the_key_for_every_process_until_its_retry_after(
        limiter: rl.Limiter, clock: Any) -> None:
    provider = fake()
    provider.refuse = [(429, {"retry-after": "2"})]
    client = openai_client(limiter, provider)
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model="gpt-test", messages=MESSAGES)  # type: ignore[arg-type]
    # Another process (another transport on the same store) waits the pause out, unsent.
    other = RateLimitTransport(limiter, TOKENS, key="llm", cost=ESTIMATE, settle="usage",
                               timeout=0, wrapped=httpx2.MockTransport(provider))
    with httpx2.Client(transport=other) as http, pytest.raises(rl.RateLimitExceeded) as info:
        http.post("https://api.openai.test/v1/chat/completions", json={})
    assert info.value.retry_after == 2.0 and len(provider.answers) == 1
    started = clock.now
    client.chat.completions.create(model="gpt-test", messages=MESSAGES)  # type: ignore[arg-type]
    assert clock.now - started >= 2.0  # waited for the pause, then sent
    assert len(provider.answers) == 2


def test_on_429_raise_and_pass(limiter: rl.Limiter) -> None:
    provider = fake()
    provider.refuse = [(429, {"retry-after-ms": "1500"}), (429, {"retry-after": "5"})]
    raising = RateLimitTransport(limiter, TOKENS, key="llm", settle="usage", on_429="raise",
                                 timeout=0, wrapped=httpx2.MockTransport(provider))
    with httpx2.Client(transport=raising) as http, pytest.raises(rl.RateLimitExceeded) as info:
        http.post("https://api.openai.test/v1/chat/completions", json={})
    assert info.value.retry_after == 1.5
    assert limiter.peek(TOKENS, "llm").retry_after == 0  # the plain policy reads no pause
    limiter.reset(TOKENS, "llm")  # the pause ends with the counters (its ban key goes too)
    limiter.reset(rl.Policy("100000/minute", name="tokens", penalty=lambda: None), "llm")
    passing = RateLimitTransport(limiter, TOKENS, key="llm", settle="usage", on_429="pass",
                                 timeout=0, wrapped=httpx2.MockTransport(provider))
    with httpx2.Client(transport=passing) as http:
        assert http.post("https://x.test/v1/chat/completions", json={}).status_code == 429
        # Nothing paused: the next call is sent at once.
        assert http.post("https://x.test/v1/chat/completions", json={}).status_code == 200


def test_a_ratelimit_field_with_nothing_left_pauses_too(limiter: rl.Limiter) -> None:
    provider = fake()
    answers = iter([httpx2.Response(200, json={"usage": {"total_tokens": 7}},
                                    headers={"ratelimit": "limit=10, remaining=0, reset=3"})])
    first = RateLimitTransport(limiter, TOKENS, key="llm", settle="usage",
                               wrapped=httpx2.MockTransport(lambda r: next(answers)))
    with httpx2.Client(transport=first) as http:
        assert http.get("https://x.test/").status_code == 200
    second = RateLimitTransport(limiter, TOKENS, key="llm", settle="usage", timeout=0,
                                wrapped=httpx2.MockTransport(provider))
    with httpx2.Client(transport=second) as http, pytest.raises(rl.RateLimitExceeded) as info:
        http.get("https://x.test/")
    assert info.value.retry_after == 3.0


def test_other_formats_settle_with_a_reader_of_events(limiter: rl.Limiter) -> None:
    def body(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": "text/event-stream"},
                               content=b"event: tick\ndata: 5\n\nevent: cost\ndata: 42\n\n")

    def read(event: str, data: str) -> int | None:
        return int(data) if event == "cost" else None

    transport = RateLimitTransport(limiter, TOKENS, key="llm", cost=ESTIMATE,
                                   settle=Events(read), wrapped=httpx2.MockTransport(body))
    with httpx2.Client(transport=transport) as http, \
            http.stream("GET", "https://x.test/") as response:
        assert b"".join(response.iter_bytes()).endswith(b"42\n\n")
    assert left(limiter) == LIMIT - 42


def test_a_settle_callable_may_return_none(limiter: rl.Limiter) -> None:
    def settle(response: httpx2.Response) -> int | None:  # typed as the docs say
        return response.json().get("tokens")  # type: ignore[no-any-return]

    transport = RateLimitTransport(
        limiter, TOKENS, key="llm", cost=ESTIMATE, settle=settle,
        wrapped=httpx2.MockTransport(lambda r: httpx2.Response(200, json={})))
    with httpx2.Client(transport=transport) as http:
        http.get("https://x.test/")
    assert left(limiter) == LIMIT - ESTIMATE


def test_the_documented_types_pass_mypy_strict(tmp_path: Path) -> None:
    """settle= returning int | None, the exported Ticket, a refusal's retry_after, on_429's
    choices: as the docs write them, for httpx2."""
    snippet = tmp_path / "snippet.py"
    snippet.write_text(
        "import httpx2\nimport ratelimit_mw as rl\n"
        "from ratelimit_mw.httpx2 import RateLimitTransport\n"
        "def settle(response: httpx2.Response) -> int | None:\n"
        "    return None\n"
        "limiter = rl.Limiter()\n"
        "RateLimitTransport(limiter, '90000/minute', key='openai', settle=settle)\n"
        "RateLimitTransport(limiter, '90000/minute', key='openai', settle='usage')\n"
        "ticket: rl.Ticket = limiter.charge(rl.Policy('10/minute'), 'k', 1)\n"
        "def wait(exc: rl.RateLimitExceeded) -> float:\n"
        "    return exc.retry_after\n"
        "RateLimitTransport(limiter, '1/second', on_429='ignore')\n")
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental",
         "--cache-dir", str(tmp_path / "cache"), str(snippet)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert result.returncode == 1, result.stdout
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and "snippet.py:12: error" in errors[0], result.stdout


def test_the_httpx2_module_needs_no_httpx() -> None:
    """With httpx2 installed and httpx absent (what the SDKs install), the transport imports
    and serves. (Checked once in a fresh venv too: pip install 'ratelimit_mw[httpx2]'.)"""
    code = (
        "import sys, importlib.abc\n"
        "class NoHttpx(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'httpx' or name.startswith('httpx.'):\n"
        "            raise ImportError('no httpx here')\n"
        "sys.meta_path.insert(0, NoHttpx())\n"
        "import httpx2, ratelimit_mw as rl\n"
        "from ratelimit_mw.httpx2 import RateLimitTransport\n"
        "answer = lambda r: httpx2.Response(200, json={'usage': {'total_tokens': 42}})\n"
        "limiter = rl.Limiter()\n"
        "t = RateLimitTransport(limiter, '1000/minute', key='k', cost=100, settle='usage',\n"
        "                       wrapped=httpx2.MockTransport(answer))\n"
        "httpx2.Client(transport=t).post('https://x.test/')\n"
        "assert 'httpx' not in sys.modules\n"
        "print(limiter.peek('1000/minute', 'k').remaining)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.strip() == "958", result.stderr


def test_wait_out_waits_the_timeout_before_raising(limiter: rl.Limiter, clock: Any) -> None:
    limiter.pause(TOKENS, "llm", 5)
    provider = fake()
    transport = RateLimitTransport(limiter, TOKENS, key="llm", settle="usage", timeout=1,
                                   wait_out=True, wrapped=httpx2.MockTransport(provider))
    started = clock.now
    with httpx2.Client(transport=transport) as http, pytest.raises(rl.RateLimitExceeded) as info:
        http.post("https://api.openai.test/v1/chat/completions", json={})
    assert clock.now - started == pytest.approx(1.0)  # waited the timeout, then refused
    assert info.value.retry_after == pytest.approx(4.0) and provider.answers == []
