"""PostgreSQL with psycopg 3: a statement that travels with its ``BEGIN`` or ``COMMIT``
(``django_idempotency.pg_roundtrips``) shares the connection with other threads and survives
being interrupted, as a statement sent by psycopg's own ``execute`` does.

* Another thread using the same connection waits for the exchange to end instead of sending
  its own query in the middle of it (psycopg serialises a connection's operations with its
  ``Connection.lock``).
* A ``KeyboardInterrupt`` (or ``SystemExit``) raised while the answer is awaited cancels the
  statement on the server and reads what is left of the answer, as psycopg's
  ``Connection.wait`` does: the atomic block then rolls back on the same connection. If the
  server does not end the statement, the connection is closed and Django opens a new one.
* A ``statement_timeout`` that cancels the statement mid-exchange raises Django's
  ``OperationalError``, and the atomic block rolls back on the same connection.

The interrupt is a real signal, sent once the server is seen running the statement
(``pg_stat_activity``), so that it lands while the client waits for the answer.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import pytest
from django.db import OperationalError, connection, connections, transaction

from django_idempotency import pg_roundtrips
from django_idempotency.pg_roundtrips import (
    apart_may_travel,
    begin_statement,
    commit_travels,
    execute_apart_first,
    execute_first,
    execute_last,
)

pytestmark = pytest.mark.postgres

#: A statement that runs until it is cancelled (longer than any test waits).
SLEEP = "SELECT 1 FROM pg_sleep(%s)"
SLEEP_PARAMS = [60]
#: How long the tests wait for something the server does at once; never reached when they pass.
PATIENCE = 60.0  # a guard against a hang, never a timing


@pytest.fixture(autouse=True)
def psycopg3() -> None:
    if connection.Database.__name__ != "psycopg":
        pytest.skip("the BEGIN and the COMMIT travel with psycopg 3 only")


@pytest.fixture
def other() -> Iterator[Any]:
    """A second psycopg connection to the test database, in autocommit, to watch the first.

    At the end it ends any session of the test database still sleeping: a test that fails (or a
    connection that was closed while the server ran its statement) leaves no backend behind to
    hold up the next test or the test database's ``DROP``."""
    raw = connection.get_new_connection(connection.get_connection_params())
    raw.autocommit = True
    try:
        yield raw
    finally:
        raw.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND wait_event = 'PgSleep'"
        )
        raw.close()


def backend(other: Any, pid: int) -> tuple[str, str] | None:
    """The session's state and wait event in ``pg_stat_activity``; None once it has ended."""
    row = other.execute(
        "SELECT state, coalesce(wait_event, '') FROM pg_stat_activity WHERE pid = %s", [pid]
    ).fetchone()
    return None if row is None else (row[0], row[1])


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + PATIENCE
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"still waiting for {what}")
        time.sleep(0.01)


def sleeping(other: Any, pid: int) -> bool:
    return backend(other, pid) == ("active", "PgSleep")


@contextmanager
def interrupt_once_sleeping(pid: int, exception: type[BaseException]) -> Iterator[None]:
    """Raise ``exception`` in this (the main) thread, from a signal handler, as Ctrl-C raises
    ``KeyboardInterrupt``, once the session ``pid`` is seen sleeping in its statement."""
    main = threading.main_thread()
    assert threading.current_thread() is main, "signals are handled in the main thread"
    failures: list[BaseException] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        raise exception()

    def watch() -> None:
        # The watcher has its own connection, apart from the main thread's.
        raw = connection.get_new_connection(connection.get_connection_params())
        raw.autocommit = True
        try:
            wait_until(lambda: sleeping(raw, pid), "the statement to run")
            signal.pthread_kill(main.ident or 0, signal.SIGUSR1)
        except Exception as error:  # noqa: BLE001 - reported by the main thread below
            failures.append(error)
        finally:
            raw.close()

    previous = signal.signal(signal.SIGUSR1, handler)
    watcher = threading.Thread(target=watch, name="interrupter")
    watcher.start()
    try:
        yield
    finally:
        watcher.join(PATIENCE)
        signal.signal(signal.SIGUSR1, previous)
    assert not failures, failures


# --- the three ways a statement travels ----------------------------------------------------


def travels_first(sql: str, params: list[Any]) -> Any:
    assert begin_statement(connection) is not None
    return execute_first(connection, sql, params)


def travels_last(sql: str, params: list[Any]) -> Any:
    execute_first(connection, "SELECT 1", [])
    assert commit_travels(connection)
    return execute_last(connection, sql, params)


def travels_after_one_apart(sql: str, params: list[Any]) -> Any:
    rows = execute_apart_first(connection, ("SELECT 1", []), (sql, params))
    assert rows is not None, "the statements did not travel"
    return rows[1]


TRAVELS = [travels_first, travels_last, travels_after_one_apart]
IDS = ["first", "last", "apart-first"]


