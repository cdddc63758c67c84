"""The command line's only I/O: a Redis (or Redis Cluster) reached through the backend.
Every store failure leaves this module as `BackendError`, which the CLI turns into exit 1."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ratelimit_mw.backends import urls
from ratelimit_mw.backends.redis import STORE_ERRORS, RedisBackend, store_error
from ratelimit_mw.backends.urls import redact
from ratelimit_mw.core.errors import BackendError, ConfigurationError

SCAN_COUNT = 1000  # keys per SCAN step: large enough to be quick, small enough never to block


@contextlib.contextmanager
def store_errors() -> Iterator[None]:
    try:
        yield
    except STORE_ERRORS as exc:
        raise store_error(exc) from exc


class Store:
    """The backend the limiter runs on, and its client for the reads a limiter never makes
    (TIME, EXISTS, GET, SCAN)."""

    def __init__(self, url: str, timeout: float) -> None:
        if not 0 < timeout <= 3600:  # also NaN and inf, which the socket would refuse
            raise ConfigurationError(
                f"--timeout must be seconds above 0 and at most 3600, got {timeout}; "
                "e.g. --timeout 2")
        # A malformed URL or option is a ConfigurationError here, saying what to write.
        if urls.parse(url).kind == "memory":
            raise ConfigurationError(
                "--url memory:// is this process's memory, empty and gone when the command "
                "ends; the CLI reads a shared store: write --url redis://127.0.0.1:6379/0 "
                "(or redis+cluster://host:port, redis+sentinel://host:26379/service, or their "
                "valkey:// twins)"
            )
        self.url = url
        backend = RedisBackend.from_url(url, socket_timeout=timeout,
                                        socket_connect_timeout=timeout)
        if not isinstance(backend, RedisBackend):  # only memory:// builds anything else
            raise ConfigurationError(f"--url {redact(url)!r} does not name a Redis")
        self.backend = backend

    @property
    def client(self) -> Any:
        client = self.backend.client
        if not hasattr(client, "scan_iter"):  # a cluster that could not be reached at start
            raise BackendError(f"cannot reach the Redis Cluster at {redact(self.url)}")
        return client

    def time_ms(self) -> int:
        """Redis's clock: the one every decision is made with."""
        with store_errors():
            seconds, micros = self.client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    def existing(self, keys: list[str]) -> list[str]:
        with store_errors():
            return [key for key in keys if self.client.exists(key)]

    def get(self, key: str) -> bytes | None:
        with store_errors():
            return self.client.get(key)  # type: ignore[no-any-return]

    def delete(self, keys: list[str]) -> None:
        with store_errors():
            for key in keys:  # one by one: keys of other identities never share a call
                self.client.delete(key)

    def scan(self, match: str) -> Iterator[str]:
        """Keys matching `match`, by SCAN (never KEYS) on every primary of a cluster."""
        with store_errors():
            client = self.client
            nodes = ([client.get_redis_connection(node) for node in client.get_primaries()]
                     if self.backend.is_cluster else [client])
            for node in nodes:
                for key in node.scan_iter(match=match, count=SCAN_COUNT):
                    yield key.decode("utf-8", "replace") if isinstance(key, bytes) else key

    def close(self) -> None:
        with contextlib.suppress(*STORE_ERRORS, AttributeError):
            self.backend.close()
