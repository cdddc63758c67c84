"""The async Redis Cluster path: one pipelined connection per primary, calls routed by slot.

Each primary gets one pipelined connection per event loop (pipeline.py), so a burst is one
queue per socket, as on a single node, with no pool ceiling to queue behind.

Routing: every key of one script call shares one hash tag (the identity), so the call goes
to the primary serving the CRC16 slot of its first key. The slot map comes from CLUSTER
SLOTS, loaded once before the first call (concurrent first calls wait for the same load)
and again after a redirect or a lost node:
- MOVED: the slot has a new owner: the call follows it at once, and the map is reloaded in
  the background (a failover or a resharding moves more than one slot);
- ASK: the slot is migrating; this one call goes to the named node, prefixed by ASKING;
  the map is left as it is;
- a connection that fails after its one retry marks the map stale: the node may have failed
  over, and the next call reloads the map before it is routed;
- a call that gets no answer in time (a timeout, or the caller's deadline) makes its node a
  suspect: a hung node (a stopped process still accepts TCP connections, so no connection
  error ever comes) is handled as a failover would be. The map is asked again in the
  background, off the call's deadline, from the other nodes first (suspects last), each
  asked for a bounded time, one load at a time, at most once per RELOAD_GAP; once a replica
  is promoted, the map names it and the slot's calls go there.
NOSCRIPT and cancellation are handled per connection, as on a single node.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import hiredis
from redis.crc import key_slot
from redis.exceptions import ClusterDownError, RedisClusterException, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ratelimit_mw.backends.base import bounded
from ratelimit_mw.backends.pipeline import (
    ASKING,
    PipelinedConnection,
    consume,
    pack_evalsha,
    raise_for_error,
)
from ratelimit_mw.backends.settings import Settings
from ratelimit_mw.core.identity import identity_slot

SLOTS = 16384
# More redirects than a resharding in progress produces for one call (MOVED, then ASK).
MAX_REDIRECTS = 5
Address = tuple[str, int]
# The least time between two loads of the map that a timeout starts: a hung node times out
# every call sent to it, and one load at a time, this far apart, finds a promotion soon enough.
RELOAD_GAP = 0.1
# The longest one node is asked for the map (the client's own timeouts end it sooner): a node
# that hangs is never waited on for longer, whatever the client's settings.
ASK_TIMEOUT = 1.0


def slot_of(key: str) -> int:
    """The hash slot of a key: CRC16 of its hash tag (the identity), as Redis computes it."""
    return key_slot(key.encode())


def parse_slots(reply: Any, asked: Address) -> list[Address | None]:
    """CLUSTER SLOTS → the primary serving each slot (None for a slot nobody serves); an
    empty host (a node that does not know its address) is the node asked."""
    table: list[Address | None] = [None] * SLOTS
    for entry in reply:
        start, end, primary = int(entry[0]), int(entry[1]), entry[2]
        host = primary[0].decode() if isinstance(primary[0], bytes) else str(primary[0])
        address = (host or asked[0], int(primary[1]))
        table[start:end + 1] = [address] * (end + 1 - start)
    return table


def parse_redirect(message: str, replier: Address) -> tuple[str, Address] | None:
    """("MOVED" | "ASK", target) from an error reply, or None for any other error."""
    parts = message.split(" ")
    if len(parts) != 3 or parts[0] not in ("MOVED", "ASK"):
        return None
    host, _, port = parts[2].rpartition(":")
    return parts[0], (host or replier[0], int(port))


class PipelinedCluster:
    """Runs the script on a Redis Cluster through one pipelined connection per primary."""

    def __init__(self, startup: Iterable[Address], settings: Settings) -> None:
        self.startup = list(startup)
        self.settings = settings
        self._slots: list[Address | None] | None = None  # None: not loaded yet
        self._stale = False  # a node was lost: reload before the next call is routed
        self._known: list[Address] = []  # every primary of the last map: whom to ask next
        self._connections: dict[Address, PipelinedConnection] = {}
        self._loading: asyncio.Task[list[Address | None]] | None = None
        # Nodes whose calls got no answer in time, asked for the map last; and when (loop
        # time) a timeout last started a load.
        self._suspects: set[Address] = set()
        self._reloaded_at = float("-inf")

    @classmethod
    def for_client(cls, client: Any, settings: Settings | None = None) -> PipelinedCluster:
        """From a redis.asyncio.RedisCluster's start-up nodes and connection settings (or
        `settings`, those read from a valkey.asyncio.ValkeyCluster)."""
        nodes = client.nodes_manager.startup_nodes.values()
        return cls([(node.host, int(node.port)) for node in nodes],
                   settings or Settings.from_kwargs(client.connection_kwargs, db=0))

    def connection(self, address: Address) -> PipelinedConnection:
        connection = self._connections.get(address)
        if connection is None:
            connection = self._connections[address] = PipelinedConnection(
                self.settings.at(*address))
        return connection

    async def primaries(self) -> list[Address]:
        """The primaries serving slots now (the map loaded first when it is not)."""
        slots = self._slots if self._slots is not None and not self._stale else await self._load()
        return sorted({address for address in slots if address is not None})

    def node_of(self, identity: str) -> Address | None:
        """The primary serving an identity's keys as the map says now; None before it is
        loaded (the middleware keys its breakers by it)."""
        slots = self._slots
        return None if slots is None else slots[identity_slot(identity)]

    async def evalsha(self, keys: list[str], args: list[Any],
                      deadline: float | None = None) -> Any:
        """The script on the primary serving the keys' slot; TimeoutError after `deadline`
        seconds (None: the client's timeouts). No answer in time: see `_suspect`."""
        called: list[Address] = []  # the nodes the call went to, redirects included
        try:
            return await bounded(self._evalsha(keys, args, called), deadline)
        except (TimeoutError, RedisTimeoutError, asyncio.CancelledError):
            if called:
                self._suspect(called[-1])
            raise

    async def _evalsha(self, keys: list[str], args: list[Any], called: list[Address]) -> Any:
        packed = pack_evalsha(keys, args)
        slot = slot_of(keys[0])
        slots = self._slots if self._slots is not None and not self._stale else await self._load()
        target = slots[slot]
        asking = False
        for _ in range(MAX_REDIRECTS):
            if target is None:
                raise ClusterDownError(f"no node serves hash slot {slot}")
            called.append(target)
            try:
                reply = await self.connection(target).run_script(
                    ASKING + packed if asking else packed, skipped=1 if asking else 0)
            except TimeoutError:
                raise  # an OSError too, but no answer in time: `evalsha` handles it
            except (RedisConnectionError, OSError):
                self._stale = True  # the node may have failed over: reload before routing
                raise
            if self._suspects:
                self._suspects.discard(target)  # it answers
            if not isinstance(reply, hiredis.ReplyError):
                return reply
            redirect = parse_redirect(str(reply), target)
            if redirect is None:
                return raise_for_error(reply)
            kind, target = redirect
            asking = kind == "ASK"
            if not asking:
                slots[slot] = target
                self._reload_soon()
        raise RedisClusterException(f"too many cluster redirections for hash slot {slot}")

    async def _load(self) -> list[Address | None]:
        """The slot map, loaded by one task that concurrent callers share; shielded: a
        cancelled caller leaves the load running for the others."""
        loop = asyncio.get_running_loop()
        task = self._loading
        if task is None or task.done() or task.get_loop() is not loop:
            task = self._loading = loop.create_task(self._fetch_slots())
        return await asyncio.shield(task)

    def _suspect(self, address: Address) -> None:
        """A call to `address` got no answer in time: the node may be hung, and its replica
        promoted by now or soon. Ask for the map again in the background (its callers are
        not kept waiting on it), from the other nodes first."""
        self._suspects.add(address)
        now = asyncio.get_running_loop().time()
        if now - self._reloaded_at >= RELOAD_GAP:
            self._reloaded_at = now
            self._reload_soon()

    def _reload_soon(self) -> None:
        task = self._loading
        if task is None or task.done():
            task = self._loading = asyncio.get_running_loop().create_task(self._fetch_slots())
            # A failed background reload changes nothing: the redirect already gave the
            # target, and the next redirect tries again.
            task.add_done_callback(consume)

    async def _fetch_slots(self) -> list[Address | None]:
        """CLUSTER SLOTS from the first node that answers, each asked for ASK_TIMEOUT at
        most: known primaries first, suspects last."""
        candidates = list(dict.fromkeys([*self._known, *self.startup]))
        if self._suspects:
            candidates.sort(key=self._suspects.__contains__)  # stable: the others keep order
        failure: BaseException | None = None
        for address in candidates:
            try:
                reply = await bounded(self.connection(address).command("CLUSTER", "SLOTS"),
                                      ASK_TIMEOUT)
            except (RedisError, OSError, TimeoutError, hiredis.HiredisError) as exc:
                failure = exc  # down, or not in cluster mode: ask the next one
                continue
            table = parse_slots(reply, address)
            self._slots, self._stale = table, False
            self._known = sorted({a for a in table if a is not None})
            self._suspects &= set(self._known)  # a node that serves nothing is no concern
            self._forget_unused(table)
            return table
        raise RedisClusterException(
            f"no cluster node answered CLUSTER SLOTS (tried {len(candidates)}): {failure}")

    def _forget_unused(self, table: list[Address | None]) -> None:
        serving = set(table)
        for address in [a for a in self._connections if a not in serving]:
            if address not in self.startup:
                self._connections.pop(address).close()

    async def aclose(self) -> None:
        if self._loading is not None and not self._loading.done():
            self._loading.cancel()
        for connection in self._connections.values():
            await connection.aclose()

