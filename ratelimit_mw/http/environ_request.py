"""The request a plain WSGI app's key functions receive when werkzeug is not installed.

A Django, Falcon or bare-WSGI deployment has no werkzeug; the plain WSGI middleware needs
nothing but the standard library, so it hands key functions and hooks this read-only view of
``environ`` instead: the attributes a key function reads (``environ``, ``method``, ``path``,
``headers``, ``args``, ``cookies``, ``remote_addr``), spelled and behaving as werkzeug's do.
With werkzeug installed the middleware hands werkzeug's ``Request`` as before.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from functools import cached_property
from http.cookies import CookieError, SimpleCookie
from typing import Any
from urllib.parse import parse_qsl

__all__ = ["EnvironHeaders", "EnvironRequest"]

# The two request headers CGI does not prefix with HTTP_.
_UNPREFIXED = {"CONTENT_TYPE": "Content-Type", "CONTENT_LENGTH": "Content-Length"}


def _latin1_to_text(value: str) -> str:
    """PEP 3333 hands bytes over as latin-1 text; clients send UTF-8."""
    if value.isascii():
        return value
    return value.encode("latin-1", "replace").decode("utf-8", "replace")


class EnvironHeaders(Mapping[str, str]):
    """The request headers in ``environ``, looked up case-insensitively by their HTTP name
    (``headers.get("X-Api-Key")``); several lines of one header arrive joined by the server."""

    __slots__ = ("_environ",)

    def __init__(self, environ: Mapping[str, Any]) -> None:
        self._environ = environ

    @staticmethod
    def _cgi_name(name: str) -> str:
        upper = name.upper().replace("-", "_")
        return upper if upper in _UNPREFIXED else "HTTP_" + upper

    def __getitem__(self, name: str) -> str:
        if not isinstance(name, str):
            raise KeyError(name)
        value = self._environ[self._cgi_name(name)]
        return value if isinstance(value, str) else str(value)

    def __iter__(self) -> Iterator[str]:
        for key in self._environ:
            if key in _UNPREFIXED:
                yield _UNPREFIXED[key]
            elif key.startswith("HTTP_"):
                yield key[5:].replace("_", "-").title()

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._cgi_name(name) in self._environ

    def __repr__(self) -> str:
        return f"EnvironHeaders({dict(self)!r})"


class EnvironRequest:
    """A read-only view of one WSGI ``environ``; each attribute is worked out when first read
    (most key functions read ``environ`` alone: ``keys.client_ip()`` does)."""

    def __init__(self, environ: dict[str, Any]) -> None:
        self.environ = environ

    @cached_property
    def method(self) -> str:
        return str(self.environ.get("REQUEST_METHOD", "GET")).upper()

    @cached_property
    def path(self) -> str:
        script = _latin1_to_text(str(self.environ.get("SCRIPT_NAME", "")))
        return script.rstrip("/") + "/" + _latin1_to_text(
            str(self.environ.get("PATH_INFO", ""))).lstrip("/")

    @cached_property
    def query_string(self) -> bytes:
        return str(self.environ.get("QUERY_STRING", "")).encode("latin-1", "replace")

    @cached_property
    def args(self) -> dict[str, str]:
        """The query arguments, the first value of each (as werkzeug's ``args.get``)."""
        found: dict[str, str] = {}
        text = _latin1_to_text(str(self.environ.get("QUERY_STRING", "")))
        for name, value in parse_qsl(text, keep_blank_values=True):
            found.setdefault(name, value)
        return found

    @cached_property
    def headers(self) -> EnvironHeaders:
        return EnvironHeaders(self.environ)

    @cached_property
    def cookies(self) -> dict[str, str]:
        cookie = SimpleCookie()
        try:
            cookie.load(str(self.environ.get("HTTP_COOKIE", "")))
        except CookieError:  # a malformed header: no cookies, never an exception
            return {}
        return {name: morsel.value for name, morsel in cookie.items()}

    @cached_property
    def remote_addr(self) -> str | None:
        value = self.environ.get("REMOTE_ADDR")
        return value if isinstance(value, str) else None

    def __repr__(self) -> str:
        return f"<EnvironRequest {self.method} {self.path!r}>"
