"""A session the server ends because it sat idle (PostgreSQL's
``idle_in_transaction_session_timeout``, SQLSTATE ``25P03``, and ``idle_session_timeout``,
``57P05``; MariaDB's ``idle_transaction_timeout``) is a lost database for
``outages.connection_lost``, as a restart's ``57P01`` is: the caller answers ``503`` and the
retry runs on a new connection. Before, PostgreSQL's SQLSTATE made it read as a statement's own
error: ``25P03`` comes as an ``InternalError`` (class 25) when the next statement is sent
through Django's cursor (a phased flow's fence, a consumer's effect), and ``57P05`` as an
``OperationalError`` with a SQLSTATE outside the list; both were the driver's ``500``. (The
atomic-mode store goes through the pipelined round trip, whose error carries no SQLSTATE and
was already read by its words: the last test passed before too, and shows the whole answer.)"""

from __future__ import annotations

import time

import pytest
from django.db import DatabaseError, OperationalError, connection, transaction

from django_idempotency.outages import connection_lost

pytestmark = [
    pytest.mark.slow,  # each waits for the server to end an idle session (1-1.5 s)
    pytest.mark.postgres,
    pytest.mark.mysql,
    pytest.mark.django_db(transaction=True),
]

SETTINGS = {
    "postgresql": "SET SESSION idle_in_transaction_session_timeout = 200",  # milliseconds
    "mysql": "SET SESSION idle_transaction_timeout = 1",  # seconds (MariaDB)
}


def test_a_session_ended_for_idling_in_a_transaction_is_a_lost_database() -> None:
    with connection.cursor() as cursor:
        cursor.execute(SETTINGS[connection.vendor])
    judged: list[bool] = []
    with pytest.raises(DatabaseError), transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM django_migrations")  # a transaction, begun
        time.sleep(1.5)  # the server ends the session meanwhile
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1")
        except DatabaseError as exc:  # PostgreSQL: InternalError (class 25), MariaDB: 2013
            judged.append(connection_lost(connection, exc))  # judged where it is raised
            raise
    connection.close()
    assert judged == [True]


@pytest.mark.postgres
def test_a_session_ended_for_idling_outside_a_transaction_is_a_lost_database() -> None:
    if connection.vendor != "postgresql" or getattr(connection, "pg_version", 0) < 140000:
        pytest.skip("idle_session_timeout is PostgreSQL 14's")
    with connection.cursor() as cursor:
        cursor.execute("SET SESSION idle_session_timeout = 200")
    time.sleep(1.0)
    with pytest.raises(OperationalError) as raised, connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    assert connection_lost(connection, raised.value)
    connection.close()


@pytest.mark.postgres
def test_a_view_that_idles_past_the_timeout_is_503_and_the_retry_runs_it_once() -> None:
    """An atomic-mode view (claim, view and response in one transaction) that sits idle inside
    it for longer than ``idle_in_transaction_session_timeout``: the server ends the session,
    and storing the response fails with ``25P03``. That was the driver's ``InternalError``, a
    ``500``; it is ``503`` ``database-unavailable``, nothing took effect, and the retry (with a
    view that no longer idles) runs once."""
    if connection.vendor != "postgresql":
        pytest.skip("idle_in_transaction_session_timeout is PostgreSQL's")
    from django.http import HttpRequest, HttpResponse, JsonResponse
    from django.test import RequestFactory

    from django_idempotency.http.decorators import idempotent
    from testproject.shop.models import Effect

    idle = [1.0]

    @idempotent
    def view(request: HttpRequest) -> HttpResponse:
        effect = Effect.objects.create(name="idle", payload=request.headers["Idempotency-Key"])
        with connection.cursor() as cursor:
            cursor.execute(SETTINGS["postgresql"])
        time.sleep(idle.pop() if idle else 0)
        return JsonResponse({"effect": effect.pk}, status=201)

    key = f"idle-{time.monotonic_ns()}"

    def post() -> HttpResponse:  # a new request each time, as from a client
        request = RequestFactory().post(
            "/idle/", b"{}", content_type="application/json", headers={"Idempotency-Key": key}
        )
        return view(request)

    first = post()
    assert first.status_code == 503, first.content
    assert first["Content-Type"] == "application/problem+json" and first["Retry-After"]
    assert not Effect.objects.filter(payload=key).exists()
    connection.close()  # as the request's end does
    second = post()
    assert second.status_code == 201, second.content
    assert Effect.objects.filter(payload=key).count() == 1
    assert post().content == second.content  # replayed
    connection.close()  # its session's timeout goes with it


@pytest.mark.postgres
def test_postgresql_17s_transaction_timeout_is_a_lost_database_too() -> None:
    """PostgreSQL 17's ``transaction_timeout`` ends the session with ``25P04``, raised as an
    ``InternalError`` like ``25P03`` (the server here may be older: the error is built as
    psycopg builds it); ``25P02`` (a statement after a failed one) stays a statement's."""
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's SQLSTATEs")
    import psycopg
    from django.db import InternalError

    def wrapped(sqlstate: str) -> InternalError:
        # As psycopg's class for it (older psycopg has no class for 25P04: built alike).
        kind = type(f"E{sqlstate}", (psycopg.errors.InternalError,), {"sqlstate": sqlstate})
        driver = kind("the server said so")
        error = InternalError(str(driver))
        error.__cause__ = driver
        return error

    connection.ensure_connection()
    assert connection_lost(connection, wrapped("25P04"))
    assert connection_lost(connection, wrapped("25P03"))
    assert not connection_lost(connection, wrapped("25P02"))
