"""Database outages: which errors mean "the database cannot be reached", and how a process logs
one outage instead of one warning per message.

:func:`connection_lost` tells a lost connection (refused, timed out, closed by the server, cut
mid-statement) from a statement that failed on a live one. The HTTP claim answers the first
with 503 (:meth:`~django_idempotency.http.store.RecordStore.unreachable`).

:class:`Outage` is for loops that meet the outage once per message (a Celery worker retrying
every delivery): the first error logs one WARNING line that names the cause, the others go to
DEBUG with their tracebacks, and the first success after it logs one line saying how long it
lasted and what was retried meanwhile. One per process and purpose; thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from django.db import InterfaceError, OperationalError
from django.db.backends.base.base import BaseDatabaseWrapper

#: MariaDB/MySQL errors that say the connection is gone, not that a statement failed: the
#: server cannot be reached (2002, 2003, 2005), went away or was lost mid-statement (2006,
#: 2013, 2055), is shutting down (1053), or killed this connection (1927).
MYSQL_CONNECTION_LOST = frozenset({1053, 1927, 2002, 2003, 2005, 2006, 2013, 2055})
#: PostgreSQL SQLSTATEs of a session the server ends: admin_shutdown, crash_shutdown,
#: cannot_connect_now, idle_session_timeout (PostgreSQL 14), and
#: idle_in_transaction_session_timeout (``25P03``) and transaction_timeout (``25P04``,
#: PostgreSQL 17), which psycopg raises as an ``InternalError`` (class 25); and the class 08,
#: connection_exception.
POSTGRESQL_SESSION_ENDED = frozenset({"57P01", "57P02", "57P03", "57P05", "25P03", "25P04"})
#: What libpq, psycopg 3 and psycopg 2 say (lowercased) when a connection is lost, in an error
#: that has no SQLSTATE.
POSTGRESQL_LOST_WORDS = (
    "server closed the connection",
    "consuming input failed",
    "connection is lost",
    "connection is closed",
    "connection already closed",
    "could not receive data from server",
    "could not send data to server",
    "no connection to the server",
    "ssl syscall error",
    "ssl connection has been closed",
    "connection reset by peer",
    "broken pipe",
    "connection timeout expired",
)


def connection_lost(connection: BaseDatabaseWrapper, exc: BaseException) -> bool:
    """Whether ``exc``, raised by a statement on ``connection`` (or by opening it), says that
    the database cannot be reached, rather than that a statement failed on a live connection
    (a deadlock, a serialization failure, a constraint)."""
    if not isinstance(exc, (OperationalError, InterfaceError)):
        # Only PostgreSQL's idle_in_transaction_session_timeout, among the sessions the server
        # ends, comes as another class (InternalError): it was read as a statement's error.
        return connection.vendor == "postgresql" and sqlstate(exc) in POSTGRESQL_SESSION_ENDED
    raw = connection.connection
    if raw is None or raised_by_connect(exc):  # connecting failed (refused, timed out...)
        return True
    cause = exc.__cause__ or exc
    if connection.vendor == "postgresql":
        # An error the server sent has a SQLSTATE: a session it ends says so (class 08, or
        # admin_shutdown...), which a pipelined statement (pg_roundtrips) reads before the
        # driver notices the closed socket; any other is a statement's. An error without one
        # is the driver's own. psycopg 3 marks a connection that lost its server ``broken``
        # (and ``closed``); psycopg 2 sets ``closed`` to 2. But by the time the error is looked
        # at, Django's atomic block may have replaced that connection with a new one (a failed
        # COMMIT: its ROLLBACK fails too, the connection is closed, and leaving the block
        # reconnects), so the error's own words count too.
        state = sqlstate(exc)
        if state:
            return state.startswith("08") or state in POSTGRESQL_SESSION_ENDED
        if getattr(raw, "broken", False) or raw.closed:
            return True
        # Not every error without one is a loss ("number of parameters must be between 0
        # and 65535" is a bug of the caller): libpq's and the drivers' words for one.
        text = str(cause).lower()
        return any(words in text for words in POSTGRESQL_LOST_WORDS)
    if connection.vendor == "mysql":
        args: tuple[Any, ...] = getattr(cause, "args", ())
        return bool(args) and args[0] in MYSQL_CONNECTION_LOST
    return "unable to open" in str(exc)  # SQLite: the file cannot be opened


def sqlstate(exc: BaseException) -> str:
    """The SQLSTATE of a PostgreSQL error (psycopg 3's ``sqlstate``, psycopg 2's ``pgcode``),
    read from the driver's error that Django's wraps; "" when it has none."""
    cause = exc.__cause__ or exc
    return str(getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None) or "")


def raised_by_connect(exc: BaseException) -> bool:
    """Whether ``exc`` (or the driver error it wraps) was raised while a database wrapper opened
    its connection (in its ``get_new_connection()``), whatever the server said.

    The wrapper's own state cannot tell: by the time a caller looks at the error, another step
    may have connected again (a Celery consumer's failed delivery is counted on a new
    connection the moment the database is back), so the traceback is read instead. A server
    that refuses a session (``database "..." is not currently accepting connections``) sends a
    SQLSTATE that is no connection error, and psycopg 3 drops it: only the traceback says that
    this was a connect."""
    for error in (exc, exc.__cause__):
        trace = error.__traceback__ if error is not None else None
        while trace is not None:
            frame = trace.tb_frame
            if frame.f_code.co_name == "get_new_connection" and isinstance(
                frame.f_locals.get("self"), BaseDatabaseWrapper
            ):
                return True
            trace = trace.tb_next
    return False


def describe(exc: BaseException) -> str:
    """``exc`` on one line: its class and message, whitespace folded."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())


class Outage:
    """One outage of the database, as one process's loop meets it (see the module docstring).

    ``what`` names the loop in the log lines ("Celery consumers"). :meth:`failed` is called for
    each error of the outage, :meth:`recovered` after each success (it costs one attribute read
    when there is no outage).
    """

    def __init__(self, what: str, logger: logging.Logger) -> None:
        self.what = what
        self.logger = logger
        self.active = False
        self._lock = threading.Lock()
        self._since = 0.0
        self._cause = ""
        self._tally: dict[str, int] = {}

    def failed(self, exc: BaseException, tally: str, message: str, *args: Any) -> None:
        """Note an error of the outage: ``tally`` names what it cost (counted for the recovery
        line); ``message % args`` is the DEBUG line, with the traceback."""
        with self._lock:
            first = not self.active
            if first:
                self.active, self._since, self._cause = True, time.monotonic(), describe(exc)
                self._tally = {}
            self._tally[tally] = self._tally.get(tally, 0) + 1
        if first:
            self.logger.warning(
                "%s: the database is unavailable (%s); deliveries are retried until it is back. "
                "The other errors of this outage are logged at DEBUG.",
                self.what,
                self._cause,
            )
        self.logger.debug(message, *args, exc_info=exc)

    def recovered(self) -> None:
        """Log the end of the outage, once, if there was one."""
        if not self.active:
            return
        with self._lock:
            if not self.active:
                return
            self.active = False
            lasted, cause, tally = time.monotonic() - self._since, self._cause, self._tally
        done = ", ".join(f"{count} {name}" for name, count in sorted(tally.items()))
        self.logger.warning(
            "%s: the database is back after %.1fs (it failed with %s); meanwhile %s.",
            self.what,
            lasted,
            cause,
            done or "nothing was retried",
        )
