"""Shared fixtures: which database the run is on, and which services can be reached.

A test that needs PostgreSQL or MariaDB is marked ``postgres`` or ``mysql`` and runs in that
backend's pass of the test command. A test that needs Redis or RabbitMQ asks for
:func:`require_service`; when the service is down it is skipped, loudly, or fails when
``REQUIRE_SERVICES=1`` (CI).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
from django.db import connection

from tests.services import BROKER_URLS, reachable

if TYPE_CHECKING:
    from tests.kafka_cluster import Cluster
    from tests.kafka_mock import MockCluster
    from tests.psp import Provider

REQUIRE_SERVICES = os.environ.get("REQUIRE_SERVICES") == "1"
PGBOUNCER = os.environ.get("PGBOUNCER") == "1"
#: The PostgreSQL server behind PgBouncer, reached directly to close the pooler's server
#: connections to the test database (a DROP DATABASE fails while they are open).
PGBOUNCER_DIRECT_URL = os.environ.get(
    "PGBOUNCER_DIRECT_URL", "postgres://postgres@127.0.0.1:5432/postgres"
)
UNREACHABLE = "SERVICE UNREACHABLE"
VENDOR_MARKS = {"postgres": "postgresql", "mysql": "mysql", "sqlite": "sqlite"}


def require_service(name: str) -> None:
    """Skip (or, with REQUIRE_SERVICES=1, fail) unless the service answers."""
    if reachable(name):
        return
    message = f"{UNREACHABLE}: {name}"
    if REQUIRE_SERVICES:
        pytest.fail(f"{message} (REQUIRE_SERVICES=1)")
    pytest.skip(message)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "sqlite: runs only in the SQLite pass")
    from tests import fast_flush

    fast_flush.install()


def close_pooled_server_connections() -> None:
    """PGBOUNCER=1: end PgBouncer's server connections to the test database, directly.

    PgBouncer keeps server connections open after its clients leave, so Django's ``DROP
    DATABASE`` of the test database (at the end of the run, or of a leftover one at the start)
    would fail with "database is being accessed by other users". The pooler notices the closed
    connections and opens new ones when a client needs them.
    """
    import psycopg
    from django.conf import settings

    name = settings.DATABASES["default"]["TEST"]["NAME"]
    with psycopg.connect(PGBOUNCER_DIRECT_URL, autocommit=True) as direct:
        direct.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()",
            [name],
        )


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup: None) -> Iterator[None]:
    """pytest-django's test database; behind PgBouncer, its pooled connections are closed
    before the test database is created and before it is dropped."""
    yield
    if PGBOUNCER:
        from django.db import connections

        connections.close_all()
        close_pooled_server_connections()


@pytest.fixture(scope="session", autouse=True)
def mysql_server_data(django_db_blocker: Any) -> None:
    """Read each MySQL/MariaDB alias's server data (version, modes) once, before any test.

    Since Django 6.0 a field's type on MySQL depends on the server (``has_native_uuid_field``),
    so the system checks (``run_checks()``, which a test may call without database access)
    ask every alias's server, the ``repeatable_read`` mirror's too. Unread, it was read by
    whichever test came first in a worker: a check test that came first failed with
    "Database access not allowed". Read here, it is cached on each connection for the run.
    """
    from django.db import connections

    with django_db_blocker.unblock():
        for alias in connections:
            connection = connections[alias]
            if connection.vendor == "mysql":
                connection.mysql_server_data  # noqa: B018 - a cached property, read to cache it


def pytest_sessionstart(session: pytest.Session) -> None:
    from tests import leaks

    leaks.install()
    if PGBOUNCER:
        import django

        django.setup()
        close_pooled_server_connections()  # a leftover test database from an earlier run


def _printable(text: str) -> str:
    """``text`` with its lone surrogates escaped (``\\udce9``): pytest-xdist's workers send
    their reports as UTF-8, and a test of bad input may log a lone surrogate."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    report.sections = [(title, _printable(text)) for title, text in report.sections]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield
    from tests import leaks

    leaks.stop_leftovers()  # a relay that outlived its test sends the next test's rows


def pytest_runtest_setup(item: pytest.Item) -> None:
    wanted = [VENDOR_MARKS[m.name] for m in item.iter_markers() if m.name in VENDOR_MARKS]
    if wanted and connection.vendor not in wanted:
        pytest.skip(f"runs in the {' or '.join(wanted)} pass, this is {connection.vendor}")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    unreachable = [
        report
        for report in terminalreporter.stats.get("skipped", [])
        if UNREACHABLE in str(report.longrepr)
    ]
    if unreachable:
        terminalreporter.section("UNREACHABLE SERVICES", sep="!", red=True, bold=True)
        terminalreporter.write_line(
            f"{len(unreachable)} tests were SKIPPED because a service could not be reached. "
            "Set REQUIRE_SERVICES=1 to make this a failure.",
            red=True,
            bold=True,
        )


@pytest.fixture
def remote_calls() -> Iterator[Counter[str]]:
    """The calls the probe flows made to their fake remote system, empty before and after."""
    from testproject.shop.probe_flows import REMOTE_CALLS

    REMOTE_CALLS.clear()
    yield REMOTE_CALLS
    REMOTE_CALLS.clear()


@pytest.fixture(scope="module")
def psp_server() -> Iterator[Provider]:
    """The fake payment provider of ``tests/psp.py``, a real HTTP server, for a module's tests
    (a gunicorn started for the module reads its URL from ``PSP_URL`` in the environment)."""
    from tests.psp import provider

    with provider() as running:
        yield running


@pytest.fixture
def psp(psp_server: Provider) -> Iterator[Provider]:
    """The provider, with nothing left from an earlier test, and ``PSP_URL`` set."""
    from django.test import override_settings

    psp_server.reset()
    with override_settings(PSP_URL=psp_server.url):
        yield psp_server


@pytest.fixture
def null_default_transport() -> Iterator[None]:
    """``OUTBOX_TRANSPORTS["default"]`` is :class:`tests.outbox_helpers.NullTransport`, which
    takes any payload, for tests of the outbox itself that ``send()`` plain topic messages."""
    from django.conf import settings
    from django.test import override_settings

    from tests.outbox_helpers import NULL_TRANSPORTS

    transports = {**settings.IDEMPOTENCY.get("OUTBOX_TRANSPORTS", {}), **NULL_TRANSPORTS}
    with override_settings(IDEMPOTENCY={**settings.IDEMPOTENCY, "OUTBOX_TRANSPORTS": transports}):
        yield


@pytest.fixture(scope="session")
def kafka_cluster() -> Iterator[Cluster]:
    """A Kafka cluster for the whole run: librdkafka's mock cluster, or the broker named by
    ``KAFKA_BOOTSTRAP_SERVERS`` (see tests/kafka_cluster.py)."""
    pytest.importorskip("confluent_kafka")
    from tests.kafka_cluster import Cluster

    kafka = Cluster()
    yield kafka
    kafka.close()


@pytest.fixture(scope="session")
def kafka_mock() -> Iterator[MockCluster]:
    """librdkafka's mock cluster driven through its C API (tests/kafka_mock.py): its consumer
    groups form at once, and its brokers refuse requests when a test asks."""
    pytest.importorskip("confluent_kafka")
    from tests.kafka_mock import mock_cluster

    with mock_cluster() as cluster:
        yield cluster


@pytest.fixture(params=sorted(BROKER_URLS))
def broker_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A real broker URL, once for Redis and once for RabbitMQ."""
    require_service(request.param)
    yield BROKER_URLS[request.param]
