"""PostgreSQL with psycopg 3: the ``BEGIN`` and the ``COMMIT`` that travel with a statement.

Why it is kept, what it relies on, where that is tested. Sending the transaction's ``BEGIN``
and ``COMMIT`` with the app's own statements saved about 15% on a first HTTP execution, 18% on a
replay and 14% on a consumer's delivery, measured in issue 24's round (the in-process
microbenchmarks on PostgreSQL, with this module on and off; ``docs/benchmarks.md``). To know
whether a ``COMMIT`` may travel, it reads three undocumented attributes of Django's connection:
``atomic_blocks`` (the open ``atomic`` blocks), ``commit_on_exit`` (the outermost block was
entered with autocommit on, so leaving it commits) and ``needs_rollback`` (something marked the
block for rollback). Django has no public way to ask whether leaving the current block will
commit, and a ``COMMIT`` sent when it would not is a transaction ended behind Django's back.
``tests/test_pg_roundtrips_django.py`` checks that the attributes exist and mean that, on the
installed Django; it is a quick test, so the test command runs it on every Django of its
matrix. ``tests/test_pg_roundtrips.py`` counts the round trips, and
``tests/test_pg_roundtrips_interrupted.py`` shows the exchange holding psycopg's connection
lock and surviving an interruption or a ``statement_timeout``; both run on every psycopg the
test command installs, its declared minimum (3.2.1) included.

A transaction that Django opens with ``transaction.atomic`` costs two round trips of its own on
psycopg 3: the driver sends ``BEGIN`` alone, just before the first statement, and Django's
commit sends ``COMMIT`` alone when the block ends. The app's own statements are often the first
and the last of such a transaction (the HTTP claim and the stored response; a consumer's
reservation), so both can ride along with them, in one simple-protocol query:

* :func:`execute_first` sends ``BEGIN; <statement>`` when the statement is the first of the
  transaction, and returns its rows. psycopg then finds the transaction open and sends no
  ``BEGIN`` of its own.
* :func:`execute_last` sends ``<statement>; COMMIT`` when leaving the atomic block would commit
  next (:func:`commit_travels`), so that Django's commit finds nothing left to send.
* :func:`execute_apart_first` sends ``BEGIN; <statement>; COMMIT; BEGIN; <statement>``: a
  statement that must commit on its own before the transaction (a consumer's delivery count),
  then the transaction's first statement.

Nothing here changes what the transaction does: the same statements run in the same
transaction, on the same connection, in the same order. (``execute_apart_first``'s first
statement commits apart, as the caller asks.) Whenever a condition is not met (another driver or
backend, a transaction already open, a nested block), the statement goes the usual way, through
a Django cursor. The parameters are merged into the query on the client, as psycopg merges them
for Django by default: directly for the types the app passes (:func:`_merged`), by
``ClientCursor.mogrify`` for anything else. The code uses psycopg's public API
(``Connection.pgconn``, ``ConnectionInfo``, ``Connection.cancel_safe``,
``ClientCursor.mogrify``, ``psycopg.adapt.Transformer``, ``psycopg.errors.lookup``) and one
undocumented attribute, ``Connection.lock`` (psycopg 3.0 to 3.3), to do for the exchange what
psycopg's own ``execute`` does: it holds the connection's lock, and an interruption cancels the
statement (:func:`_exchange`). It does for the statement what a Django cursor does: the
connection's health check, the execute wrappers (``connection.execute_wrapper``), the query log
(``DEBUG``, ``CaptureQueriesContext``) and the translation of errors into ``django.db``
exceptions.

Why this module is long: one exchange does, in one place, what a Django cursor and psycopg's
``execute`` each do around a statement (health check, wrappers, log, errors; lock, wait,
cancellation), plus the parameters' merging; split up, the conditions under which the ``BEGIN``
and the ``COMMIT`` may travel would be read in one module and relied on in another.
"""

from __future__ import annotations

import logging
import select
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cache, partial
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper

