"""``outages.connection_lost`` reads an error raised while a connection was being opened as a
lost database, even when the wrapper it is judged against holds a live connection by then.

A CI run's Celery outage test logged one delivery's "database error" at WARNING at the very end
of an outage: the delivery's connect failed (``database "..." is not currently accepting
connections``, no SQLSTATE in psycopg 3's error), the delivery was then counted on a new
connection, the database being back, and the error was judged against that live connection as
a statement's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.db import OperationalError, connection

from django_idempotency.outages import connection_lost, raised_by_connect

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def refusing_name(tmp_path) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """A database name the server refuses a session for (SQLite: a file that cannot be opened)."""
    if connection.vendor == "sqlite":
        yield str(tmp_path / "missing" / "db.sqlite3")
        return
    name = f"{connection.settings_dict['NAME']}_refusing"
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(f'DROP DATABASE IF EXISTS "{name}"')
            cursor.execute(f'CREATE DATABASE "{name}" WITH ALLOW_CONNECTIONS false')
        try:
            yield name
        finally:
            with connection.cursor() as cursor:
                cursor.execute(f'DROP DATABASE "{name}"')
    else:  # MariaDB: an unknown database (1049) is refused at the handshake
        yield name


def test_a_failed_connect_is_a_lost_database_while_another_connection_is_live(
    refusing_name: str,
) -> None:
    other = connection.copy()
    other.settings_dict = {**connection.settings_dict, "NAME": refusing_name}
    with pytest.raises(OperationalError) as raised:
        other.ensure_connection()
    connection.ensure_connection()  # judged against a wrapper holding a live connection
    assert connection.connection is not None
    assert raised_by_connect(raised.value)
    assert connection_lost(connection, raised.value)


def test_a_statement_error_on_a_live_connection_is_not_a_connect() -> None:
    with pytest.raises(Exception) as raised, connection.cursor() as cursor:
        cursor.execute("SELECT * FROM no_such_table_here")
    assert not raised_by_connect(raised.value)
    assert not connection_lost(connection, raised.value)
