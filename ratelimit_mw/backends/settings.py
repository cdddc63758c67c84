"""Where and how a pipelined connection connects, mirrored from the client it is given.

The connection mirrors the redis-py client (``Settings.from_kwargs``), or the valkey-py one
(``Settings.from_valkey``): its connection class says the transport (TLS through the client
library's own SSL context), and its host, port, unix path, database, username and password or
credential provider, client name and timeouts apply. It always speaks RESP2: the replies are
the script's integers either way. Under Sentinel every connect asks the sentinels for the
primary.
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from redis.asyncio.connection import Connection as _PlainConnection
from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection
from redis.asyncio.sentinel import SentinelManagedConnection

from ratelimit_mw.backends import sentinel as _sentinel
from ratelimit_mw.backends.clients import Valkey
from ratelimit_mw.core.errors import ConfigurationError


@dataclass(frozen=True)
class Settings:
    """Where and how to connect: one node's address, its transport, and the client's
    credentials and timeouts."""

    host: str = "localhost"
    port: int = 6379
    path: str | None = None  # a unix socket, instead of host and port
    tls: ssl.SSLContext | None = None
    # Sentinel: asks the sentinels for the primary's address on every connect; the
    # sentinels (redis.asyncio clients) whose announcements of `service` it follows.
    locate: Callable[[], Awaitable[tuple[str, int]]] | None = None
    sentinels: tuple[Any, ...] = ()
    service: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None
    credentials: Any = None  # a redis-py CredentialProvider, asked on every connect
    client_name: str | None = None
    timeout: float | None = None
    connect_timeout: float | None = None

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any], **where: Any) -> Settings:
        """From a redis-py connection class and its kwargs (`where` gives a cluster node's
        host and port): the class says the transport, the kwargs the rest. TLS uses
        redis-py's own SSL context from the ``ssl_*`` options, so they mean what they mean
        there."""
        kwargs = {**kwargs, **where}
        connection_class = kwargs.get("connection_class", _PlainConnection)
        tls = path = locate = None
        sentinels: tuple[Any, ...] = ()
        service = ""
        if issubclass(connection_class, UnixDomainSocketConnection):
            path = kwargs.get("path") or ""
        elif issubclass(connection_class, SSLConnection):
            options = {k: v for k, v in kwargs.items() if k.startswith("ssl_")}
            tls = SSLConnection(**options).ssl_context.get()
        elif not issubclass(connection_class, _PlainConnection):
            raise ConfigurationError(
                f"connection_class={connection_class.__name__} is not one ratelimit_mw can "
                "mirror; use redis-py's Connection, SSLConnection or "
                "UnixDomainSocketConnection (or a subclass), e.g. redis.asyncio.from_url("
                "\"rediss://...\")"
            )
        if issubclass(connection_class, SentinelManagedConnection):
            pool = kwargs.get("connection_pool")
            if pool is None or not pool.is_master:
                raise ConfigurationError(
                    "a rate limiter writes: give it the primary, sentinel.master_for(...), "
                    "not a replica (slave_for)"
                )
            sentinels, service = tuple(pool.sentinel_manager.sentinels), pool.service_name
            # Asked on the running loop's own connections: redis-py's sentinel clients
            # belong to the loop they first ran on.
            locate = functools.partial(_sentinel.primary_of, pool.sentinel_manager, service)
        timeout = kwargs.get("socket_timeout")
        return cls(
            host=kwargs.get("host") or "localhost",
            port=int(kwargs.get("port") or 6379),
            path=path,
            tls=tls,
            locate=locate,
            sentinels=sentinels,
            service=service,
            db=int(kwargs.get("db", 0) or 0),
            username=kwargs.get("username"),
            password=kwargs.get("password"),
            credentials=kwargs.get("credential_provider"),
            client_name=kwargs.get("client_name"),
            timeout=timeout,
            connect_timeout=kwargs.get("socket_connect_timeout") or timeout,
        )

    @classmethod
    def from_valkey(cls, client: Any, *, cluster: bool) -> Settings:
        """From a valkey.asyncio client, as ``from_kwargs`` reads a redis.asyncio one: its
        connection class read as the redis-py class it copies, and over TLS the SSL context
        that valkey-py itself builds from the client's ``ssl_*`` options (its defaults
        differ: no hostname check unless asked)."""
        if cluster:
            kwargs = dict(client.connection_kwargs)
        else:
            pool = client.connection_pool
            kwargs = {**pool.connection_kwargs, "connection_class": pool.connection_class}
        own_class = (kwargs.get("connection_class")
                     or Valkey.classes("asyncio.connection.Connection")[0])
        where = {"db": 0} if cluster else {}
        settings = cls.from_kwargs(
            {**kwargs, "connection_class": Valkey.redis_twin(own_class)}, **where)
        if settings.tls is not None:
            options = {k: v for k, v in kwargs.items() if k.startswith("ssl_")}
            ssl_class = Valkey.classes("asyncio.connection.SSLConnection")[0]
            settings = replace(settings, tls=ssl_class(**options).ssl_context.get())
        return settings

    def at(self, host: str, port: int) -> Settings:
        """The same transport, credentials and timeouts, another node."""
        return replace(self, host=host, port=port)

    def where(self) -> str:
        """The address, for messages."""
        return f"unix:{self.path}" if self.path is not None else f"{self.host}:{self.port}"