from django_idempotency.exceptions import log_text

logger = logging.getLogger("django.db.backends")
#: What an interrupted exchange did to the connection (as psycopg's ``psycopg`` logger says it).
interruptions = logging.getLogger(__name__)

Executor = Callable[[str, Any, bool, dict[str, Any]], Any]
Rows = list[tuple[Any, ...]]


@dataclass(frozen=True)
class _Psycopg:
    """The parts of psycopg 3 used here, imported once."""

    connection: Any
    client_cursor: Any
    transformer: Any
    lookup: Callable[[str], Any]
    error: type[Exception]
    """``psycopg.Error``, the base of psycopg's exceptions."""
    operational_error: Any
    programming_error: type[Exception]
    idle: Any
    """``TransactionStatus.IDLE``: no transaction open on the server."""
    active: Any
    """``TransactionStatus.ACTIVE``: a query sent, its results not all read."""
    ok: tuple[Any, ...]
    """The ``ExecStatus`` values of a statement that succeeded."""
    tuples_ok: Any
    sqlstate: Any
    """``DiagnosticField.SQLSTATE``."""


@cache
def _psycopg() -> _Psycopg | None:
    """psycopg 3, or None under psycopg2 (which tracks the transaction itself, and would send its
    own ``BEGIN`` and ``COMMIT`` anyway)."""
    try:
        import psycopg
        import psycopg.errors
        from psycopg.adapt import Transformer
    except ImportError:
        return None
    status = psycopg.pq.ExecStatus
    return _Psycopg(
        connection=psycopg.Connection,
        client_cursor=psycopg.ClientCursor,
        transformer=Transformer,
        lookup=psycopg.errors.lookup,
        error=psycopg.Error,
        operational_error=psycopg.OperationalError,
        programming_error=psycopg.ProgrammingError,
        idle=psycopg.pq.TransactionStatus.IDLE,
        active=psycopg.pq.TransactionStatus.ACTIVE,
        ok=(status.COMMAND_OK, status.TUPLES_OK),
        tuples_ok=status.TUPLES_OK,
        sqlstate=psycopg.pq.DiagnosticField.SQLSTATE,
    )


# --- when they may travel --------------------------------------------------------------


def begin_statement(connection: BaseDatabaseWrapper) -> str | None:
    """The ``BEGIN`` psycopg would send before the next statement; None if it would send none,
    or if it may not travel.

    It travels with psycopg 3 binding on the client (Django's default), inside Django's
    ``atomic``, when no transaction is open on the server yet (the block was entered with
    autocommit on, and nothing ran in it). The isolation level of ``OPTIONS`` goes into the
    ``BEGIN``, as psycopg would put it; a connection made read-only or deferrable by hand is
    left to psycopg.
    """
    if connection.vendor != "postgresql" or not connection.in_atomic_block:
        return None
    psycopg = _psycopg()
    if psycopg is None:
        return None
    # What a Django cursor checks first: a connection that fails its health check is closed
    # (then reopened the usual way), and a block marked for rollback refuses every statement.
    connection.close_if_health_check_failed()
    connection.validate_no_broken_transaction()
    raw = _client_binding(psycopg, connection)
    if raw is None or raw.pgconn.transaction_status != psycopg.idle or _set_by_hand(raw):
        return None
    level = raw.isolation_level
    return "BEGIN" if level is None else f"BEGIN ISOLATION LEVEL {level.name.replace('_', ' ')}"


def commit_travels(connection: BaseDatabaseWrapper) -> bool:
    """Whether a ``COMMIT`` may travel with the next statement: leaving the current atomic block
    will commit (it is the only one open, it entered with autocommit on, and nothing marked it
    for rollback), and psycopg 3 binds on the client (Django's default)."""
    if not (
        connection.vendor == "postgresql"
        and connection.in_atomic_block
        and len(connection.atomic_blocks) == 1
        and connection.commit_on_exit
        and not connection.needs_rollback
    ):
        return False
    psycopg = _psycopg()
    return psycopg is not None and _client_binding(psycopg, connection) is not None


