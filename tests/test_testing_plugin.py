"""The pytest plugin in ratelimit_mw.testing, run as an app's own suite would run it (pytester):
``ratelimit`` is set up before the test's other fixtures whatever the argument order, the
deny caches are emptied between tests, and the off switch ends with the test.
"""

from __future__ import annotations

import uuid

import pytest
from support import HOUSEKEEPER, REDIS_URL

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True)
def _ini(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")

# An app whose lifespan pings its store, as a start-up check does; the store is a closed port.
_APP_PINGING_A_CLOSED_PORT = """
    import contextlib

    import pytest
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    import ratelimit_mw as rl
    from ratelimit_mw.asgi import RateLimitMiddleware

    def build():
        limiter = rl.AsyncLimiter(rl.AsyncRedisBackend.from_url(
            "redis://127.0.0.1:1", socket_timeout=0.05, socket_connect_timeout=0.05))

        @contextlib.asynccontextmanager
        async def lifespan(app):
            await limiter.ping()  # BackendError against the closed port
            yield

        async def hello(request):
            return PlainTextResponse("hi")

        app = Starlette(routes=[Route("/", hello)], lifespan=lifespan)
        return RateLimitMiddleware(app, limiter, default="2/minute")

    APP = build()  # built at import, as an app module is

    @pytest.fixture
    def client():
        with TestClient(APP) as client:
            yield client

    @pytest.fixture
    def factory_client():
        with TestClient(build()) as client:  # an app factory called by the fixture
            yield client
"""


@pytest.mark.parametrize("signature", ["client, ratelimit", "ratelimit, client",
                                       "factory_client, ratelimit"])
def test_ratelimit_is_set_up_before_a_fixture_that_pings_the_store_whatever_the_order(
        pytester: pytest.Pytester, signature: str) -> None:
    pytester.makepyfile(_APP_PINGING_A_CLOSED_PORT + f"""
    def test_limited({signature}):
        client = {signature.replace("ratelimit", "").strip(", ")}
        assert [client.get("/").status_code for _ in range(3)] == [200, 200, 429]
    """)
    result = pytester.runpytest("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_ratelimit_comes_first_and_the_other_fixtures_keep_their_order(
        pytester: pytest.Pytester) -> None:
    pytester.makepyfile("""
    import pytest

    ORDER = []

    @pytest.fixture(scope="module")
    def wide():
        ORDER.append("wide")

    @pytest.fixture
    def first(wide):
        ORDER.append("first")

    @pytest.fixture
    def second():
        ORDER.append("second")

    @pytest.fixture
    def ratelimit(ratelimit):  # a conftest's own fixture of the same name, over the plugin's
        ORDER.append("ratelimit")
        return ratelimit

    def test_order(first, second, ratelimit):
        assert ORDER == ["ratelimit", "wide", "first", "second"]
    """)
    pytester.runpytest("-q", "-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_a_refusal_remembered_in_one_test_does_not_answer_the_next_once_its_keys_are_gone(
        pytester: pytest.Pytester) -> None:
    prefix = "tpl" + uuid.uuid4().hex[:10]
    HOUSEKEEPER.record(prefix)
    pytester.makepyfile(f"""
    import redis

    import ratelimit_mw as rl

    # Remembers a refusal for up to a minute: far longer than the gap between two tests.
    LIMITER = rl.Limiter(rl.RedisBackend.from_url({REDIS_URL!r}), prefix={prefix!r},
                         deny_cache_max_age=60)
    POLICY = rl.Policy("1/hour", algorithm="fixed-window")

    def test_refused_then_deletes_its_keys():
        assert LIMITER.hit(POLICY, "u").allowed
        assert not LIMITER.hit(POLICY, "u").allowed
        assert len(LIMITER._deny) == 1  # the refusal is remembered in process
        client = redis.Redis.from_url({REDIS_URL!r})
        client.delete(*client.scan_iter({prefix!r} + ":*"))
        client.close()

    def test_admitted_on_the_emptied_store():
        assert LIMITER.hit(POLICY, "u").allowed
        LIMITER.reset(POLICY, "u")
    """)
    pytester.runpytest("-q", "-p", "no:cacheprovider").assert_outcomes(passed=2)


def test_limiting_switched_off_in_one_test_is_on_again_in_the_next(
        pytester: pytest.Pytester) -> None:
    pytester.makepyfile("""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    import ratelimit_mw as rl
    from ratelimit_mw.asgi import RateLimitMiddleware

    async def hello(request):
        return PlainTextResponse("hi")

    APP = RateLimitMiddleware(Starlette(routes=[Route("/", hello)]), rl.AsyncLimiter(),
                              default="1/minute")

    def test_switches_off_and_leaves_it_off(ratelimit):
        ratelimit.disable()
        with TestClient(APP) as client:
            assert [client.get("/").status_code for _ in range(2)] == [200, 200]

    def test_limited_again(ratelimit):
        with TestClient(APP) as client:
            assert [client.get("/").status_code for _ in range(2)] == [200, 429]
    """)
    pytester.runpytest("-q", "-p", "no:cacheprovider").assert_outcomes(passed=2)


def test_an_autouse_fixture_in_conftest_isolates_every_test_of_a_suite(
        pytester: pytest.Pytester) -> None:
    # The recipe docs/testing.md gives: tests that never name `ratelimit` are isolated too,
    # each in a memory of its own (the counts do not carry from one test to the next).
    pytester.makeconftest("""
    import pytest

    from ratelimit_mw.testing import Isolation

    @pytest.fixture(autouse=True)
    def _ratelimit_isolated(ratelimit: Isolation) -> None:
        pass
    """)
    pytester.makepyfile(_APP_PINGING_A_CLOSED_PORT + """
    def test_one(client):
        assert [client.get("/").status_code for _ in range(3)] == [200, 200, 429]

    def test_two(client):
        assert [client.get("/").status_code for _ in range(3)] == [200, 200, 429]
    """)
    pytester.runpytest("-q", "-p", "no:cacheprovider").assert_outcomes(passed=2)


def test_without_the_fixture_a_test_reaches_the_apps_real_store(
        pytester: pytest.Pytester) -> None:
    # What the recipe above is for: the same app, no fixture, fails on its lifespan's ping.
    pytester.makepyfile(_APP_PINGING_A_CLOSED_PORT + """
    def test_one(client):
        client.get("/")
    """)
    pytester.runpytest("-q", "-p", "no:cacheprovider").assert_outcomes(errors=1)
