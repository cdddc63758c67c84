"""Redis backends: the script runs by EVALSHA on redis-py's sync, asyncio and cluster clients.

The clients they are given or build from a URL (safe defaults, Valkey's) are clients.py's;
the URL is checked first (urls.py); Sentinel clients come from sentinel.py. On asyncio
every client, single node or cluster, whatever its transport, is driven through pipelined
connections of our own that mirror it (pipeline.py, cluster.py); sync clients through a
connection per thread (a single node) or redis-py's cluster client.

``ping()`` / ``aping()`` are the start-up check: connect, load the script on every primary,
report the server's version and one round trip (ping.py), or raise BackendError.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

from ratelimit_mw.backends import urls
from ratelimit_mw.backends.clients import (
    DeferredCluster,
    Valkey,
    blocking_pool,
    client_kwargs,
    label,
    memory_backend,
    require_redis,
)
from ratelimit_mw.backends.memory import MemoryBackend
from ratelimit_mw.backends.ping import aping_pipelined, ping_report, server_of, unreachable
from ratelimit_mw.core import scripts
from ratelimit_mw.core.codec import ScriptCall
from ratelimit_mw.core.compiled import bulk
from ratelimit_mw.core.errors import BackendError, ConfigurationError
from ratelimit_mw.core.identity import identity_slot
from ratelimit_mw.core.wire import Arg

try:
    import redis
    import redis.asyncio
    import redis.cluster
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import NoScriptError, RedisClusterException, RedisError, ResponseError

    from ratelimit_mw.backends import sentinel as _sentinel
except ImportError:  # pragma: no cover - exercised only without the extra
    redis = None  # type: ignore[assignment]

try:  # the async backend needs hiredis (the [redis] extra brings it): AsyncRedisBackend says so
    from ratelimit_mw.backends import pipeline as _pipeline
    from ratelimit_mw.backends.cluster import PipelinedCluster
    from ratelimit_mw.backends.settings import Settings
except ImportError:  # pragma: no cover - exercised only without hiredis
    _pipeline = None  # type: ignore[assignment]
    PipelinedCluster = None  # type: ignore[assignment,misc]

# The errors a backend call may raise: redis-py's own (RedisClusterException, e.g. "cannot
# be connected", is not a RedisError), socket errors, and the builtin TimeoutError that
# asyncio.timeout raises.
STORE_ERRORS: tuple[type[BaseException], ...] = (OSError, TimeoutError)
if redis is not None:
    STORE_ERRORS = (RedisError, RedisClusterException, OSError, TimeoutError)
try:
    import hiredis
except ImportError:  # pragma: no cover - hiredis is the optional [hiredis] extra
    hiredis = None  # type: ignore[assignment]
if _pipeline is not None and hiredis is not None:
    STORE_ERRORS = (*STORE_ERRORS, hiredis.HiredisError)


# The bytes of tier arguments (algorithm codes, limits, periods, costs): few values, sent
# again and again (a batch of give-backs repeats its tiers per response).
_TIER_BYTES: dict[Arg, bytes] = {}


def _tier_bytes(value: Arg) -> bytes:
    found = _TIER_BYTES.get(value)
    if found is None:
        found = bulk(value)
        if len(_TIER_BYTES) < 1024:  # bounded: dynamic limits make new values
            _TIER_BYTES[value] = found
    return found


def pack(call: ScriptCall) -> bytes:
    """The EVALSHA of `call` in Redis's wire format: the bytes a `Compiled` built with it
    (`ScriptCall.wire`), else packed here."""
    wire = call.wire
    if wire is not None:
        return wire
    keys, args = call.keys, call.args
    return b"".join((b"*%d\r\n" % (3 + len(keys) + len(args)), bulk("EVALSHA"),
                     bulk(scripts.sha1()), bulk(len(keys)), *map(bulk, keys),
                     *map(bulk, args[:5]), *map(_tier_bytes, args[5:])))


def store_error(exc: BaseException) -> BackendError:
    """One of `STORE_ERRORS` as the BackendError every caller of a backend handles."""
    return BackendError(f"Redis call failed: {type(exc).__name__}: {exc}")


class RedisBackend:
    """Runs the script on a ``redis.Redis`` or ``redis.cluster.RedisCluster`` client (or
    valkey-py's ``valkey.Valkey`` or ``valkey.cluster.ValkeyCluster``).

    On a ``redis.Redis``, whatever its transport (TCP, TLS, unix socket, the primary that
    Sentinel names), each thread keeps one connection of its own, made like the client's
    pooled ones: a call is one packed send and one read, with the client's timeouts and
    retry policy but no pool checkout or ``execute_command`` bookkeeping. NOSCRIPT (a
    flushed or restarted server) loads the script and runs it again. Cluster clients go
    through ``register_script``, which routes by key.
    """


    def __init__(self, client: Any) -> None:
        require_redis()
        if isinstance(client, (redis.asyncio.Redis, redis.asyncio.RedisCluster)):
            raise ConfigurationError(
                "RedisBackend takes a sync client; for redis.asyncio use "
                "AsyncRedisBackend(redis.asyncio.Redis(...))"
            )
        if isinstance(client, Valkey.classes("asyncio.Valkey", "asyncio.ValkeyCluster")):
            raise ConfigurationError(
                "RedisBackend takes a sync client; for valkey.asyncio use "
                "AsyncRedisBackend(valkey.asyncio.Valkey(...))"
            )
        self.client = client
        self.is_cluster = isinstance(client, (redis.cluster.RedisCluster, DeferredCluster,
                                              *Valkey.classes("cluster.ValkeyCluster")))
        # What the client raises: redis-py's errors, or valkey-py's own tree.
        self._errors: tuple[type[BaseException], ...] = (
            (*STORE_ERRORS, *Valkey.errors()) if Valkey.owns(client) else STORE_ERRORS)
        self._no_script: tuple[type[BaseException], ...] = (
            NoScriptError, *Valkey.classes("exceptions.NoScriptError"))
        self._label = "redis-cluster" if self.is_cluster else label(client, asyncio=False)
        self._script: Any = client.register_script(scripts.source()) if self.is_cluster else None
        self._pool: Any = None
        self._connection_class: Any = None
        if not self.is_cluster:
            self._pool = client.connection_pool
            self._connection_class = _sentinel.following(self._pool.connection_class)
        self._connect_lock = threading.Lock()
        self._local = threading.local()

    @classmethod
    def from_url(cls, url: str, **redis_kwargs: Any) -> RedisBackend | MemoryBackend:
        """A backend for `url` with safe timeouts (see ``urls.py`` for every form).

        ``redis://``, ``rediss://``, ``unix://``, ``redis+cluster://``,
        ``redis+sentinel://host:26379,host:26379/service/db``, their Valkey twins
        (``valkey://``, ``valkeys://``, ``valkey+unix://``, ``valkey+cluster://``,
        ``valkey+sentinel://``: the same meaning, the same redis-py client), and ``memory://``
        (a MemoryBackend). A malformed URL or an unknown option is a ConfigurationError here.
        """
        spec = urls.parse(url)
        if spec.kind == "memory":
            return memory_backend(redis_kwargs)
        require_redis()
        kwargs = client_kwargs(spec, redis_kwargs)
        if spec.kind == "cluster":
            plain = spec.client_url
            try:
                return cls(redis.cluster.RedisCluster.from_url(plain, **kwargs))
            except STORE_ERRORS:
                # The sync cluster client connects as it is built; an app must still start
                # while the cluster is down (its failure policy covers the outage), so the
                # client is built on the first call instead.
                return cls(DeferredCluster(lambda: redis.cluster.RedisCluster.from_url(
                    plain, **kwargs), urls.redact(url)))
        if spec.kind == "sentinel":
            return cls(_sentinel.client(spec, kwargs, asyncio=False))
        kwargs.setdefault("db", spec.db)
        return cls(redis.Redis(connection_pool=blocking_pool(redis.BlockingConnectionPool,
                                                              spec.client_url, kwargs)))

    def __repr__(self) -> str:
        return f"RedisBackend({self.client!r})"

    def node_of(self, identity: str) -> str | None:
        """On a cluster, the primary serving an identity's keys as the client's slot map says
        now (None before it is loaded, and off a cluster): the middleware's breaker per node."""
        manager = getattr(self.client, "nodes_manager", None) if self.is_cluster else None
        nodes = None if manager is None else manager.slots_cache.get(identity_slot(identity))
        return nodes[0].name if nodes else None

    def run(self, call: ScriptCall, deadline: float | None = None) -> list[int]:
        """One call, bounded by the client's timeouts (a blocking call cannot be cut short
        at `deadline`: built from a URL, they are 100 ms)."""
        try:
            if self._pool is None:
                if self._script is None:
                    self._build_deferred()
                return self._script(keys=call.keys, args=call.args)  # type: ignore[no-any-return]
            try:
                return self._evalsha(call)
            except self._no_script:
                self.client.script_load(scripts.source())
                return self._evalsha(call)
        except self._errors as exc:
            raise store_error(exc) from exc

    def _build_deferred(self) -> None:
        with self._connect_lock:
            if self._script is None:
                client = self.client.factory()
                self._script = client.register_script(scripts.source())
                self.client = client

    def _connection(self) -> Any:
        """This thread's own connection, made from the client's pool settings (a new one
        after a fork): a pool checkout costs more than the script, and a thread runs one call
        at a time (threads are bounded by the server, and so are these connections). Under
        Sentinel it asks the sentinels for the primary whenever it connects.
        """
        local = self._local
        conn = getattr(local, "conn", None)
        if conn is None or local.pid != os.getpid():
            pool = self._pool
            conn = self._connection_class(**pool.connection_kwargs)
            local.conn, local.pid = conn, os.getpid()
        return conn

    def _evalsha(self, call: ScriptCall) -> list[int]:
        conn = self._connection()
        command = ("EVALSHA", scripts.sha1(), len(call.keys), *call.keys, *call.args)
        if hiredis is not None:
            packed = [hiredis.pack_command(command)]  # type: ignore[arg-type]
        else:
            packed = conn.pack_command(*command)

        def attempt() -> list[int]:
            conn.send_packed_command(packed, check_health=False)
            return conn.read_response()  # type: ignore[no-any-return]

        # The client's own retry policy (one immediate retry on a dropped connection when
        # built by from_url); a failed attempt drops the connection so that a late reply can
        # never be read as the answer to the next call. An error reply (NOSCRIPT, OOM) has
        # been read whole and leaves the connection in order.
        return conn.retry.call_with_retry(attempt, lambda _: conn.disconnect())  # type: ignore[no-any-return]

    def ping(self) -> dict[str, Any]:
        """Connect, load the script (on every primary of a cluster) and time one PING.

        The start-up check: a wrong host, a refused password or a server that refuses
        scripts raises BackendError here, at deploy time, instead of showing up later as a
        failure policy applied to live traffic.
        """
        try:
            if self.is_cluster and self._script is None:
                self._build_deferred()
            client: Any = self.client
            if self.is_cluster:
                primaries = client.get_primaries()
                rtt = 0.0
                for node in primaries:
                    start = time.perf_counter()
                    client.execute_command("PING", target_nodes=node)
                    rtt = max(rtt, time.perf_counter() - start)
                    client.execute_command("SCRIPT", "LOAD", scripts.source(), target_nodes=node)
                info = client.execute_command("INFO", "server", target_nodes=primaries[0])
                if isinstance(info, dict) and primaries[0].name in info:
                    info = info[primaries[0].name]
                return ping_report("redis-cluster", **server_of(info), nodes=len(primaries),
                                   rtt_s=rtt, script_sha=scripts.sha1())
            client.ping()  # connects: the round trip below is the network's alone
            start = time.perf_counter()
            client.ping()
            rtt = time.perf_counter() - start
            client.script_load(scripts.source())
            return ping_report(self._label, **server_of(client.info("server")), nodes=1,
                               rtt_s=rtt, script_sha=scripts.sha1())
        except self._errors as exc:
            raise unreachable(self.client, exc) from exc

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.disconnect()
        self.client.close()



class AsyncRedisBackend:
    """Runs the script on the Redis a ``redis.asyncio.Redis`` or ``redis.asyncio.RedisCluster``
    client points at (or valkey-py's ``valkey.asyncio.Valkey`` or ``ValkeyCluster``), through
    one pipelined connection per event loop and node (pipeline.py, cluster.py) that mirrors
    the client's settings, whatever its transport.

    The client itself serves only to describe the server, and is closed with the backend.
    """


    def __init__(self, client: Any) -> None:
        require_redis()
        valkey = Valkey.classes("asyncio.Valkey", "asyncio.ValkeyCluster")
        if not isinstance(client, (redis.asyncio.Redis, redis.asyncio.RedisCluster, *valkey)):
            sync = "valkey.Valkey" if Valkey.owns(client) else "redis.Redis"
            raise ConfigurationError(
                "AsyncRedisBackend takes a redis.asyncio (or valkey.asyncio) client; for a "
                f"sync client use RedisBackend({sync}(...))"
            )
        if _pipeline is None:  # pragma: no cover - hiredis comes with the [redis] extra
            raise ConfigurationError(
                "AsyncRedisBackend needs hiredis: pip install 'ratelimit_mw[redis]'")
        self.client: Any = client
        self.is_cluster = isinstance(client, (redis.asyncio.RedisCluster, *valkey[1:]))
        self._label = "redis-cluster" if self.is_cluster else label(client, asyncio=True)
        if Valkey.owns(client):
            settings = Settings.from_valkey(client, cluster=self.is_cluster)
            self._pipe: Any = (PipelinedCluster.for_client(client, settings) if self.is_cluster
                               else _pipeline.PipelinedConnection(settings))
        else:
            self._pipe = (PipelinedCluster.for_client(client) if self.is_cluster
                          else _pipeline.PipelinedConnection.for_client(client))

    @classmethod
    def from_url(cls, url: str, **redis_kwargs: Any) -> AsyncRedisBackend | MemoryBackend:
        """A backend on a new asyncio client with safe timeouts; the URLs of
        ``RedisBackend.from_url``."""
        spec = urls.parse(url)
        if spec.kind == "memory":
            return memory_backend(redis_kwargs)
        require_redis()
        kwargs = client_kwargs(spec, redis_kwargs, asyncio=True)
        if spec.kind == "cluster":
            if "retry_on_timeout" not in redis_kwargs and "retry_on_timeout" not in spec.options:
                # redis.asyncio.RedisCluster has no such argument (TypeError); the `retry`
                # set above bounds its retries.
                del kwargs["retry_on_timeout"]
            return cls(redis.asyncio.RedisCluster.from_url(spec.client_url, **kwargs))
        if spec.kind == "sentinel":
            return cls(_sentinel.client(spec, kwargs, asyncio=True))
        kwargs.setdefault("db", spec.db)
        return cls(redis.asyncio.Redis(connection_pool=blocking_pool(
            redis.asyncio.BlockingConnectionPool, spec.client_url, kwargs)))

    def __repr__(self) -> str:
        return f"AsyncRedisBackend({self.client!r})"

    def node_of(self, identity: str) -> Any:
        """On a cluster, the primary serving an identity's keys as the slot map says now
        (None before it is loaded, and off a cluster): the middleware's breaker per node."""
        return self._pipe.node_of(identity) if self.is_cluster else None

    async def arun(self, call: ScriptCall, deadline: float | None = None) -> list[int]:
        """One call; TimeoutError after `deadline` seconds. On an open single-node connection
        it is written at once, the deadline kept by the connection's timer; otherwise (no
        open connection, a drop, a lost script) `evalsha_within` connects, mends and sends the
        very same bytes again, so a sliding log gets the same members if the first copy
        reached Redis."""
        pipe = self._pipe
        try:
            if deadline is None:
                return await pipe.evalsha(call.keys, call.args)  # type: ignore[no-any-return]
            if self.is_cluster:
                return await pipe.evalsha(call.keys, call.args, deadline)  # type: ignore[no-any-return]
            packed = pack(call)
            # `pipe.ready()`, asked of its protocol: the send below is the protocol's too.
            protocol = pipe.protocol
            if protocol is not None and protocol.ready():
                loop = protocol.loop
                give_up = loop.time() + deadline
                try:
                    reply = await protocol.send(packed, give_up=give_up)
                except Exception as exc:
                    reply = self._settle(exc)
                else:
                    if type(reply) is not list:
                        reply = self._settle(reply)
                if reply is not None:
                    return reply  # type: ignore[no-any-return]
                deadline = give_up - loop.time()
                if deadline <= 0:
                    raise TimeoutError()
            return await pipe.evalsha_within(call.keys, call.args, deadline)  # type: ignore[no-any-return]
        except TimeoutError:
            raise  # the caller's deadline, as `bounded` raises it: "timed out after 100 ms"
        except STORE_ERRORS as exc:
            raise store_error(exc) from exc

    def _settle(self, outcome: Any) -> list[int] | None:
        """What a sent call that did not bring a plain reply means: `outcome` is the
        exception its future raised or the error reply it brought. None: send it again the
        complete way, which reconnects after a dropped connection and mends what
        `PipelinedConnection.recovers` (NOSCRIPT, a demoted primary). Otherwise raises: the
        caller's TimeoutError as it is (a call given up is never sent again), any other
        failure as BackendError."""
        if isinstance(outcome, (TimeoutError, asyncio.TimeoutError)):
            raise outcome
        if isinstance(outcome, (RedisConnectionError, OSError)):
            return None
        if isinstance(outcome, hiredis.ReplyError):
            if self._pipe.recovers(outcome):
                return None
            outcome = ResponseError(str(outcome))
        if isinstance(outcome, BaseException):
            raise store_error(outcome) from outcome
        raise store_error(TypeError(f"unexpected reply {outcome!r}"))

    async def aping(self) -> dict[str, Any]:
        """The async twin of ``RedisBackend.ping``: connect, load the script, time a PING.
        It opens the connections the checks use, so the first burst finds them ready."""
        try:
            pipe = self._pipe
            if self.is_cluster:
                return await self._aping_pipelined_cluster(pipe)
            rtt = await aping_pipelined(pipe)
            return ping_report(self._label, **server_of(await pipe.command("INFO", "server")),
                               nodes=1, rtt_s=rtt, script_sha=scripts.sha1())
        except STORE_ERRORS as exc:
            raise unreachable(self.client, exc) from exc

    @staticmethod
    async def _aping_pipelined_cluster(cluster: Any) -> dict[str, Any]:
        primaries = await cluster.primaries()
        rtt = 0.0
        for address in primaries:
            rtt = max(rtt, await aping_pipelined(cluster.connection(address)))
        info = await cluster.connection(primaries[0]).command("INFO", "server")
        return ping_report("redis-cluster", **server_of(info), nodes=len(primaries),
                           rtt_s=rtt, script_sha=scripts.sha1())

    async def aclose(self) -> None:
        await self._pipe.aclose()
        await self.client.aclose()