def _client_binding(psycopg: _Psycopg, connection: BaseDatabaseWrapper) -> Any:
    """The psycopg 3 connection under ``connection`` if it binds parameters on the client, as
    the statements that travel do; None otherwise. Django's ``OPTIONS = {"server_side_binding":
    True}`` asks psycopg to bind on the server: such a connection keeps its statements apart."""
    raw = connection.connection
    return raw if _binds_on_client(psycopg, raw) and not raw.autocommit else None


def _binds_on_client(psycopg: _Psycopg, raw: Any) -> bool:
    """Whether ``raw`` is a psycopg 3 connection whose cursors bind on the client (and which
    has the lock that the exchange takes: a psycopg without it keeps its statements apart)."""
    return (
        isinstance(raw, psycopg.connection)
        and issubclass(raw.cursor_factory, psycopg.client_cursor)
        and hasattr(raw, "lock")
    )


def _set_by_hand(raw: Any) -> bool:
    """Whether the connection was made read-only or deferrable by hand: its ``BEGIN`` is left
    to psycopg."""
    return raw.read_only is not None or raw.deferrable is not None


# --- sending them ------------------------------------------------------------------------


def execute_first(connection: BaseDatabaseWrapper, sql: str, params: Sequence[Any]) -> Rows:
    """Run ``sql`` with ``params`` and return its rows, opening the transaction in the same
    round trip when it is the first statement of one (see :func:`begin_statement`); otherwise
    through a Django cursor, as usual."""
    begin = begin_statement(connection)
    if begin is None:
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            return list(cursor.fetchall())
    return _travel(connection, sql, params, begin=begin)[0]


def execute_last(connection: BaseDatabaseWrapper, sql: str, params: Sequence[Any]) -> Rows:
    """Run ``sql`` with ``params``, then commit in the same round trip when leaving the current
    atomic block would commit next (see :func:`commit_travels`): Django's own commit then finds
    the transaction ended, and psycopg sends nothing. Otherwise through a Django cursor.

    The statement must raise if the transaction must not commit: an error stops the query before
    its ``COMMIT``. A ``COMMIT`` that fails (a deferred constraint) raises as Django's commit
    would, and the transaction is over. Returns the statement's rows.
    """
    if not commit_travels(connection):
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            return list(cursor.fetchall()) if cursor.description else []
    return _travel(connection, sql, params, commit=True)[0]


def apart_may_travel(connection: BaseDatabaseWrapper) -> bool:
    """Whether :func:`execute_apart_first` will be able to send its two statements in one round
    trip in the ``atomic`` block that the caller is about to enter: PostgreSQL with psycopg 3
    binding on the client, and no atomic block open (so the block entered next is the only one,
    and nothing runs in it before the statements). It connects, and runs the connection's
    health check, now rather than inside the block."""
    if connection.vendor != "postgresql" or connection.in_atomic_block:
        return False
    psycopg = _psycopg()
    if psycopg is None:
        return False
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    raw = connection.connection
    return (
        _binds_on_client(psycopg, raw)
        and not _set_by_hand(raw)
        and raw.pgconn.transaction_status == psycopg.idle
    )


