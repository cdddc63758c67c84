"""A private Redis Sentinel setup for the tests: a primary, a replica and three sentinels.

`LocalSentinel(directory).start()` launches them on free loopback ports (daemonized, nothing
persisted), waits until every sentinel knows the replica and the two other sentinels, and
`failover()` runs SENTINEL FAILOVER and waits until the replica is the primary and the old
primary follows it. `stop()` shuts down every server it started (by its own pid as a last
resort) and removes the directory. Never touches the shared Redis on 6379. ``flavour=valkey()``
runs Valkey's binaries instead (tests/servers.py).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import redis
from cluster import free_ports, stop_servers
from redis.backoff import NoBackoff
from redis.retry import Retry
from servers import REDIS, Flavour

SERVICE = "mymaster"
SENTINELS = 3
_TIMEOUT = 30.0


def _client(port: int) -> redis.Redis:
    return redis.Redis(port=port, socket_timeout=2, decode_responses=True,
                       retry=Retry(NoBackoff(), 0))


def _replication(port: int) -> dict[str, object]:
    client = _client(port)
    try:
        return client.info("replication")  # type: ignore[no-any-return]
    finally:
        client.close()


class LocalSentinel:
    def __init__(self, directory: Path, service: str = SERVICE,
                 flavour: Flavour = REDIS) -> None:
        self.directory = Path(directory)
        self.service = service
        self.flavour = flavour
        ports = free_ports(2 + SENTINELS)
        self.primary_port, self.replica_port = ports[0], ports[1]
        self.sentinel_ports = ports[2:]
        self.started: list[int] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"{self.flavour.name}+sentinel://{hosts}/{self.service}/0"

    def _pidfile(self, port: int) -> Path:
        return self.directory / f"redis-{port}.pid"

    def _launch(self, port: int, config: Path, *extra: str) -> None:
        # A config file, when given, comes first on a redis-server command line; a sentinel
        # must have one (it writes what it learns into it).
        subprocess.run(
            [self.flavour.server, str(config), "--port", str(port), "--bind", "127.0.0.1",
             "--dir", str(self.directory), "--daemonize", "yes",
             "--pidfile", str(self._pidfile(port)),
             "--logfile", str(self.directory / f"redis-{port}.log"), *extra],
            check=True, capture_output=True, timeout=10,
        )
        self.started.append(port)

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        data = ("--save", "", "--appendonly", "no")
        empty = self.directory / "data.conf"
        empty.touch()
        self._launch(self.primary_port, empty, *data)
        self._launch(self.replica_port, empty, *data,
                     "--replicaof", "127.0.0.1", str(self.primary_port))
        deadline = time.monotonic() + _TIMEOUT
        self._wait(deadline, lambda: _replication(self.replica_port)
                   .get("master_link_status") == "up", "replica in sync")
        for port in self.sentinel_ports:
            config = self.directory / f"sentinel-{port}.conf"
            config.write_text(
                f"sentinel monitor {self.service} 127.0.0.1 {self.primary_port} 2\n"
                f"sentinel down-after-milliseconds {self.service} 1000\n"
                f"sentinel failover-timeout {self.service} 10000\n"
                f"sentinel parallel-syncs {self.service} 1\n"
            )
            self._launch(port, config, "--sentinel")
        for port in self.sentinel_ports:
            self._wait(deadline, lambda p=port: self._knows_everyone(p),  # type: ignore[misc]
                       f"sentinel {port} discovery")

    def _knows_everyone(self, port: int) -> bool:
        client = _client(port)
        try:
            replicas = client.execute_command("SENTINEL", "REPLICAS", self.service)
            others = client.execute_command("SENTINEL", "SENTINELS", self.service)
        finally:
            client.close()
        return len(replicas) == 1 and len(others) == SENTINELS - 1

    def primary(self) -> int:
        """The port of the primary the sentinels name now."""
        client = _client(self.sentinel_ports[0])
        try:
            _, port = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
        finally:
            client.close()
        return int(port)

    def failover(self) -> tuple[int, int]:
        """SENTINEL FAILOVER; returns (old primary, new primary) once the switch is done:
        every sentinel names the new one, it is writable, and the old one follows it."""
        old = self.primary()
        client = _client(self.sentinel_ports[0])
        try:
            client.execute_command("SENTINEL", "FAILOVER", self.service)
        finally:
            client.close()
        new = self.replica_port if old == self.primary_port else self.primary_port
        deadline = time.monotonic() + _TIMEOUT
        self._wait(deadline, lambda: all(self._names(port) == new
                                         for port in self.sentinel_ports), "switch")
        self._wait(deadline, lambda: _replication(new)["role"] == "master", "new primary")
        self._wait(deadline, lambda: _replication(old).get("master_port") == new,
                   "old primary following")
        return old, new

    def _names(self, sentinel_port: int) -> int:
        client = _client(sentinel_port)
        try:
            _, port = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
        finally:
            client.close()
        return int(port)

    @staticmethod
    def _wait(deadline: float, ready: Callable[[], bool], what: str) -> None:
        last: object = None
        while time.monotonic() < deadline:
            try:
                if ready():
                    return
            except (redis.RedisError, KeyError, ValueError) as exc:
                last = exc
            time.sleep(0.05)
        raise RuntimeError(f"sentinel setup: {what} not reached in time ({last})")

    def stop(self) -> None:
        stop_servers(self.started, self.directory)
        self.started = []