# --- another thread on the same connection -------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("travel", [travels_first, travels_after_one_apart], ids=IDS[::2])
def test_another_thread_on_the_connection_waits_for_the_exchange(
    travel: Callable[[str, list[Any]], Any],
) -> None:
    """The exchange holds psycopg's connection lock: a thread that shares the Django connection
    (``inc_thread_sharing``) and queries while the exchange waits for its answer waits too, then
    runs; it does not send its query in the middle of the exchange. (Every way of travelling
    ends in the same exchange, ``_exchange``.)

    The exchange's statement waits on an advisory lock that a coordinating thread holds, so it
    cannot end before the coordinator lets it: the sharer is started meanwhile, and is seen
    still waiting a second later."""
    key = 20_240_024
    shared = connections["default"]
    shared.ensure_connection()
    pid = shared.connection.info.backend_pid
    locked = threading.Event()
    done: list[str] = []
    failures: list[BaseException] = []
    still_waiting: list[bool] = []

    def share() -> None:
        try:
            with shared.cursor() as cursor:
                cursor.execute("SELECT %s::int", [2])
                assert cursor.fetchone() == (2,)
            done.append("sharer")
        except Exception as error:  # noqa: BLE001 - reported by the main thread
            failures.append(error)

    def coordinate() -> None:
        sharer = threading.Thread(target=share, name="sharer")
        holder = connection.get_new_connection(connection.get_connection_params())
        holder.autocommit = True
        try:
            holder.execute("SELECT pg_advisory_lock(%s)", [key])
            locked.set()
            wait_until(
                lambda: backend(holder, pid) == ("active", "advisory"),
                "the exchange's statement to wait on the advisory lock",
            )
            sharer.start()
            sharer.join(1.0)
            # Still waiting for the connection: without the lock it has failed, or run, by now.
            still_waiting.append(sharer.is_alive())
        except Exception as error:  # noqa: BLE001 - reported by the main thread
            failures.append(error)
        finally:
            locked.set()
            holder.close()  # ends the session, and its advisory lock with it
            if sharer.ident is not None:
                sharer.join(PATIENCE)

    coordinator = threading.Thread(target=coordinate, name="coordinator")
    shared.inc_thread_sharing()
    try:
        coordinator.start()
        assert locked.wait(PATIENCE)
        with transaction.atomic():
            rows = travel("SELECT 1 FROM pg_advisory_xact_lock(%s)", [key])
            done.append("exchange")
            coordinator.join(PATIENCE)  # the sharer's query runs in this transaction
    finally:
        shared.dec_thread_sharing()

    assert not failures, failures
    assert rows == [(1,)]
    assert still_waiting == [True]
    assert done == ["exchange", "sharer"]


# --- interrupted while waiting for the answer ----------------------------------------------


INTERRUPTIONS = [(travel, KeyboardInterrupt) for travel in TRAVELS] + [(travels_first, SystemExit)]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "travel, interruption",
    INTERRUPTIONS,
    ids=[*(f"{name}-KeyboardInterrupt" for name in IDS), "first-SystemExit"],
)
def test_an_interrupt_cancels_the_statement_and_the_block_rolls_back_on_the_connection(
    travel: Callable[[str, list[Any]], Any], interruption: type[BaseException], other: Any
) -> None:
    """Ctrl-C while the server runs the statement: the statement is cancelled on the server and
    the rest of the answer read, so the interruption leaves the atomic block with the
    connection idle in a failed transaction, which the block rolls back. The same connection
    then serves the next transaction; the server is not left running the statement."""
    import psycopg

    connection.ensure_connection()
    pid = connection.connection.info.backend_pid
    with (
        pytest.raises(interruption),
        interrupt_once_sleeping(pid, interruption),
        transaction.atomic(),
    ):
        travel(SLEEP, SLEEP_PARAMS)

    # pg_stat_activity says "idle" a moment before the backend waits on its client (CI saw
    # ("idle", "") once): wait for the wait event rather than sample it once.
    wait_until(lambda: backend(other, pid) == ("idle", "ClientRead"), "the session idle")
    assert connection.connection is not None
    assert connection.connection.info.backend_pid == pid
    idle = psycopg.pq.TransactionStatus.IDLE
    assert connection.connection.pgconn.transaction_status == idle
    assert not connection.in_atomic_block and connection.get_autocommit()
    with transaction.atomic():
        assert travels_first("SELECT %s::int + 1", [41]) == [(42,)]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("poll", ["poll", "select"])
