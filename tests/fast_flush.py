"""A cheaper end to a transactional test: ``DELETE`` the rows instead of Django's flush.

After each ``django_db(transaction=True)`` test, Django's ``TransactionTestCase`` runs the
``flush`` command: a ``TRUNCATE`` of every table on PostgreSQL (a ``DELETE`` of each elsewhere),
then the ``post_migrate`` signal, which writes the content types and permissions again. On a
test database of a few rows, that is most of a transactional test's cost. Measured on this
project's test database, 30 empty transactional tests, 2 cores, 2026-12-01, seconds a test
(``DJANGO_FLUSH=1`` switches back to Django's flush)::

               Django's flush   empty_tables()
    PostgreSQL      0.322           0.037
    MariaDB         0.146           0.014
    SQLite          0.097           0.010

In ``make test-quick``'s PostgreSQL pass the teardowns went from 75 s to 13 s.

Here every table but the content types and permissions (which the ``post_migrate`` signal
would write again as they were) is emptied with ``DELETE``, in one transaction with the
foreign keys deferred (PostgreSQL) or unchecked (MariaDB, SQLite). The database ends as the
flush leaves it; the ids of the content types and permissions are kept rather than renumbered.
Those two tables are checked (their row count and highest id) against what the last flush
left: a test that added or deleted one of their rows gets Django's flush, which puts them back
as post_migrate writes them (and the first transactional test of a process on each database
gets it too, to take that measure).

Tests that ask for ``available_apps`` or ``serialized_rollback`` keep Django's own teardown.
This leans on ``TransactionTestCase._fixture_teardown`` and ``_databases_names``, private
Django APIs: the test suite runs on every supported Django version, and
``tests/test_fast_flush.py`` checks that the database ends empty.
"""

from __future__ import annotations

import os
from typing import Any

from django.core.management import call_command
from django.db import connections, transaction
from django.test import TransactionTestCase

# The rows post_migrate would write again as they are: kept, not deleted and recreated.
KEPT = frozenset({"django_content_type", "auth_permission"})

_django_teardown = TransactionTestCase._fixture_teardown

_kept_as_flushed: dict[str, tuple[Any, ...]] = {}
"""Per database alias, :func:`kept_state` right after Django's flush last ran on it."""


def kept_state(alias: str) -> tuple[Any, ...]:
    """The row count and highest id of each :data:`KEPT` table of ``alias``."""
    connection = connections[alias]
    quote = connection.ops.quote_name
    figures = ", ".join(
        f"(SELECT COUNT(*) FROM {quote(table)}), (SELECT MAX({quote('id')}) FROM {quote(table)})"
        for table in sorted(KEPT)
    )
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {figures}")
        return tuple(cursor.fetchone())


def flush(alias: str) -> None:
    """Django's flush of ``alias``, as its ``TransactionTestCase`` runs it, then the measure of
    the kept tables it leaves."""
    call_command(
        "flush",
        verbosity=0,
        interactive=False,
        database=alias,
        reset_sequences=False,
        allow_cascade=False,
        inhibit_post_migrate=False,
    )
    _kept_as_flushed[alias] = kept_state(alias)


def empty_tables(alias: str) -> None:
    """Delete every row of the Django tables of ``alias`` but the :data:`KEPT` ones."""
    connection = connections[alias]
    tables = [
        table
        for table in connection.introspection.django_table_names(
            only_existing=True, include_views=False
        )
        if table not in KEPT
    ]
    quote = connection.ops.quote_name
    with transaction.atomic(using=alias), connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SET CONSTRAINTS ALL DEFERRED")
        elif connection.vendor == "mysql":
            cursor.execute("SET FOREIGN_KEY_CHECKS = 0")
        elif connection.vendor == "sqlite":
            cursor.execute("PRAGMA defer_foreign_keys = ON")
        try:
            for table in tables:
                cursor.execute(f"DELETE FROM {quote(table)}")
        finally:
            if connection.vendor == "mysql":
                cursor.execute("SET FOREIGN_KEY_CHECKS = 1")


def _fixture_teardown(self: TransactionTestCase) -> Any:
    if self.available_apps is not None or self.serialized_rollback:
        return _django_teardown(self)
    for alias in self._databases_names(include_mirrors=False):  # type: ignore[attr-defined]
        if _kept_as_flushed.get(alias) == kept_state(alias):
            empty_tables(alias)
        else:  # the first test on this database, or one that changed the kept tables
            flush(alias)
    return None


def install() -> None:
    """Use :func:`empty_tables` after each transactional test (``DJANGO_FLUSH=1``: Django's
    flush, to measure the difference or to rule this out)."""
    if os.environ.get("DJANGO_FLUSH") != "1":
        TransactionTestCase._fixture_teardown = _fixture_teardown  # type: ignore[method-assign]
