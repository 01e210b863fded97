"""Deterministic interleavings of real connections: which server session a connection is, and
a wait until that session waits on a lock (PostgreSQL's ``pg_stat_activity``, InnoDB's
``INNODB_TRX``), asked from the test thread's own connection. No sleep decides an order."""

from __future__ import annotations

import time
from collections.abc import Callable

from django.db import connection, connections

WAIT_TIMEOUT = 60.0  # a guard against a hang, never a timing

INNODB_POLL = 0.15
"""Seconds between two reads of ``INNODB_TRX``. InnoDB refills that table's cache only when it
was last read more than 0.1 s ago (``CACHE_MIN_IDLE_TIME_US``): read more often, it shows the
same stale rows for ever."""


def session_of(alias: str = "default") -> int:
    """The server session of this thread's connection to ``alias`` (opened if need be), without
    a statement: psycopg's backend pid, or MySQLdb's thread id."""
    wrapper = connections[alias]
    wrapper.ensure_connection()
    raw = wrapper.connection
    assert raw is not None
    if wrapper.vendor == "postgresql":
        return int(raw.info.backend_pid)
    return int(raw.thread_id())


def waits_on_a_lock(session: int) -> bool:
    """Whether ``session`` waits on a lock now (a row, a transaction), asked in autocommit."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [session]
            )
            row = cursor.fetchone()
            return row is not None and row[0] == "Lock"
        cursor.execute(
            "SELECT trx_state FROM information_schema.INNODB_TRX WHERE trx_mysql_thread_id = %s",
            [session],
        )
        row = cursor.fetchone()
        return row is not None and row[0] == "LOCK WAIT"


def wait_until_blocked(
    session: int, what: str, failed: Callable[[], BaseException | None] = lambda: None
) -> None:
    """Return once ``session`` waits on a lock; fail after :data:`WAIT_TIMEOUT`, or at once
    with the error ``failed`` reports (a thread that ended instead of waiting)."""
    deadline = time.monotonic() + WAIT_TIMEOUT
    poll = 0.01 if connection.vendor == "postgresql" else INNODB_POLL
    while not waits_on_a_lock(session):
        error = failed()
        if error is not None:
            raise AssertionError(f"{what}: ended instead of waiting on a lock") from error
        assert time.monotonic() < deadline, f"{what}: never waited on a lock"
        time.sleep(poll)
