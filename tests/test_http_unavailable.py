"""A database that cannot be reached at the claim is answered 503 with ``Retry-After``.

Not Django's bare 500: a problem document (``database-unavailable``), so that a client that
follows docs/client-retries.md waits and retries with the same key. Nothing ran and nothing was
recorded. Real unreachable databases: an alias pointing at a closed port, and a connection whose
server session is terminated (PostgreSQL's ``pg_terminate_backend``, MariaDB's ``KILL``) before
the claim, or while the claim's statement runs (PostgreSQL). Through the decorator, the
middleware, DRF (the decorator on an ``APIView`` method and the mixin) and an ``async`` view.
One WARNING line names the cause; the traceback is at DEBUG.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.db import connection, connections
from django.test import Client, override_settings

from django_idempotency.models import IdempotencyRecord
from tests.db_proxy import repointed
from tests.lock_waits import session_of, wait_until_blocked
from tests.probes import effects, post

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.mysql,
    pytest.mark.django_db(transaction=True, databases=["default", "other", "repeatable_read"]),
]

MIDDLEWARE = "django_idempotency.http.middleware.IdempotencyMiddleware"
AUTH = "django.contrib.auth.middleware.AuthenticationMiddleware"

URLS = {
    "decorator": "/probe/effect/",
    "middleware": "/probe/mw/effect/",
    "drf-decorator": "/probe/drf/apiview/",
    "drf-mixin": "/probe/mw/drf/lease/",
    "async": "/probe/async/",
}


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def down() -> Iterator[str]:
    """The alias ``other``, pointed at a port of the test server's host that nobody listens on
    (and restored afterwards, so that the test database's flush reaches it)."""
    with repointed("other", closed_port(), connect_timeout=2):
        yield "other"


@pytest.fixture
def with_middleware() -> Iterator[None]:
    middleware = list(settings.MIDDLEWARE)
    middleware.insert(middleware.index(AUTH) + 1, MIDDLEWARE)
    with override_settings(MIDDLEWARE=middleware):
        yield


def assert_unavailable(response: Any) -> dict[str, Any]:
    assert response.status_code == 503, response.content
    assert response["Content-Type"] == "application/problem+json"
    assert response["Retry-After"] == "1"
    body: dict[str, Any] = json.loads(response.content)
    assert body["type"].endswith("/problems/#database-unavailable")
    assert body["status"] == 503
    # The driver's message (hosts, ports, database names) is for the log, not the client.
    assert "127.0.0.1" not in body["detail"] and "Error" not in body["detail"]
    return body


@pytest.mark.usefixtures("with_middleware")
@pytest.mark.parametrize("adapter", sorted(URLS))
def test_a_closed_port_is_answered_503_by_every_adapter(
    adapter: str, down: str, caplog: pytest.LogCaptureFixture
) -> None:
    key = f"down-{adapter}-{uuid.uuid4()}"
    with (
        override_settings(IDEMPOTENCY={"DATABASE": down, "PATHS": [r"^/probe/mw/"]}),
        caplog.at_level(logging.DEBUG, logger="django_idempotency"),
    ):
        response = post(Client(), URLS[adapter], key)
    assert_unavailable(response)
    assert effects(key=key) == 0  # the view never ran
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    line = warnings[0].getMessage()
    assert "idempotency unavailable" in line and "database=other" in line
    assert "OperationalError" in line  # the cause, named on the line
    assert warnings[0].exc_info is None  # no traceback at WARNING...
    assert any(r.levelno == logging.DEBUG and r.exc_info for r in caplog.records)  # ...at DEBUG


def terminate(session: int) -> None:
    """End ``session`` from another connection, as a server restart or a failover does."""
    with connections["repeatable_read"].cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT pg_terminate_backend(%s)", [session])
        else:
            cursor.execute(f"KILL {int(session)}")


@pytest.mark.parametrize("url", ["/probe/effect/", "/probe/drf/apiview/"])
def test_a_connection_killed_before_the_claim_is_answered_503_then_the_retry_runs(
    url: str,
) -> None:
    key = f"killed-{uuid.uuid4()}"
    terminate(session_of())  # the connection this thread's requests use, open and idle
    client = Client()
    assert_unavailable(post(client, url, key))
    assert effects(key=key) == 0
    assert not IdempotencyRecord.objects.filter(key=key).exists()  # a new connection reads it
    retried = post(client, url, key)  # the client waited Retry-After: the database is back
    assert retried.status_code == 201
    assert effects(key=key) == 1


def test_a_connection_cut_while_the_claim_runs_is_answered_503() -> None:
    """The claim's statement is running (it waits inside PostgreSQL for the records table,
    which the test holds locked) when its server session is terminated. (On MariaDB the
    claim's statements never wait on a lock, so there is no moment to hold it in.)"""
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL: a claim statement that waits on a table lock")
    key = f"cut-{uuid.uuid4()}"
    answers: list[Any] = []
    sessions: list[int] = []
    started = threading.Event()

    def request() -> None:
        try:
            sessions.append(session_of())
            started.set()
            answers.append(post(Client(), "/probe/effect/", key))
        finally:
            started.set()
            connections.close_all()

    with connections["repeatable_read"].cursor() as cursor:
        cursor.execute("BEGIN")
        table = IdempotencyRecord._meta.db_table
        cursor.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
        thread = threading.Thread(target=request)
        thread.start()
        assert started.wait(30) and sessions
        wait_until_blocked(sessions[0], "the claim")
        cursor.execute("SELECT pg_terminate_backend(%s)", [sessions[0]])
        cursor.execute("ROLLBACK")
    thread.join(30)
    assert len(answers) == 1
    assert_unavailable(answers[0])
    assert effects(key=key) == 0
    assert post(Client(), "/probe/effect/", key).status_code == 201
    assert effects(key=key) == 1


def test_a_statement_error_on_a_live_connection_is_not_503() -> None:
    """Only a lost connection is "unavailable": an error of a statement on a live connection
    (here a missing table) still reaches Django as an error, not a 503 that a client would
    retry for ever."""
    table = IdempotencyRecord._meta.db_table
    with connections["repeatable_read"].cursor() as cursor:
        cursor.execute(f"ALTER TABLE {table} RENAME TO {table}_away")
    try:
        with pytest.raises(Exception) as raised:
            post(Client(raise_request_exception=True), "/probe/effect/", "no-table")
        assert "503" not in str(raised.value)
        assert type(raised.value).__name__ in ("ProgrammingError", "OperationalError")
    finally:
        with connections["repeatable_read"].cursor() as cursor:
            cursor.execute(f"ALTER TABLE {table}_away RENAME TO {table}")
