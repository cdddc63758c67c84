"""Leave nothing behind in the shared Redis: the prefixes a test run used, and their sweep.

Tests write under random prefixes (``"t" + uuid``, ``"trel" + uuid``, ...), often in
processes of their own (servers, spawned workers) that this process never sees. So the run
records two things: every prefix a Limiter in this process is built with, and the start of
every ``uuid4()`` this process draws (each test prefix is a few letters and the start of
one). `sweep()`, at the end of the run, walks every database of the shared server once with
SCAN (never KEYS) and deletes each key whose prefix — the text before its first ``:`` — is a
recorded prefix or extends one (``prefix + "a"`` for a second limiter), or holds the start of
a recorded uuid right after its first letters. It then walks again: a key that survives (a
server a test started still writing, say) fails the run, loudly.

A fixed prefix such as ``"rl"`` — which another suite on the same server may be using right
now — is never swept: only prefixes with a random part (eight hex digits or more) are
recorded, and another run's uuids are its own (ten hex digits: a chance collision is about
one in a trillion per pair).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

_RANDOM_PART = re.compile(r"[0-9a-f]{8}")
_UUID_START = 10  # hex digits of a uuid that identify it in a prefix ("t" + hex[:12], ...)
_LEADING_LETTERS = 6  # the most letters before the random part ("fleet", "trel", "srv", ...)
_SCAN_COUNT = 1000


@dataclass
class SweepOutcome:
    deleted: int = 0
    survivors: list[str] = field(default_factory=list)
    error: str = ""

    @property
    def clean(self) -> bool:
        return not self.survivors

    @property
    def message(self) -> str:
        if self.error:
            return f"housekeeping: could not sweep the test keys ({self.error})"
        if self.survivors:
            shown = ", ".join(self.survivors[:10])
            return (f"housekeeping: FAILED: {len(self.survivors)} test key(s) survived the "
                    f"sweep (something still writes after the run): {shown}")
        if self.deleted:
            return f"housekeeping: deleted {self.deleted} key(s) the tests left in Redis"
        return ""


class Housekeeper:
    def __init__(self, url: str) -> None:
        self.url = url
        self.prefixes: set[str] = set()
        self.uuids: set[str] = set()

    def record(self, prefix: str) -> None:
        if _RANDOM_PART.search(prefix):
            self.prefixes.add(prefix)

    def record_uuid(self, hex_digits: str) -> None:
        self.uuids.add(hex_digits[:_UUID_START])

    def owns(self, key: str) -> bool:
        """Whether a key lies under a recorded prefix (itself or one extended by a suffix), or
        under letters followed by the start of a recorded uuid."""
        head = key.split(":", 1)[0]
        if any(head[:end] in self.prefixes for end in range(len(head), 7, -1)):
            return True
        return any(head[i:i + _UUID_START] in self.uuids
                   for i in range(min(_LEADING_LETTERS, len(head) - _UUID_START) + 1))

    def _clients(self) -> list[redis.Redis]:
        options = {"socket_timeout": 5, "socket_connect_timeout": 2,
                   "retry": Retry(NoBackoff(), 1)}
        first = redis.Redis.from_url(self.url, **options)
        databases = [int(name[2:]) for name in first.info("keyspace") if name.startswith("db")]
        first.close()
        return [redis.Redis.from_url(self.url, db=db, **options) for db in databases]

    def _owned_keys(self, client: redis.Redis) -> list[bytes]:
        return [key for key in client.scan_iter(count=_SCAN_COUNT)
                if self.owns(key.decode("utf-8", "replace"))]

    def sweep(self) -> SweepOutcome:
        outcome = SweepOutcome()
        if not self.prefixes and not self.uuids:
            return outcome
        try:
            clients = self._clients()
            try:
                for client in clients:
                    keys = self._owned_keys(client)
                    for start in range(0, len(keys), 500):
                        outcome.deleted += int(client.delete(*keys[start:start + 500]))
                for client in clients:
                    outcome.survivors += [k.decode("utf-8", "replace")
                                          for k in self._owned_keys(client)]
            finally:
                for client in clients:
                    client.close()
        except (redis.RedisError, OSError) as exc:
            outcome.error = f"{type(exc).__name__}: {exc}"
        return outcome