def execute_apart_first(
    connection: BaseDatabaseWrapper,
    apart: tuple[str, Sequence[Any]],
    first: tuple[str, Sequence[Any]],
) -> tuple[Rows, Rows] | None:
    """Commit the statement ``apart`` in a transaction of its own, then open the transaction of
    the current atomic block with the statement ``first``, in one round trip: ``BEGIN; <apart>;
    COMMIT; BEGIN; <first>``. Returns the rows of each. ``apart`` runs at the server's default
    isolation level, as in autocommit; ``first`` at the block's.

    The block must be the only one open, and nothing may have run in it yet
    (:func:`apart_may_travel` says so before the block is entered); otherwise nothing is sent
    and None is returned. ``apart`` commits, flushed like any commit, before ``first`` runs. If
    ``apart`` fails, nothing else runs; if ``first`` fails, ``apart`` stays committed. Either way
    the transaction is left failed, and leaving the atomic block rolls it back.
    """
    if len(connection.atomic_blocks) != 1 or not connection.commit_on_exit:
        return None
    begin = begin_statement(connection)
    if begin is None:
        return None
    # A plain BEGIN for the statement apart: it runs at the server's default isolation level,
    # as it would in autocommit; the block's own level goes into the second BEGIN.
    sql = f"{apart[0]}; COMMIT; {begin}; {first[0]}"
    params = [*apart[1], *first[1]]
    counted, _, _, opened = _travel(connection, sql, params, begin="BEGIN", statements=4)
    return counted, opened


def _travel(
    connection: BaseDatabaseWrapper,
    sql: str,
    params: Sequence[Any],
    *,
    begin: str | None = None,
    commit: bool = False,
    statements: int = 1,
) -> list[Rows]:
    """Send ``sql`` (``statements`` statements) with its ``BEGIN`` or ``COMMIT``, as a Django
    cursor would send it, and return the rows of each of its statements.

    The connection's execute wrappers see ``sql`` and ``params``, and may change them; the
    ``BEGIN`` and the ``COMMIT`` are added around what they pass on. An error is raised as a
    Django cursor raises it: the ``django.db`` exception, caused by psycopg's exception for the
    error's SQLSTATE. A failed statement leaves the transaction open and failed, as any failed
    statement does, and leaving the atomic block rolls it back.
    """

    def execute(sql: str, params: Any, many: bool, context: dict[str, Any]) -> list[Rows]:
        return _send(connection, sql, params, begin, commit, statements)

    if not connection.execute_wrappers:
        return execute(sql, list(params), False, {})
    # As a Django cursor runs them (CursorWrapper._execute_with_wrappers): the wrapper added
    # first is the outermost, and each gets the connection and a cursor in its context.
    executor: Executor = execute
    for wrapper in reversed(connection.execute_wrappers):
        executor = partial(wrapper, executor)
    with connection.cursor() as cursor:
        rows: list[Rows] = executor(
            sql, list(params), False, {"connection": connection, "cursor": cursor}
        )
    return rows


def _send(
    connection: BaseDatabaseWrapper,
    sql: str,
    params: Any,
    begin: str | None,
    commit: bool,
    statements: int,
) -> list[Rows]:
    psycopg = _psycopg()
    assert psycopg is not None
    raw = connection.connection
    encoding = raw.info.encoding
    started = time.monotonic()
    with connection.wrap_database_errors:
        statement = _merged(raw, sql, params)
        if statement is None:  # psycopg's errors too are raised as Django's
            statement = psycopg.client_cursor(raw).mogrify(sql, params)
        query = f"{begin}; {statement}" if begin else statement
        if commit:
            query += "; COMMIT"
        results = _exchange(raw, query.encode(encoding))
        if connection.queries_logged:
            # As Django logs them: the BEGIN apart (Django logs the block's own), the COMMIT
            # with the statement (Django logs its commit too, which finds nothing to send).
            _log(connection, statement + ("; COMMIT" if commit else ""), params, started)
        for result in results:
            if result.status not in psycopg.ok:
                raise _error(psycopg, result, encoding)
        expected = (begin is not None) + statements + commit
        if len(results) != expected:
            raise psycopg.programming_error(
                f"expected {expected} results from {query[:200]!r}, got {len(results)}"
            )
    transformer = psycopg.transformer.from_context(raw)
    rows: list[Rows] = []
    for answer in results[begin is not None :][:statements]:
        if answer.status != psycopg.tuples_ok:
            rows.append([])
            continue
        transformer.set_pgresult(answer)
        rows.append(transformer.load_rows(0, answer.ntuples, tuple))
    return rows