def test_an_interrupt_the_server_does_not_answer_closes_the_connection(
    poll: str, other: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A cancel request that does not end the statement (lost, or the server too busy): after a
    bounded wait the connection is closed, as psycopg closes its own, and Django opens a new
    one for the next query. The cancel request is dropped here (its function does nothing);
    the server is real. The wait is bounded with ``poll``, and with ``select`` where gevent or
    eventlet took ``poll`` away."""
    import select

    import psycopg

    if poll == "select":
        monkeypatch.delattr(select, "poll")
    monkeypatch.setattr(psycopg.Connection, "cancel_safe", lambda self, timeout=30.0: None)
    monkeypatch.setattr(pg_roundtrips, "CANCEL_WAIT", 0.5)
    connection.ensure_connection()
    pid = connection.connection.info.backend_pid
    with (
        caplog.at_level("WARNING", logger="django_idempotency.pg_roundtrips"),
        pytest.raises(KeyboardInterrupt),
        interrupt_once_sleeping(pid, KeyboardInterrupt),
        transaction.atomic(),
    ):
        travels_first(SLEEP, SLEEP_PARAMS)

    assert "closing the connection" in caplog.text
    with transaction.atomic():
        assert travels_first("SELECT %s::int + 1", [41]) == [(42,)]
    assert connection.connection.info.backend_pid != pid


@pytest.mark.django_db(transaction=True)
def test_an_interrupt_while_cancelling_closes_the_connection(
    other: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second Ctrl-C while the statement is being cancelled: the connection is in an unknown
    state, so it is closed (as psycopg closes its own), the second interruption goes on, and
    Django opens a new connection for the next query."""
    import psycopg

    def interrupted_again(self: Any, timeout: float = 30.0) -> None:
        raise KeyboardInterrupt("again")

    monkeypatch.setattr(psycopg.Connection, "cancel_safe", interrupted_again)
    connection.ensure_connection()
    pid = connection.connection.info.backend_pid
    with (
        pytest.raises(KeyboardInterrupt, match="again"),
        interrupt_once_sleeping(pid, KeyboardInterrupt),
        transaction.atomic(),
    ):
        travels_first(SLEEP, SLEEP_PARAMS)

    with transaction.atomic():
        assert travels_first("SELECT %s::int + 1", [41]) == [(42,)]
    assert connection.connection.info.backend_pid != pid


@pytest.mark.django_db(transaction=True)
def test_a_psycopg_connection_without_its_lock_keeps_its_statements_apart() -> None:
    """The exchange takes ``Connection.lock``, an attribute psycopg does not document: should a
    release drop it, the statements go apart, through Django cursors, rather than unlocked."""
    connection.ensure_connection()
    raw = connection.connection
    lock = raw.lock
    assert apart_may_travel(connection)
    with transaction.atomic():  # psycopg itself needs its lock to enter and leave the block
        del raw.lock
        try:
            assert begin_statement(connection) is None
            assert not commit_travels(connection)
        finally:
            raw.lock = lock
    del raw.lock
    try:
        assert not apart_may_travel(connection)
    finally:
        raw.lock = lock
    with transaction.atomic():
        assert begin_statement(connection) is not None


# --- statement_timeout mid-exchange --------------------------------------------------------


@contextmanager
def statement_timeout(milliseconds: int) -> Iterator[None]:
    """The session's ``statement_timeout``, set apart (before the block, so that the block's
    ``BEGIN`` still travels), and reset afterwards."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT set_config('statement_timeout', %s, false)", [str(milliseconds)])
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET statement_timeout")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("travel", TRAVELS, ids=IDS)
def test_a_statement_timeout_mid_exchange_raises_and_the_block_rolls_back(
    travel: Callable[[str, list[Any]], Any], other: Any
) -> None:
    """The server cancels the statement when ``statement_timeout`` expires: Django's
    ``OperationalError`` (caused by psycopg's ``QueryCanceled``), nothing after the statement
    runs (not the ``COMMIT`` that travels with it), and the block rolls back on the same
    connection."""
    import psycopg

    connection.ensure_connection()
    pid = connection.connection.info.backend_pid
    with statement_timeout(100):
        with pytest.raises(OperationalError) as timed_out, transaction.atomic():
            travel(SLEEP, SLEEP_PARAMS)
        assert isinstance(timed_out.value.__cause__, psycopg.errors.QueryCanceled)
        assert not connection.in_atomic_block
        idle = psycopg.pq.TransactionStatus.IDLE
        assert connection.connection.pgconn.transaction_status == idle
    assert connection.connection.info.backend_pid == pid
    # pg_stat_activity says "idle" a moment before the backend waits on its client (CI saw
    # ("idle", "") once): wait for the wait event rather than sample it once.
    wait_until(lambda: backend(other, pid) == ("idle", "ClientRead"), "the session idle")
    with transaction.atomic():
        assert travels_first("SELECT %s::int + 1", [41]) == [(42,)]


@pytest.mark.django_db(transaction=True)
def test_a_local_statement_timeout_stops_the_commit_that_travels() -> None:
    """``SET LOCAL statement_timeout`` inside the block, then the last statement sleeps: its
    ``COMMIT`` never runs, and what the block wrote is rolled back."""
    from testproject.shop.models import Effect

    with pytest.raises(OperationalError), transaction.atomic():
        travels_first("SELECT set_config('statement_timeout', %s, true)", ["100"])
        Effect.objects.create(name="rolled back")
        assert commit_travels(connection)
        execute_last(connection, SLEEP, SLEEP_PARAMS)

    assert not Effect.objects.exists()
    with connection.cursor() as cursor:  # SET LOCAL ended with the transaction
        cursor.execute("SHOW statement_timeout")
        assert cursor.fetchone() == ("0",)
