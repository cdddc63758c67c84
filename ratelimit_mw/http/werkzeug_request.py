"""The werkzeug ``Request`` the plain WSGI middleware hands key functions when werkzeug is
installed, parsed only when an attribute that parsing sets is first read."""

from __future__ import annotations

from typing import Any

from werkzeug.wrappers import Request

__all__ = ["DeferredRequest"]


class DeferredRequest(Request):
    """A werkzeug ``Request`` parsed when an attribute ``Request.__init__`` sets is first
    read: most key functions read only ``environ`` (``keys.client_ip()`` does), so parsing
    every request would be wasted."""

    def __init__(self, environ: dict[str, Any]) -> None:  # parsing waits for _Parsed
        self.environ = environ
        # What Request(environ) does at once: werkzeug helpers find the request here.
        environ["werkzeug.request"] = self

    def _parse(self) -> None:
        own = dict(self.__dict__)  # whatever the app set on the request before it was parsed
        Request.__init__(self, own["environ"], populate_request=False)
        self.__dict__.update(own)


class _Parsed:
    """One attribute of `DeferredRequest`: reading it parses the request. A non-data
    descriptor, so that once parsing has put the value in the instance's ``__dict__`` reads
    no longer come here; not ``__getattr__``, which would turn every ``hasattr`` miss
    (keys.py's ASGI-or-WSGI test) into a raised exception."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, request: DeferredRequest | None, owner: type | None = None) -> Any:
        if request is None:
            return self
        request._parse()
        return request.__dict__[self.name]


# What Request.__init__ sets on the instance (environ is there from the start).
for _name in set(vars(Request({}, populate_request=False))) - {"environ"}:
    setattr(DeferredRequest, _name, _Parsed(_name))
del _name