def _merged(raw: Any, sql: str, params: Any) -> str | None:
    """``sql`` with ``params`` merged in as SQL literals, as psycopg's ``ClientCursor.mogrify``
    merges them, for the types that the app's own statements pass; None for anything else, and
    psycopg's ``mogrify`` does it.

    psycopg's adaptation machinery costs about 4 µs a parameter, and a statement of the app has
    up to 13: this writes the same literals directly. It serves a UTF-8 connection with
    ``standard_conforming_strings`` on (where a string literal's only special character is the
    quote) and ``sql`` whose only placeholders are ``%s``. A string that contains NUL, a naive
    datetime, or any other type is left to psycopg, which raises or adapts as it always does.
    ``tests/test_pg_roundtrips.py`` checks every case against what psycopg sends.
    """
    # Only "%s" placeholders, one per parameter: no "%%", "%b", "%(name)s".
    if type(params) is not list or not sql.count("%") == sql.count("%s") == len(params):
        return None
    pgconn = raw.pgconn
    if raw.info.encoding != "utf-8":
        return None
    if pgconn.parameter_status(b"standard_conforming_strings") != b"on":
        return None
    literals: list[str] = []
    for value in params:
        kind = type(value)
        if kind is str:
            if "\x00" in value:
                return None
            literals.append("'" + value.replace("'", "''") + "'")
        elif kind is int:
            # A space before a minus, as psycopg writes it: "1 -%s" must not become a comment.
            literals.append(str(value) if value >= 0 else f" {value}")
        elif value is None:
            literals.append("NULL")
        elif kind is bool:
            literals.append("true" if value else "false")
        elif kind is datetime:
            if value.utcoffset() is None:
                return None
            literals.append(f"'{value.isoformat(' ')}'::timestamptz")
        elif kind is uuid.UUID:
            literals.append(f"'{value}'::uuid")
        elif kind is bytes:
            literals.append(f"'\\x{value.hex()}'::bytea")
        elif kind is timedelta:
            if pgconn.parameter_status(b"IntervalStyle") != b"postgres":
                return None
            literals.append("'" + str(value).replace(",", "") + "'::interval")
        else:
            return None
    return sql % tuple(literals)


#: How long an interrupted exchange waits for the server to end its cancelled statement before
#: closing the connection (psycopg's ``Connection.wait`` waits as long).
CANCEL_WAIT = 5.0

_INTERRUPTED = (KeyboardInterrupt, SystemExit)


class _WaitTimeout(Exception):
    """The server did not answer within :data:`CANCEL_WAIT`."""


def _exchange(raw: Any, query: bytes) -> list[Any]:
    """Send ``query`` on the psycopg connection ``raw`` and read all its results, through
    libpq's asynchronous calls, as psycopg's own ``execute`` would.

    It holds the connection's lock (``Connection.lock``, with which psycopg serialises a
    connection's operations) for the whole exchange: another thread that shares the connection
    waits instead of sending its query in the middle of this one, and this one waits for an
    operation of another thread to end. An interruption while the answer is awaited
    (``KeyboardInterrupt``, ``SystemExit``) is handled as psycopg handles it
    (:func:`_interrupted`), then raised.
    """
    pgconn = raw.pgconn
    with raw.lock:
        try:
            pgconn.send_query(query)
            return _results(pgconn)
        except _INTERRUPTED:
            _interrupted(raw)
            raise


