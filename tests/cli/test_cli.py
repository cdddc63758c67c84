"""The ratelimit-mw command line against the real Redis and the 3-node cluster.

Commands run in process through ``main(argv)`` (output captured), and once as a subprocess
(``python -m ratelimit_mw``), as an operator would.
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

import ratelimit_mw as rl
from ratelimit_mw.cli import EXIT_BAD_INPUT, EXIT_OK, EXIT_STORE_DOWN, main
from ratelimit_mw.cli.args import resolve_policy
from ratelimit_mw.core.identity import encode_identity

SHARED_URL = os.environ.get("RATELIMIT_REDIS_URL", "redis://127.0.0.1:6379/0")
TIERS = "5/minute;100/day"


class Ran:
    def __init__(self, code: int, out: str, err: str) -> None:
        self.code, self.out, self.err = code, out, err

    @property
    def json(self) -> Any:
        return json.loads(self.out)


def cli(*argv: str) -> Ran:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), stdout=out, stderr=err)
    return Ran(code, out.getvalue(), err.getvalue())


@pytest.fixture(params=["redis", pytest.param("cluster", marks=pytest.mark.cluster)])
def store_url(request: pytest.FixtureRequest) -> str:
    if request.param == "cluster":
        return str(request.getfixturevalue("redis_cluster_url"))
    return SHARED_URL


@pytest.fixture
def store(store_url: str, prefix: str) -> Iterator[rl.Limiter]:
    backend = rl.RedisBackend.from_url(store_url, socket_timeout=2, socket_connect_timeout=2)
    yield rl.Limiter(backend, prefix=prefix, deny_cache=0)
    backend.close()


def on(store_url: str, prefix: str, *argv: str) -> Ran:
    return cli(*argv, "--url", store_url, "--prefix", prefix)


@pytest.fixture
def policies_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module of the user's, importable from the current directory as POLICY names it."""
    package = tmp_path / "ops_policies_app"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "limits.py").write_text(textwrap.dedent("""
        import ratelimit_mw as rl
        LOGIN = rl.Policy("1/minute;3/hour", algorithm="fixed-window", name="login",
                          penalty=600)
        NOT_A_POLICY = "1/minute"
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "ops_policies_app", raising=False)
    monkeypatch.delitem(sys.modules, "ops_policies_app.limits", raising=False)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    return "ops_policies_app.limits"


def user_policy(reference: str) -> rl.Policy:
    """The Policy object the CLI imports for POLICY (the same module, the same object)."""
    return resolve_policy(reference, None, None, None)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- inspect ---------------------------------------------------------------------------------
def test_inspect_reports_every_tier_and_records_nothing(
    store: rl.Limiter, store_url: str, prefix: str,
) -> None:
    for _ in range(3):
        assert store.hit(TIERS, "user:42")
    first = on(store_url, prefix, "inspect", TIERS, "user:42", "--json")
    again = on(store_url, prefix, "inspect", TIERS, "user:42", "--json")
    assert first.code == EXIT_OK, first.err
    report = first.json
    assert report["allowed"] is True and report["ban"] is None
    assert [(t["rate"], t["used"], t["remaining"]) for t in report["tiers"]] == [
        ("5/minute", 3, 2), ("100/day", 3, 97)]
    assert all(0 < t["reset_after"] <= 86_400 for t in report["tiers"])
    assert report["policy"] == {"name": TIERS, "algorithm": "sliding-log",
                                "rates": TIERS.split(";")}
    # Two inspections later, the store still holds three hits: inspect recorded nothing.
    assert [t["used"] for t in again.json["tiers"]] == [3, 3]
    assert store.peek(TIERS, "user:42").remaining == 2


def test_inspect_shows_a_refusal_with_its_retry_time(
    store: rl.Limiter, store_url: str, prefix: str,
) -> None:
    policy = rl.Policy("2/minute", algorithm="gcra", name="api")
    for _ in range(2):
        assert store.hit(policy, "k")
    ran = on(store_url, prefix, "inspect", "2/minute", "k", "--algorithm", "gcra",
             "--name", "api")
    assert ran.code == EXIT_OK, ran.err
    assert "next hit  REFUSED" in ran.out
    assert "2/minute" in ran.out and "2/2" in ran.out
    (tier,) = on(store_url, prefix, "inspect", "2/minute", "k", "--algorithm", "gcra",
                 "--name", "api", "--json").json["tiers"]
    assert tier["allowed"] is False and 0 < tier["retry_after"] <= 30
    assert tier["retry_at"] is not None


def test_inspect_of_a_policy_in_the_user_code_shows_the_ban_and_its_end(
    store: rl.Limiter, store_url: str, prefix: str, policies_module: str,
) -> None:
    LOGIN = user_policy(f"{policies_module}:LOGIN")
    assert store.hit(LOGIN, "ip:203.0.113.7")
    assert not store.hit(LOGIN, "ip:203.0.113.7")  # refused: banned for 600 s
    report = on(store_url, prefix, "inspect", f"{policies_module}:LOGIN", "ip:203.0.113.7",
                "--json").json
    assert report["allowed"] is False
    assert 590 < report["ban"]["left"] <= 600
    assert report["ban"]["ends_at"] > report["now"]
    # The same counters named by rate text (no penalty in it): the ban is read all the same.
    by_text = on(store_url, prefix, "inspect", "1/minute;3/hour", "ip:203.0.113.7",
                 "--algorithm", "fixed-window", "--name", "login")
    assert "ban       until" in by_text.out and "REFUSED" in by_text.out
    # Under the ban the limiter answers "nothing remains": the tiers say banned, not counts.
    assert [t["banned"] for t in report["tiers"]] == [True, True]
    assert "1/minute  banned" in on(store_url, prefix, "inspect", f"{policies_module}:LOGIN",
                                    "ip:203.0.113.7").out


def test_a_hashed_identity_is_inspected_by_its_original_value(
    store: rl.Limiter, store_url: str, prefix: str,
) -> None:
    identity = "user agent {curly} " + "x" * 80
    assert store.hit("3/minute", identity)
    report = on(store_url, prefix, "inspect", "3/minute", identity, "--json").json
    assert report["stored_as"] == encode_identity(identity) and report["stored_as"][0] == "#"
    assert report["tiers"][0]["used"] == 1


# -- reset -----------------------------------------------------------------------------------
def test_reset_forgets_counters_and_the_ban_and_names_what_it_removed(
    store: rl.Limiter, store_url: str, prefix: str, policies_module: str,
) -> None:
    LOGIN = user_policy(f"{policies_module}:LOGIN")
    # On a clock one second into the hour, so that every key lives on in real time for at
    # least the 59 s its window has left: on Redis's clock a run near a minute's end saw the
    # minute's counter expire before the reset looked for it.
    start_of_hour = time.time() // 3600 * 3600 + 1.0
    store = rl.Limiter(store.backend, prefix=prefix, deny_cache=0,
                       clock=lambda: start_of_hour)
    store.hit(LOGIN, "ip:1")
    assert not store.hit(LOGIN, "ip:1")
    head = f"{prefix}:{{ip:1}}:login.fw:"
    # Named by rate text, with no penalty: the ban is lifted too, or it would go on refusing.
    ran = on(store_url, prefix, "reset", "1/minute;3/hour", "ip:1", "--algorithm",
             "fixed-window", "--name", "login", "--json")
    assert ran.code == EXIT_OK, ran.err
    assert sorted(ran.json["removed"]) == sorted([head + "60000", head + "3600000", head + "ban"])
    assert store.hit(LOGIN, "ip:1")  # admitted again
    store.reset(LOGIN, "ip:1")
    again = on(store_url, prefix, "reset", f"{policies_module}:LOGIN", "ip:1")
    assert again.code == EXIT_OK and again.out.startswith("nothing to reset")


def test_reset_of_a_sliding_log_names_its_one_log_once(
    store: rl.Limiter, store_url: str, prefix: str,
) -> None:
    store.hit(TIERS, "u")
    ran = on(store_url, prefix, "reset", TIERS, "u")
    assert ran.code == EXIT_OK
    assert f"removed 1 key(s):\n  {prefix}:{{u}}:{TIERS}.sl:log" in ran.out
    assert store.peek(TIERS, "u").remaining == 5


# -- list ------------------------------------------------------------------------------------
def test_list_finds_every_identity_on_every_node_by_scan(
    store: rl.Limiter, store_url: str, prefix: str,
) -> None:
    plain = [f"user:{i}" for i in range(12)]  # spread over the cluster's three primaries
    hashed = "a b c"  # a space is unsafe in a key: stored hashed
    for identity in [*plain, hashed]:
        store.hit("10/minute", identity)
    store.hit(rl.Policy("5/hour", algorithm="gcra", name="other"), "user:0")
    report = on(store_url, prefix, "list", "--json").json
    found = {e["identity"]: e for e in report["identities"]}
    assert set(found) == {*plain, encode_identity(hashed)}
    assert found["user:0"]["policies"] == ["10/minute (sliding-log)", "other (gcra)"]
    assert found[encode_identity(hashed)]["hashed"] is True
    assert "hashed" in report["note"] and report["truncated"] is False
    only = on(store_url, prefix, "list", "--policy", "5/hour", "--algorithm", "gcra",
              "--name", "other", "--json").json
    assert [e["identity"] for e in only["identities"]] == ["user:0"]


def test_inspect_says_when_nothing_is_stored_under_the_name_asked_for(
    store: rl.Limiter, store_url: str, prefix: str,
) -> None:
    # A decorator's counter is named after the view: inspecting by the rate text alone
    # finds nothing, and says so, naming what the identity does hold.
    decorated = rl.Policy("5/minute", name="route app.search 5/minute")
    store.hit(decorated, "ip:203.0.113.7")
    wrong = on(store_url, prefix, "inspect", "5/minute", "ip:203.0.113.7")
    assert wrong.code == EXIT_OK, wrong.err
    assert "nothing is stored for ip:203.0.113.7 under '5/minute'" in wrong.out
    assert "route app.search 5/minute (sliding-log)" in wrong.out
    assert on(store_url, prefix, "inspect", "5/minute", "ip:203.0.113.7",
              "--json").json["stored"] is False
    right = on(store_url, prefix, "inspect", "5/minute", "ip:203.0.113.7", "--name",
               "route app.search 5/minute", "--json").json
    assert right["stored"] is True and right["tiers"][0]["used"] == 1


def test_list_shows_a_decorated_limit_by_its_readable_name(
    store: rl.Limiter, store_url: str, prefix: str,
) -> None:
    store.hit(rl.Policy("5/minute", name="route app.search 5/minute"), "user:1")
    store.hit(rl.Policy("5/minute", name="x" * 60), "user:1")  # too long: hashed
    listed = on(store_url, prefix, "list", "--json").json["identities"][0]["policies"]
    assert "route app.search 5/minute (sliding-log)" in listed
    assert any(label.startswith("#") for label in listed)


def test_list_stops_at_its_limit_and_says_so(
    store: rl.Limiter, store_url: str, prefix: str,
) -> None:
    for i in range(5):
        store.hit("10/minute", f"u{i}")
    ran = on(store_url, prefix, "list", "--limit", "2")
    assert ran.code == EXIT_OK
    assert len(on(store_url, prefix, "list", "--limit", "2", "--json").json["identities"]) == 2
    assert "stopped at --limit 2" in ran.out
    assert on(store_url, prefix + "x", "list").out.startswith("no identity holds state")


# -- ping ------------------------------------------------------------------------------------
def test_ping_reports_version_topology_and_round_trip(store_url: str) -> None:
    ran = cli("ping", "--url", store_url, "--json")
    assert ran.code == EXIT_OK, ran.err
    report = ran.json
    cluster = store_url.startswith("redis+cluster")
    assert report["cluster"] is cluster and report["nodes"] == (3 if cluster else 1)
    assert report["version"] and report["version"][0].isdigit()
    assert report["rtt_ms"] >= 0 and len(report["script_sha"]) == 40
    text = cli("ping", "--url", store_url).out
    assert ("Redis Cluster" if cluster else "Redis") in text and "round trip" in text


# -- errors ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("argv", "says"), [
    (["inspect", "ten a minute", "u"], "cannot read the rate"),
    (["inspect", "5/minute", "u", "--tz", "Europe/Paris"], "tz= aligns fixed windows"),
    (["inspect", "5/minute", ""], "IDENTITY must not be empty"),
    (["inspect", "nosuchmodule_ops:LIMIT", "u"], "cannot import 'nosuchmodule_ops'"),
    (["list", "--limit", "0"], "--limit must be at least 1"),
    (["list", "--algorithm", "gcra"], "give it too"),
    (["ping", "--url", "memory://"], "the CLI reads a shared store"),
    (["ping", "--url", "127.0.0.1:6379"], "redis://"),
    (["ping", "--url", "redis://127.0.0.1:6379/abc"], "abc"),
    (["ping", "--timeout", "0"], "--timeout must be seconds above 0"),
    # NaN and infinity passed "<= 0" and ended in a traceback from the socket.
    (["ping", "--timeout", "nan"], "--timeout must be seconds above 0"),
    (["ping", "--timeout", "inf"], "--timeout must be seconds above 0"),
    (["ping", "--timeout", "1e300"], "at most 3600"),
    # An unclosed IPv6 bracket was a bare ValueError from urlsplit.
    (["ping", "--url", "redis://[::1:6379/0"], "goes in brackets"),
    (["ping", "--url", "redis+sentinel://[::1:26379/mymaster"], "goes in brackets"),
    (["ping", "--url", "redis+cluster://[::1:7000"], "goes in brackets"),
])
def test_bad_input_is_a_configuration_error_with_exit_code_2(argv: list[str], says: str) -> None:
    ran = cli(*argv)
    assert ran.code == EXIT_BAD_INPUT
    assert says in ran.err and ran.err.startswith("ratelimit-mw: error:")


def test_policies_in_user_code_are_checked(policies_module: str) -> None:
    missing = cli("inspect", f"{policies_module}:NOPE", "u")
    assert missing.code == EXIT_BAD_INPUT and "has no 'NOPE'" in missing.err
    wrong = cli("inspect", f"{policies_module}:NOT_A_POLICY", "u")
    assert wrong.code == EXIT_BAD_INPUT and "is a str, not a Policy" in wrong.err
    both = cli("reset", f"{policies_module}:LOGIN", "u", "--algorithm", "gcra")
    assert both.code == EXIT_BAD_INPUT and "carries its own" in both.err


def test_usage_mistakes_exit_2_as_argparse_does() -> None:
    assert cli().code == EXIT_BAD_INPUT
    assert cli("frobnicate").code == EXIT_BAD_INPUT
    assert cli("inspect", "5/minute").code == EXIT_BAD_INPUT


@pytest.mark.parametrize("scheme", ["redis", "redis+cluster"])
@pytest.mark.parametrize("argv", [["ping"], ["inspect", "5/minute", "u"], ["list"],
                                  ["reset", "5/minute", "u"]])
def test_a_store_that_is_down_is_exit_code_1(scheme: str, argv: list[str]) -> None:
    url = f"{scheme}://127.0.0.1:{_free_port()}/0"
    ran = cli(*argv, "--url", url, "--timeout", "0.2")
    assert ran.code == EXIT_STORE_DOWN
    assert ran.err.startswith(f"ratelimit-mw: cannot reach the store at {url}: ")
    assert len(ran.err.splitlines()) == 1 and "<redis" not in ran.err  # one line, no repr


def test_the_url_defaults_to_the_environment_and_hides_passwords(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RATELIMIT_REDIS_URL", f"redis://:s3cret@127.0.0.1:{_free_port()}/0")
    ran = cli("ping", "--timeout", "0.2")
    assert ran.code == EXIT_STORE_DOWN
    assert "s3cret" not in ran.err and ":***@127.0.0.1" in ran.err


def test_options_go_before_or_after_the_command(
    store: rl.Limiter, store_url: str, prefix: str,
) -> None:
    store.hit("5/minute", "u")
    before = cli("--url", store_url, "--prefix", prefix, "--json", "inspect", "5/minute", "u")
    after = cli("inspect", "5/minute", "u", "--url", store_url, "--prefix", prefix, "--json")
    assert before.json["tiers"][0]["used"] == after.json["tiers"][0]["used"] == 1


# -- as a program ----------------------------------------------------------------------------
def test_python_dash_m_runs_the_command_line(
    store: rl.Limiter, store_url: str, prefix: str,
) -> None:
    store.hit("5/minute", "user:7")
    done = subprocess.run(
        [sys.executable, "-m", "ratelimit_mw", "inspect", "5/minute", "user:7", "--json",
         "--prefix", prefix, "--url", store_url],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == EXIT_OK, done.stderr
    assert json.loads(done.stdout)["tiers"][0]["used"] == 1
    down = subprocess.run(
        [sys.executable, "-m", "ratelimit_mw", "ping", "--url",
         f"redis://127.0.0.1:{_free_port()}/0", "--timeout", "0.2"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert down.returncode == EXIT_STORE_DOWN and "cannot reach the store" in down.stderr


def test_the_console_script_is_declared() -> None:
    (script,) = [e for e in metadata.entry_points(group="console_scripts")
                 if e.name == "ratelimit-mw"]
    assert script.load() is main
