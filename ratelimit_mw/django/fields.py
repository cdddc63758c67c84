"""Keys from a Django request's form and query string: django-ratelimit's ``"post:X"`` and
``"get:X"``.

    @limit("5/minute", key=form_field("username"), methods=["POST"])
    def login(request): ...

A missing or empty value gives None, as ``keys.header`` does: the view's limit gives way to
the default (and `is_ratelimited` says "not limited"). ``required=True`` counts every such
request in one bucket instead, which is what django-ratelimit does with an empty value.
"""

from __future__ import annotations

from typing import Any

from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.keys import KeyFunc


class _Field:
    __slots__ = ("_attribute", "_label", "_missing", "_name", "_prefix", "reads")

    def __init__(self, attribute: str, label: str, name: str, required: bool) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigurationError(
                f"{label} needs the field's name, got {name!r}; write e.g. "
                f'{label}("username")')
        self._attribute = attribute  # "POST" or "GET"
        self._label = label
        self._name = name
        self._prefix = f"{attribute.lower()}:{name}:"
        # No colon after the name: no value can produce this identity.
        self._missing = f"{attribute.lower()}:{name}" if required else None
        self.reads = frozenset({"form" if attribute == "POST" else "query"})

    def __call__(self, request: Any) -> str | None:
        try:
            value = getattr(request, self._attribute).get(self._name)
        except Exception:  # a malformed body (MultiPartParserError, too big): no value
            value = None
        if not value or not isinstance(value, str):
            return self._missing
        return self._prefix + value

    def __repr__(self) -> str:
        required = ", required=True" if self._missing is not None else ""
        return f"{self._label}({self._name!r}{required})"


def form_field(name: str, *, required: bool = False) -> KeyFunc:
    """Key by a field of the POST form, ``request.POST[name]``: ``"post:<name>:<value>"``
    (django-ratelimit's ``key="post:<name>"``). Empty or missing: None, or with
    ``required=True`` one shared bucket, ``"post:<name>"``."""
    return _Field("POST", "form_field", name, required)


def query_param(name: str, *, required: bool = False) -> KeyFunc:
    """Key by a query-string parameter, ``request.GET[name]``: ``"get:<name>:<value>"``
    (django-ratelimit's ``key="get:<name>"``). Empty or missing: as `form_field`."""
    return _Field("GET", "query_param", name, required)