def _interrupted(raw: Any) -> None:
    """Leave the connection usable, or closed, after an interruption mid-exchange: what
    psycopg's ``Connection.wait`` does.

    A query still running (the connection ``ACTIVE``) is cancelled on the server, and the rest
    of its answer read and dropped, for up to :data:`CANCEL_WAIT` seconds: the connection is
    then idle, in a failed transaction that the atomic block being left rolls back (or, if the
    statement had ended first, in a transaction that the block rolls back all the same). If the
    server does not end the statement in time, or a second interruption comes while waiting,
    the connection is in an unknown state and is closed: Django's rollback then fails, the
    block closes the connection, and the next query opens a new one. Without this the server
    would go on running the statement, and psycopg would refuse every command on a connection
    whose results are pending.
    """
    psycopg = _psycopg()
    assert psycopg is not None
    pgconn = raw.pgconn
    if pgconn.transaction_status != psycopg.active:
        return
    try:
        try:
            # A public API, which does not take the connection's lock (cancelling is what
            # another thread does to a query that holds it).
            raw.cancel_safe(timeout=CANCEL_WAIT)
        except psycopg.error as error:  # the wait below decides, as in psycopg
            interruptions.warning("query cancellation failed: %s", log_text(error))
        _results(pgconn, timeout=CANCEL_WAIT)
    except _WaitTimeout:
        interruptions.warning(
            "query not ended %.1f s after its cancellation: closing the connection", CANCEL_WAIT
        )
        pgconn.finish()
    except BaseException as error:
        # Interrupted again, or the connection failed while the answer was read.
        interruptions.warning(
            "query cancellation interrupted (%s): closing the connection", type(error).__name__
        )
        pgconn.finish()
        # A new interruption goes on; an error does not replace the one being handled.
        if not isinstance(error, Exception):
            raise


def _results(pgconn: Any, timeout: float | None = None) -> list[Any]:
    """Send what is left of the query, then read all its results; within ``timeout`` seconds
    if given (else :class:`_WaitTimeout`)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while pgconn.flush():
        _wait(pgconn.socket, writable=True, deadline=deadline)
    results: list[Any] = []
    while True:
        # Before every result, not only the first: a query of several statements answers with
        # several results, and the next may not have arrived when one is taken. get_result()
        # on a busy connection blocks in libpq, holding the GIL, so no other thread of the
        # process runs until the network delivers (a proxy in the same process never could).
        while True:
            pgconn.consume_input()
            if not pgconn.is_busy():
                break
            _wait(pgconn.socket, writable=False, deadline=deadline)
        result = pgconn.get_result()
        if result is None:
            return results
        results.append(result)


def _wait(fd: int, *, writable: bool, deadline: float | None = None) -> None:
    """Wait until ``fd`` is ready, until ``deadline`` (``time.monotonic()``) if given: with
    ``poll`` (no limit on the descriptor's number), or with ``select`` where gevent's or
    eventlet's monkey-patching took ``poll`` away to make waiting cooperative."""
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    poll = getattr(select, "poll", None)
    if poll is None:
        ready = select.select([] if writable else [fd], [fd] if writable else [], [], left)
        ready_now = bool(ready[0] or ready[1])
    else:
        poller = poll()
        poller.register(fd, select.POLLOUT if writable else select.POLLIN)
        ready_now = bool(poller.poll(None if left is None else left * 1000))
    if not ready_now:
        raise _WaitTimeout


def _error(psycopg: _Psycopg, result: Any, encoding: str) -> Exception:
    """psycopg's exception for a failed result, chosen by its SQLSTATE as psycopg chooses it,
    with the result's diagnostics (``exc.diag``: the constraint, the detail...)."""
    message = (result.error_message or b"").decode(encoding, "replace").strip()
    sqlstate = result.error_field(psycopg.sqlstate)
    error = psycopg.lookup(sqlstate.decode()) if sqlstate else psycopg.operational_error
    exception: Exception = error(
        message or "the query failed without a message", info=result, encoding=encoding
    )
    return exception


def _log(connection: BaseDatabaseWrapper, sql: str, params: Any, started: float) -> None:
    """What Django's ``CursorDebugWrapper`` records for a statement: ``connection.queries``,
    and the ``django.db.backends`` logger at DEBUG."""
    duration = time.monotonic() - started
    connection.queries_log.append({"sql": sql, "time": f"{duration:.3f}"})
    logger.debug(
        "(%.3f) %s; args=%s; alias=%s",
        duration,
        sql,
        params,
        connection.alias,
        extra={"duration": duration, "sql": sql, "params": params, "alias": connection.alias},
    )
