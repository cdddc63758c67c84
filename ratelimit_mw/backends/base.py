"""What a backend is: the two protocols the limiters drive, and the capabilities they read.

A backend runs one `ScriptCall` (the keys and arguments of the joined Lua script) and returns
its integer reply. Capabilities are declared as attributes so that callers never need an
``isinstance`` check on a concrete backend:

- ``is_cluster``: keys are spread over hash slots; calls are split by slot.
- ``in_process``: the call is answered in this process without I/O (the memory backend), so
  a deadline around it protects nothing and only costs time.
"""

from __future__ import annotations

from typing import Protocol

from ratelimit_mw.core.plans import ScriptCall


class SyncBackend(Protocol):
    is_cluster: bool
    in_process: bool

    def run(self, call: ScriptCall) -> list[int]: ...


class AsyncBackend(Protocol):
    is_cluster: bool
    in_process: bool

    async def arun(self, call: ScriptCall) -> list[int]: ...
