"""The plain WSGI middleware's request without werkzeug: what a key function reads, spelled
as werkzeug's, from any environ a server hands over (hostile ones included)."""

from __future__ import annotations

from typing import Any

import pytest

from ratelimit_mw.http.environ_request import EnvironHeaders, EnvironRequest

BASE: dict[str, Any] = {"REQUEST_METHOD": "GET", "PATH_INFO": "/a", "SCRIPT_NAME": "",
                        "QUERY_STRING": "", "REMOTE_ADDR": "10.0.0.1"}

CASES = [
    # (environ additions, attribute, expected)
    ({"HTTP_X_API_KEY": "k1"}, ("headers", "x-api-key"), "k1"),
    ({"HTTP_X_API_KEY": "k1"}, ("headers", "X-Api-Key"), "k1"),
    ({}, ("headers", "X-Api-Key"), None),
    ({"CONTENT_TYPE": "text/plain"}, ("headers", "content-type"), "text/plain"),
    ({"QUERY_STRING": "user=a&user=b&x="}, ("args", "user"), "a"),
    ({"QUERY_STRING": "x="}, ("args", "x"), ""),
    ({"QUERY_STRING": "%zz=%zz&&="}, ("args", "%zz"), "%zz"),
    ({"HTTP_COOKIE": "sid=abc; theme=dark"}, ("cookies", "sid"), "abc"),
    ({"HTTP_COOKIE": 'a="unterminated; b'}, ("cookies", "a"), None),
    ({"PATH_INFO": "/caf\xc3\xa9"}, ("path", None), "/café"),
    ({"SCRIPT_NAME": "/app/", "PATH_INFO": "/x"}, ("path", None), "/app/x"),
    ({"REQUEST_METHOD": "post"}, ("method", None), "POST"),
    ({"REMOTE_ADDR": None}, ("remote_addr", None), None),
    ({}, ("remote_addr", None), "10.0.0.1"),
]


@pytest.mark.parametrize(("extra", "where", "expected"), CASES)
def test_the_request_reads_what_werkzeug_would(extra: dict[str, Any],
                                               where: tuple[str, str | None],
                                               expected: object) -> None:
    request = EnvironRequest({**BASE, **extra})
    attribute, name = where
    value = getattr(request, attribute)
    assert (value if name is None else value.get(name)) == expected


def test_headers_list_what_the_environ_carries() -> None:
    headers = EnvironHeaders({**BASE, "HTTP_X_A": "1", "CONTENT_LENGTH": "3"})
    assert dict(headers) == {"X-A": "1", "Content-Length": "3"}
    assert "x-a" in headers and "X-B" not in headers and 5 not in headers
    assert len(headers) == 2
    with pytest.raises(KeyError):
        headers["x-b"]


def test_the_environ_is_read_not_copied() -> None:
    environ = dict(BASE)
    request = EnvironRequest(environ)
    assert request.environ is environ
    assert request.query_string == b""
