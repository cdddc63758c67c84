"""In-flight limits under the WSGI middleware and the Flask extension: a slot is held while
the response body is read, given back when the server closes it (PEP 3333: also when the
client went away or the body raised) or when the app raises, and renewed as a long body is
read; on memory and the real Redis (`limiter`, on the test clock)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from flask import Flask, Response, stream_with_context

import ratelimit_mw as rl
from ratelimit_mw.flask import RateLimit
from ratelimit_mw.wsgi import RateLimitMiddleware


@pytest.fixture(autouse=True)
def _swept(prefix: str, redis_client: Any) -> Iterator[None]:
    yield
    for key in redis_client.scan_iter(f"{prefix}:*"):
        redis_client.delete(key)


def environ(path: str = "/") -> dict[str, Any]:
    return {"REQUEST_METHOD": "GET", "PATH_INFO": path, "REMOTE_ADDR": "10.0.0.1",
            "wsgi.url_scheme": "http", "SERVER_NAME": "t", "SERVER_PORT": "80"}


class Started:
    def __init__(self) -> None:
        self.status = ""

    def __call__(self, status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        self.status = status
        self.headers = dict(headers)
        return lambda data: None


def served(app: Any, path: str = "/") -> tuple[Started, Any]:
    """Start a response; its body is left for the caller to read and close."""
    start = Started()
    body = app(environ(path), start)
    return start, body


def whole(app: Any, path: str = "/") -> str:
    start, body = served(app, path)
    try:
        b"".join(body)
    finally:
        getattr(body, "close", lambda: None)()
    return start.status[:3]


def test_a_body_being_read_holds_its_slot_until_closed(limiter: rl.Limiter) -> None:
    def app(environ: dict[str, Any], start_response: Any) -> Any:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return iter([b"a", b"b", b"c"])

    wrapped = RateLimitMiddleware(app, limiter, default="100/minute", concurrency=1)
    start, body = served(wrapped)
    chunks = iter(body)
    assert next(chunks) == b"a"
    assert whole(wrapped) == "429"  # the client went away half way, say: the server closes
    body.close()
    assert whole(wrapped) == "200"
    start, body = served(wrapped)
    assert start.headers["RateLimit"] == '"minute";r=97;t=60'  # the 429 charged nothing
    body.close()


def test_an_app_or_a_body_that_raises_gives_its_slot_back(limiter: rl.Limiter) -> None:
    def raising(environ: dict[str, Any], start_response: Any) -> Any:
        raise RuntimeError("boom")

    def breaking(environ: dict[str, Any], start_response: Any) -> Any:
        start_response("200 OK", [])
        yield b"half"
        raise RuntimeError("boom")

    for app in (raising, breaking):
        wrapped = RateLimitMiddleware(app, limiter, concurrency=1)
        for _ in range(3):
            with pytest.raises(RuntimeError):
                whole(wrapped)


def test_a_long_body_renews_its_lease(limiter: rl.Limiter, clock: Any) -> None:
    seen: list[str] = []

    def app(environ: dict[str, Any], start_response: Any) -> Any:
        start_response("200 OK", [])
        for _ in range(6):  # 9 s of a 3 s lease
            clock.advance(1.5)
            yield b"x"
        seen.append(whole(wrapped, "/other"))

    def other(environ: dict[str, Any], start_response: Any) -> Any:
        if environ["PATH_INFO"] == "/other":
            start_response("200 OK", [])
            return [b""]
        return app(environ, start_response)

    wrapped = RateLimitMiddleware(other, limiter,
                                  concurrency=rl.Policy.in_flight(1, lease=3))
    assert whole(wrapped) == "200"
    assert seen == ["429"]


def test_flask_holds_a_streamed_slot_until_the_response_is_closed(limiter: rl.Limiter,
                                                                 clock: Any) -> None:
    app = Flask(__name__)
    app.testing = True
    ratelimit = RateLimit(app, limiter=limiter)

    @app.route("/export")
    @limiter.limit("10/minute", concurrency=rl.Policy.in_flight(1, lease=3))
    def export() -> Any:
        def rows() -> Iterator[str]:
            for n in range(6):
                clock.advance(1.5)
                yield f"{n}\n"

        return Response(stream_with_context(rows()))

    @app.route("/broken")
    @limiter.limit(concurrency=1)
    def broken() -> Any:
        raise RuntimeError("boom")

    client = app.test_client()
    first = client.get("/export", buffered=False)
    refused = client.get("/export", buffered=True)
    assert refused.status_code == 429
    assert refused.headers["RateLimit"] == '"in flight";r=0;t=1'
    assert b"".join(first.iter_encoded()) == b"0\n1\n2\n3\n4\n5\n"  # 9 s: renewed
    assert client.get("/export", buffered=True).status_code == 429
    first.close()
    assert client.get("/export", buffered=True).status_code == 200
    # Two admitted before, this one: the refusals took nothing of the 10/minute.
    assert client.get("/export", buffered=True).headers["RateLimit"] == '"minute";r=7;t=60'
    for _ in range(3):  # propagated to the test client: given back in teardown
        with pytest.raises(RuntimeError):
            client.get("/broken", buffered=True)
    app.testing = False
    assert [client.get("/broken", buffered=True).status_code for _ in range(3)] == [500] * 3
    assert ratelimit.limiter is limiter
