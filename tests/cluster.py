"""A private Redis Cluster for the tests: three masters on free loopback ports.

`LocalCluster(directory).start()` launches the servers (daemonized, no persistence), joins
them with ``redis-cli --cluster create`` and waits for ``cluster_state:ok``; `stop()` shuts
down every server it started (by its own pid as a last resort) and removes the directory.
Never touches the shared Redis on 6379. ``flavour=valkey()`` runs Valkey's binaries instead
(tests/servers.py). ``replicas=1`` gives each master a replica (``node_timeout`` in ms: how
soon a replica takes over a master that stops answering); `pause(port)` freezes a server
(SIGSTOP: hung, not dead) until `resume(port)` or `stop()`, which resumes every paused one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from servers import REDIS, Flavour

MASTERS = 3
_START_TIMEOUT = 30.0


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int) -> list[int]:
    """Ports free now whose cluster-bus twin (port + 10000) is free too."""
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port + 10_000 <= 65_535 and port not in ports and _port_free(port + 10_000):
            ports.append(port)
    return ports


class LocalCluster:
    def __init__(self, directory: Path, masters: int = MASTERS,
                 flavour: Flavour = REDIS, replicas: int = 0,
                 node_timeout: int | None = None, options: tuple[str, ...] = ()) -> None:
        self.directory = Path(directory)
        self.flavour = flavour
        self.replicas = replicas
        self.node_timeout = node_timeout
        self.options = options  # more of the server's command line
        self.ports = free_ports(masters * (1 + replicas))
        self.started: list[int] = []
        self.paused: set[int] = set()

    @property
    def url(self) -> str:
        return f"{self.flavour.name}+cluster://127.0.0.1:{self.ports[0]}/0"

    @property
    def plain_url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def _pidfile(self, port: int) -> Path:
        return self.directory / f"redis-{port}.pid"

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        for port in self.ports:
            subprocess.run(
                [
                    self.flavour.server, "--port", str(port), "--bind", "127.0.0.1",
                    "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                    "--dir", str(self.directory), "--save", "", "--appendonly", "no",
                    "--daemonize", "yes", "--pidfile", str(self._pidfile(port)),
                    "--logfile", str(self.directory / f"redis-{port}.log"),
                    *(() if self.node_timeout is None
                      else ("--cluster-node-timeout", str(self.node_timeout))),
                    *self.options,
                ],
                check=True, capture_output=True, timeout=10,
            )
            self.started.append(port)
        deadline = time.monotonic() + _START_TIMEOUT
        for port in self.ports:
            self._wait(port, deadline, lambda c: bool(c.ping()))
        subprocess.run(
            [self.flavour.cli, "--cluster", "create",
             *(f"127.0.0.1:{port}" for port in self.ports),
             "--cluster-replicas", str(self.replicas), "--cluster-yes"],
            check=True, capture_output=True, timeout=_START_TIMEOUT,
        )
        for port in self.ports:
            self._wait(port, deadline, _cluster_ok)
        for port in self.primaries():  # each replica has the data and follows its master
            self._wait(port, deadline, lambda c: _replicas_online(c) >= self.replicas)

    def nodes(self, port: int | None = None) -> list[dict[str, str]]:
        """CLUSTER NODES as one server (a running one by default) sees it: each node's
        ``port``, ``id``, ``flags`` and ``master`` (its master's id, or "-")."""
        port = port or next(p for p in self.started if p not in self.paused)
        client = redis.Redis(port=port, socket_timeout=2, decode_responses=True)
        try:
            parsed = client.cluster("NODES")  # redis-py: {"host:port@bus": {...}}
        finally:
            client.close()
        rows = []
        for address, node in parsed.items():
            rows.append({"id": node["node_id"], "flags": node["flags"],
                         "master": node["master_id"],
                         "port": address.split("@")[0].rsplit(":", 1)[1]})
        return rows

    def primaries(self, port: int | None = None) -> list[int]:
        """The ports of the masters, as one server sees it (failed ones included)."""
        return sorted(int(row["port"]) for row in self.nodes(port)
                      if "master" in row["flags"].split(","))

    def replica_of(self, primary: int) -> int:
        """The port of a master's replica."""
        rows = self.nodes()
        master_id = next(row["id"] for row in rows if int(row["port"]) == primary)
        return next(int(row["port"]) for row in rows if row["master"] == master_id)

    def pid(self, port: int) -> int:
        return int(self._pidfile(port).read_text().strip())

    def pause(self, port: int) -> None:
        """SIGSTOP the server: it still accepts TCP connections (the kernel does), answers
        nothing, and its peers see it fail after ``node_timeout``."""
        os.kill(self.pid(port), signal.SIGSTOP)
        self.paused.add(port)

    def resume(self, port: int) -> None:
        with contextlib.suppress(OSError, ValueError):
            os.kill(self.pid(port), signal.SIGCONT)
        self.paused.discard(port)

    @staticmethod
    def _wait(port: int, deadline: float, ready: object) -> None:
        last: object = None
        while time.monotonic() < deadline:
            client = redis.Redis(port=port, socket_timeout=1)
            try:
                if ready(client):  # type: ignore[operator]
                    return
            except redis.RedisError as exc:
                last = exc
            finally:
                client.close()
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {port} not ready in time ({last})")

    def stop(self) -> None:
        for port in list(self.paused):  # a paused server would never read its SHUTDOWN
            self.resume(port)
        stop_servers(self.started, self.directory)
        self.started = []


def stop_servers(ports: list[int], directory: Path) -> None:
    """Shut down the redis-servers this test run started (pid files `redis-PORT.pid` in
    `directory`), kill any that outlive five seconds, and remove the directory."""
    for port in ports:
        # No retries: the server hangs up as it exits, and redis-py's default retries
        # with backoff would spend seconds reconnecting to it.
        client = redis.Redis(port=port, socket_timeout=2, retry=Retry(NoBackoff(), 0))
        try:
            client.shutdown(nosave=True)
        except redis.RedisError:
            pass  # the server closes the connection as it exits: expected
        finally:
            client.close()
    deadline = time.monotonic() + 5
    for port in ports:
        pidfile = directory / f"redis-{port}.pid"
        while pidfile.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        if pidfile.exists():  # still alive: end the process we started, by its own pid
            with contextlib.suppress(ValueError, OSError):
                os.kill(int(pidfile.read_text().strip()), signal.SIGKILL)
    shutil.rmtree(directory, ignore_errors=True)


def _replicas_online(client: redis.Redis) -> int:
    info = client.info("replication")
    return sum(1 for key, value in info.items() if key.startswith("slave")
               and isinstance(value, dict) and value.get("state") == "online")


def _cluster_ok(client: redis.Redis) -> bool:
    info = client.cluster("INFO")
    if isinstance(info, (bytes, str)):  # older redis-py returns the raw text
        text = info.decode() if isinstance(info, bytes) else info
        info = dict(line.split(":", 1) for line in text.split() if ":" in line)
    return info.get("cluster_state") == "ok" and str(info.get("cluster_slots_ok")) == "16384"
