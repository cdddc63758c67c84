"""The httpx transports: outbound calls wait for their quota before they are sent.

The "provider" is an httpx.MockTransport that notes the fake clock's time of each call it
receives; the limiter sleeps on the same fake clock, so the waits cost no real time.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import httpx
import pytest

import ratelimit_mw as rl
from ratelimit_mw.httpx import AsyncRateLimitTransport, RateLimitTransport, host_key


class Provider:
    def __init__(self, clock: Any) -> None:
        self.clock = clock
        self.calls: list[tuple[str, float]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls.append((request.url.host, self.clock()))
        return httpx.Response(200, json={"ok": True})

    def most_in_one_second(self, host: str | None = None) -> int:
        times = sorted(t for h, t in self.calls if host is None or h == host)
        return max((sum(1 for u in times if t <= u < t + 1.0) for t in times), default=0)


def client(limiter: rl.Limiter, provider: Provider, **kwargs: Any) -> httpx.Client:
    transport = RateLimitTransport(limiter, kwargs.pop("policy", "5/second"),
                                   wrapped=httpx.MockTransport(provider), **kwargs)
    return httpx.Client(transport=transport)


def test_calls_to_one_host_are_paced_at_the_rate(limiter: rl.Limiter, clock: Any) -> None:
    provider = Provider(clock)
    with client(limiter, provider) as http:
        for n in range(17):
            assert http.get(f"https://api.example.com/charges/{n}").status_code == 200
    assert len(provider.calls) == 17
    assert provider.most_in_one_second() == 5
    assert clock.now - 1_800_000_000.0 >= 3.0  # 17 calls at 5/second: at least 3 s


def test_by_default_each_host_has_its_own_quota(limiter: rl.Limiter, clock: Any) -> None:
    provider = Provider(clock)
    with client(limiter, provider) as http:
        for _ in range(5):
            http.get("https://a.example.com/")
        for _ in range(5):
            http.get("https://b.example.com/")
    assert clock.now == 1_800_000_000.0  # nobody waited: 5 for each host


def test_a_string_key_puts_every_host_under_one_quota(limiter: rl.Limiter, clock: Any) -> None:
    provider = Provider(clock)
    with client(limiter, provider, key="payments") as http:
        for n in range(10):
            http.get(f"https://{'ab'[n % 2]}.payments.example/")
    assert clock.now - 1_800_000_000.0 >= 1.0
    assert provider.most_in_one_second() == 5


def test_a_key_function_returning_none_leaves_a_call_unthrottled(
    limiter: rl.Limiter, clock: Any
) -> None:
    provider = Provider(clock)

    def only_writes(request: httpx.Request) -> str | None:
        return None if request.method == "GET" else request.url.host

    with client(limiter, provider, key=only_writes, policy="1/minute") as http:
        for _ in range(20):
            http.get("https://api.example.com/")
        http.post("https://api.example.com/")
    assert len(provider.calls) == 21 and clock.now == 1_800_000_000.0


def test_a_call_that_would_wait_past_the_timeout_raises_without_being_sent(
    limiter: rl.Limiter, clock: Any
) -> None:
    provider = Provider(clock)
    with client(limiter, provider, policy="1/minute", timeout=5) as http:
        http.get("https://api.example.com/")
        with pytest.raises(rl.RateLimitExceeded) as caught:
            http.get("https://api.example.com/")
    assert caught.value.decision.retry_after == 60.0
    assert len(provider.calls) == 1


def test_cost_can_come_from_the_request(limiter: rl.Limiter, clock: Any) -> None:
    provider = Provider(clock)

    def batch_size(request: httpx.Request) -> int:
        return int(request.headers.get("x-batch", "1"))

    with client(limiter, provider, cost=batch_size, policy="10/second", timeout=0) as http:
        http.post("https://api.example.com/", headers={"x-batch": "8"})
        with pytest.raises(rl.RateLimitExceeded):
            http.post("https://api.example.com/", headers={"x-batch": "3"})
        http.post("https://api.example.com/", headers={"x-batch": "2"})


class DownBackend:
    is_cluster = False

    def run(self, call: Any, deadline: float | None = None) -> list[int]:
        raise rl.BackendError("Redis call failed: ConnectionError: refused")

    async def arun(self, call: Any, deadline: float | None = None) -> list[int]:
        return self.run(call)


def test_a_backend_failure_sends_unthrottled_or_raises_as_configured(clock: Any) -> None:
    provider = Provider(clock)
    limiter = rl.Limiter(DownBackend(), clock=clock)  # type: ignore[arg-type]
    with client(limiter, provider) as http:
        assert http.get("https://api.example.com/").status_code == 200
    with client(limiter, provider, on_backend_error="raise") as http, \
            pytest.raises(rl.BackendError):
        http.get("https://api.example.com/")
    assert len(provider.calls) == 1


async def test_async_transport_paces_calls_on_the_event_loop(
    alimiter: rl.AsyncLimiter, clock: Any
) -> None:
    provider = Provider(clock)
    transport = AsyncRateLimitTransport(alimiter, "5/second",
                                        wrapped=httpx.MockTransport(provider))
    async with httpx.AsyncClient(transport=transport) as http:
        for _ in range(12):
            assert (await http.get("https://api.example.com/")).status_code == 200
        transport_timeout = AsyncRateLimitTransport(
            alimiter, "5/second", timeout=0, wrapped=httpx.MockTransport(provider))
        async with httpx.AsyncClient(transport=transport_timeout) as strict:
            for _ in range(3):
                await strict.get("https://api.example.com/")
            with pytest.raises(rl.RateLimitExceeded):
                await strict.get("https://api.example.com/")
    assert provider.most_in_one_second() == 5
    assert clock.now - 1_800_000_000.0 >= 2.0


def test_the_default_key_is_the_host_with_a_non_default_port() -> None:
    assert host_key(httpx.Request("GET", "https://API.Example.com/x")) == "api.example.com"
    assert host_key(httpx.Request("GET", "https://api.example.com:443/x")) == "api.example.com"
    assert host_key(httpx.Request("GET", "http://localhost:8001/")) == "localhost:8001"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"limiter": rl.AsyncLimiter()}, "AsyncRateLimitTransport"),
        ({"policy": "10/fortnight"}, '"10/minute"'),
        ({"key": 42}, 'key="payments"'),
        ({"key": ""}, 'key="payments"'),
        ({"cost": 0}, "cost"),
        ({"timeout": -1}, "timeout=5"),
        ({"on_backend_error": "deny"}, '"raise"'),
    ],
)
def test_bad_options_are_configuration_errors(kwargs: dict[str, Any], match: str) -> None:
    args = {"limiter": rl.Limiter(), "policy": "5/second", **kwargs}
    with pytest.raises(rl.ConfigurationError, match=match):
        RateLimitTransport(args.pop("limiter"), args.pop("policy"), **args)


def test_the_async_transport_needs_an_async_limiter() -> None:
    with pytest.raises(rl.ConfigurationError, match=r"RateLimitTransport\(Limiter"):
        AsyncRateLimitTransport(rl.Limiter(), "5/second")  # type: ignore[arg-type]


def test_closing_the_client_closes_the_wrapped_transport() -> None:
    closed = []

    class Wrapped(httpx.BaseTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            return httpx.Response(204)

        def close(self) -> None:
            closed.append(True)

    with httpx.Client(transport=RateLimitTransport(rl.Limiter(), "5/second", wrapped=Wrapped())):
        pass
    assert closed == [True]


def test_without_httpx_the_import_error_says_what_to_install() -> None:
    code = (
        "import sys; sys.modules['httpx'] = None\n"
        "try:\n    import ratelimit_mw.httpx\n"
        "except ImportError as exc:\n    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert "pip install 'ratelimit_mw[httpx]'" in out


class LLM:
    """A fake LLM API: each answer says how many tokens it used (`usage.total_tokens`)."""

    def __init__(self, used: list[int]) -> None:
        self.used = list(used)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if not self.used:
            return httpx.Response(500, text="no usage")
        return httpx.Response(200, json={"usage": {"total_tokens": self.used.pop(0)}})


def total_tokens(response: httpx.Response) -> int:
    return int(response.json()["usage"]["total_tokens"])


def test_the_actual_cost_is_settled_from_the_response(limiter: rl.Limiter) -> None:
    tokens, calls = rl.Policy("1000/minute", name="tokens"), rl.Policy("10/minute", name="calls")
    transport = RateLimitTransport(limiter, tokens, key="llm", cost=200, calls=calls,
                                   settle=total_tokens, wrapped=httpx.MockTransport(
                                       LLM([120, 310, 0])))
    with httpx.Client(transport=transport) as http:
        for _ in range(3):
            assert http.post("https://llm.example.com/v1/chat").status_code == 200
    assert limiter.peek(tokens, "llm").remaining == 1000 - 430  # what was used, not 3 x 200
    assert limiter.peek(calls, "llm").remaining == 7


def test_a_refusal_that_cannot_say_costs_nothing_unless_told(limiter: rl.Limiter,
                                                             caplog: Any) -> None:
    tokens = rl.Policy("1000/minute", name="tokens")
    transport = RateLimitTransport(limiter, tokens, key="llm", cost=200, settle=total_tokens,
                                   wrapped=httpx.MockTransport(LLM([])))
    with httpx.Client(transport=transport) as http:
        assert http.post("https://llm.example.com/v1/chat").status_code == 500
    assert limiter.peek(tokens, "llm").remaining == 1000  # a 500 used no tokens
    assert "the estimate stays charged" not in caplog.text
    transport = RateLimitTransport(limiter, tokens, key="llm", cost=200, settle=total_tokens,
                                   refusals="estimate", wrapped=httpx.MockTransport(LLM([])))
    with httpx.Client(transport=transport) as http:
        assert http.post("https://llm.example.com/v1/chat").status_code == 500
    assert limiter.peek(tokens, "llm").remaining == 800


def test_an_answer_that_cannot_say_keeps_its_estimate(limiter: rl.Limiter,
                                                      caplog: Any) -> None:
    tokens = rl.Policy("1000/minute", name="tokens")
    transport = RateLimitTransport(
        limiter, tokens, key="llm", cost=200, settle=total_tokens,
        wrapped=httpx.MockTransport(lambda request: httpx.Response(200, json={})))
    with httpx.Client(transport=transport) as http:
        assert http.post("https://llm.example.com/v1/chat").status_code == 200
    assert limiter.peek(tokens, "llm").remaining == 800
    assert "the estimate stays charged" in caplog.text


def test_settle_must_be_a_function_of_the_response(limiter: rl.Limiter) -> None:
    with pytest.raises(rl.ConfigurationError, match='settle is "usage"'):
        RateLimitTransport(limiter, "10/minute", settle=5)  # type: ignore[arg-type]


async def test_the_async_transport_settles_alike(alimiter: rl.AsyncLimiter) -> None:
    tokens = rl.Policy("1000/minute", name="tokens")
    transport = AsyncRateLimitTransport(alimiter, tokens, key="llm", cost=200,
                                        settle=total_tokens,
                                        wrapped=httpx.MockTransport(LLM([50, 650])))
    async with httpx.AsyncClient(transport=transport) as http:
        for _ in range(2):
            response = await http.post("https://llm.example.com/v1/chat")
            assert response.json()["usage"]["total_tokens"] in (50, 650)
    assert (await alimiter.peek(tokens, "llm")).remaining == 300


def ok(request: httpx.Request) -> httpx.Response:
    """A streamed body (as a real server's): open until it is read and closed."""
    return httpx.Response(200, content=iter([b"chunk"] * 3))


def test_concurrency_holds_a_slot_until_the_response_is_closed(limiter: rl.Limiter) -> None:
    transport = RateLimitTransport(limiter, "100/minute", key="vendor", concurrency=2,
                                   timeout=0, wrapped=httpx.MockTransport(ok))
    with httpx.Client(transport=transport) as http:
        first = http.send(http.build_request("GET", "https://v.example.com/"), stream=True)
        second = http.send(http.build_request("GET", "https://v.example.com/"), stream=True)
        with pytest.raises(rl.RateLimitExceeded) as refused:
            http.get("https://v.example.com/")
        assert refused.value.decision.policy is transport.concurrency
        first.read()
        first.close()  # the slot comes back
        assert http.get("https://v.example.com/").status_code == 200  # read and closed
        second.close()
    assert limiter.peek(transport.concurrency, "vendor").remaining == 2
    assert limiter.peek("100/minute", "vendor").remaining == 97  # the refused call: nothing


def test_a_request_that_fails_gives_its_slot_back(limiter: rl.Limiter) -> None:
    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    transport = RateLimitTransport(limiter, "100/minute", key="vendor", concurrency=1,
                                   wrapped=httpx.MockTransport(down))
    with httpx.Client(transport=transport) as http:
        for _ in range(2):
            with pytest.raises(httpx.ConnectError):
                http.get("https://v.example.com/")
    assert limiter.peek(transport.concurrency, "vendor").remaining == 1


def test_a_long_body_renews_the_lease_while_it_is_read(
    limiter: rl.Limiter, clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ratelimit_mw._sync.transport as module

    ticks = iter(range(0, 10_000, 25))  # the transport's clock: 25 s a look
    monkeypatch.setattr(module.time, "monotonic", lambda: float(next(ticks)))

    def slow(request: httpx.Request) -> httpx.Response:
        def body() -> Any:
            for _ in range(4):
                clock.advance(25)  # the store's clock: 100 s in all, past the 60 s lease
                yield b"chunk"
        return httpx.Response(200, content=body())

    transport = RateLimitTransport(limiter, "100/minute", key="vendor", concurrency=1,
                                   timeout=0, wrapped=httpx.MockTransport(slow))
    other = RateLimitTransport(limiter, "100/minute", key="vendor", concurrency=1,
                               timeout=0, wrapped=httpx.MockTransport(ok))
    with httpx.Client(transport=transport) as http, httpx.Client(transport=other) as second:
        with http.stream("GET", "https://v.example.com/") as response:
            for n, _ in enumerate(response.iter_bytes(), 1):
                if n == 3:  # 75 s in: held still, its lease renewed
                    with pytest.raises(rl.RateLimitExceeded):
                        second.get("https://v.example.com/")
        # Read to its end, the response is closed: the slot is back.
        assert second.get("https://v.example.com/").status_code == 200


async def test_the_async_transport_holds_and_gives_back_alike(
    alimiter: rl.AsyncLimiter,
) -> None:
    async def chunks() -> Any:
        for _ in range(3):
            yield b"chunk"

    def aok(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=chunks())

    transport = AsyncRateLimitTransport(alimiter, "100/minute", key="vendor", concurrency=1,
                                        timeout=0, wrapped=httpx.MockTransport(aok))
    async with httpx.AsyncClient(transport=transport) as http:
        request = http.build_request("GET", "https://v.example.com/")
        held = await http.send(request, stream=True)
        with pytest.raises(rl.RateLimitExceeded):
            await http.get("https://v.example.com/")
        await held.aclose()
        assert (await http.get("https://v.example.com/")).status_code == 200
    assert transport.concurrency is not None
    assert (await alimiter.peek(transport.concurrency, "vendor")).remaining == 1


def test_concurrency_must_be_slots_or_an_in_flight_policy(limiter: rl.Limiter) -> None:
    with pytest.raises(rl.ConfigurationError, match="in_flight"):
        RateLimitTransport(limiter, "10/minute", concurrency=rl.Policy("5/minute"))


def test_settle_usage_reads_a_stream_through_httpx_as_well(limiter: rl.Limiter) -> None:
    pytest.importorskip("httpx2")  # the fake provider's module builds httpx2 streams
    from ._fake_llm import openai_stream

    body = b"".join(openai_stream(70, 30, include_usage=True))
    tokens = rl.Policy("1000/minute", name="tokens")
    transport = RateLimitTransport(limiter, tokens, key="llm", cost=200, settle="usage",
                                   wrapped=httpx.MockTransport(lambda request: httpx.Response(
                                       200, headers={"content-type": "text/event-stream"},
                                       stream=httpx.ByteStream(body))))
    with httpx.Client(transport=transport) as http, \
            http.stream("POST", "https://llm.example.com/v1/chat") as response:
        assert limiter.peek(tokens, "llm").remaining == 800  # the estimate, until it ends
        assert b"[DONE]" in response.read()
    assert limiter.peek(tokens, "llm").remaining == 900
