"""Redis Sentinel: a client on the primary that the sentinels name, followed through failovers.

redis-py's retry reconnects to the address the connection last had, not through the
sentinels, so the one retry meant to survive a failover would reach the demoted primary.
The connections here ask the sentinels on every connect, so that retry lands on the new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
from collections.abc import Callable
from typing import Any

import redis.asyncio.sentinel
import redis.sentinel

from ratelimit_mw.backends.urls import BackendURL

_log = logging.getLogger("ratelimit_mw")

# How long a listener waits before subscribing again after its sentinel failed.
RESUBSCRIBE = 1.0

# The client options that also apply to the connections to the sentinels themselves.
_SHARED = ("socket_timeout", "socket_connect_timeout", "socket_keepalive", "retry")


class _Following(redis.sentinel.SentinelManagedConnection):
    def _connect(self) -> Any:
        if self.connection_pool.is_master:
            self.host, self.port = self.connection_pool.get_master_address()
        return super()._connect()  # type: ignore[no-untyped-call]


class _FollowingTLS(_Following, redis.sentinel.SentinelManagedSSLConnection):
    pass


class _AsyncFollowing(redis.asyncio.sentinel.SentinelManagedConnection):
    async def _connect(self) -> None:
        if self.connection_pool.is_master:
            self.host, self.port = await self.connection_pool.get_master_address()
        await super()._connect()  # type: ignore[no-untyped-call]


class _AsyncFollowingTLS(_AsyncFollowing, redis.asyncio.sentinel.SentinelManagedSSLConnection):
    pass


@functools.cache
def following(connection_class: type) -> type:
    """The class that makes a sync connection like `connection_class` but follows the
    sentinels on every connect (for a client built outside ``from_url`` too: a subclass
    of the user's keeps its own methods); any other class as it is."""
    if (not issubclass(connection_class, redis.sentinel.SentinelManagedConnection)
            or issubclass(connection_class, _Following)):
        return connection_class
    return type(f"Following{connection_class.__name__}", (_Following, connection_class), {})


def client(spec: BackendURL, kwargs: dict[str, Any], *, asyncio: bool) -> Any:
    """A redis-py client (sync or asyncio) on the primary Sentinel names for `spec.service`.

    `kwargs` are the client options (timeouts, retry...); the socket ones apply to the
    sentinel connections too, with the URL's ``sentinel_username``/``sentinel_password``.
    """
    sentinel_kwargs = {k: kwargs[k] for k in _SHARED if k in kwargs}
    if spec.tls:
        sentinel_kwargs["ssl"] = True
    for option in ("sentinel_username", "sentinel_password"):
        if option in spec.options:
            sentinel_kwargs[option.removeprefix("sentinel_")] = spec.options[option]
    module: Any = redis.asyncio.sentinel if asyncio else redis.sentinel
    classes = (_AsyncFollowing, _AsyncFollowingTLS) if asyncio else (_Following, _FollowingTLS)
    credentials = {k: v for k, v in (("username", spec.username), ("password", spec.password))
                   if v is not None}
    sentinel = module.Sentinel(list(spec.sentinels), sentinel_kwargs=sentinel_kwargs)
    return sentinel.master_for(spec.service, db=spec.db, connection_class=classes[spec.tls],
                               **{**credentials, **kwargs})


async def listen(sentinel: Any, service: str, switched: Callable[[str, int], None]) -> None:
    """Follow one sentinel (a redis.asyncio client) until cancelled: call `switched(host,
    port)` with each new primary of `service` the moment it names one, subscribing again
    `RESUBSCRIBE` seconds after a failure.

    Counts written to the old primary are lost when it becomes a replica, so the switch is
    made as early as ``+failover-state-wait-promotion``, before ``+switch-master``; should
    that failover be aborted, the replica answers READONLY and the connection asks the
    sentinels again (pipeline.py).
    """
    while True:
        connection = _connection(sentinel)
        try:
            await connection.connect()
            await connection.send_command("SUBSCRIBE", *CHANNELS)
            while True:
                message = await connection.read_response(timeout=math.inf)
                primary = announced(message, service)
                if primary is not None:
                    switched(*primary)
        except Exception as exc:  # the sentinel is down or went away: subscribe again
            _log.debug("ratelimit_mw: sentinel %s: %s", connection, exc)
        finally:
            with contextlib.suppress(Exception):
                await connection.disconnect(nowait=True)
        await asyncio.sleep(RESUBSCRIBE)


CHANNELS = ("+switch-master", "+failover-state-wait-promotion")


def announced(message: Any, service: str) -> tuple[str, int] | None:
    """The new primary of `service` that a sentinel's message names, else None:
    ``+switch-master`` "<service> <old ip> <old port> <new ip> <new port>", or
    ``+failover-state-wait-promotion`` "slave <ip:port> <ip> <port> @ <service> <ip> <port>"
    (the replica being promoted)."""
    if not isinstance(message, list) or len(message) != 3:
        return None
    kind, channel, data = (part.decode(errors="replace") if isinstance(part, bytes) else part
                           for part in message)
    if kind != "message" or not isinstance(data, str):
        return None
    parts = data.split()
    if channel == "+switch-master" and len(parts) == 5:
        name, host, port = parts[0], parts[3], parts[4]
    elif channel == "+failover-state-wait-promotion" and len(parts) == 8 and parts[4] == "@":
        name, host, port = parts[5], parts[2], parts[3]
    else:
        return None
    return (host, int(port)) if name == service and port.isdigit() else None


def _connection(sentinel: Any) -> Any:
    """A new connection to one sentinel with its client's settings, on the running loop (a
    client's pool belongs to the loop it first ran on). RESP2: under RESP3 redis-py hands
    published messages to a push handler instead of returning them."""
    pool = sentinel.connection_pool
    return pool.connection_class(**{**pool.connection_kwargs, "protocol": 2})


async def primary_of(manager: Any, service: str) -> tuple[str, int]:
    """The primary of `service` as redis-py's ``Sentinel.discover_master`` finds it (the
    first sentinel whose view passes `manager.check_master_state`; ``force_master_ip``
    applied; that sentinel asked first next time), but on the running loop's connections.
    MasterNotFoundError (a ConnectionError) when none names one."""
    failures: list[str] = []
    sentinels = manager.sentinels
    for index, sentinel in enumerate(list(sentinels)):
        connection = _connection(sentinel)
        try:
            await connection.connect()
            await connection.send_command("SENTINEL", "MASTER", service)
            reply = await connection.read_response()
        except Exception as exc:  # down, or it does not watch `service`: ask the next one
            failures.append(f"{type(exc).__name__}: {exc}")
            continue
        finally:
            with contextlib.suppress(Exception):
                await connection.disconnect(nowait=True)
        state = _master_state(reply)
        if state is None or not manager.check_master_state(state, service):
            failures.append(f"a sentinel sees no healthy primary for {service!r}")
            continue
        if index and index < len(sentinels):
            sentinels[0], sentinels[index] = sentinels[index], sentinels[0]
        forced = getattr(manager, "_force_master_ip", None)
        return (forced if forced is not None else state["ip"]), state["port"]
    raise redis.asyncio.sentinel.MasterNotFoundError(
        f"no sentinel named a primary for {service!r} ({len(sentinels)} asked: "
        f"{'; '.join(failures) or 'none'})")


def _master_state(reply: Any) -> dict[str, Any] | None:
    """``SENTINEL MASTER``'s field list as redis-py's parsed state (the fields
    ``check_master_state`` reads)."""
    if not isinstance(reply, (list, tuple)) or len(reply) % 2:
        return None
    text = [item.decode() if isinstance(item, bytes) else str(item) for item in reply]
    fields = dict(zip(text[::2], text[1::2], strict=True))
    try:
        flags = set(fields["flags"].split(","))
        return {"ip": fields["ip"], "port": int(fields["port"]), "is_master": "master" in flags,
                "is_sdown": "s_down" in flags, "is_odown": "o_down" in flags,
                "num-other-sentinels": int(fields.get("num-other-sentinels", 0))}
    except (KeyError, ValueError):
        return None
