"""The relay's database faults, reviewed (issue 35, items 2, 9, 10 and 12): what the outage
handling must not hide, the claim's isolation, the take-back of a suspect, and LISTEN losses.

Real databases (PostgreSQL and MariaDB), an in-process relay, and where a connection must be
cut at a given statement, the proxy of tests/db_proxy.py in front of the test database:

* a database bug (a missing table, a violated constraint) is no outage: ERROR with its
  traceback, at every failed batch, while a lost connection stays one WARNING per outage;
* the claim's ``READ COMMITTED`` is its own: a caller's surrounding transaction, and the
  connection's later transactions, keep the alias's REPEATABLE READ;
* a suspect (a message whose last lease ran out without an outcome: its sender may still be
  sending it) that a claim with a lost COMMIT leased keeps that lease after the take-back: no
  other relay sends it while its previous sender may still be on it;
* a lost LISTEN connection is one WARNING (an INFO when the relay's own outage WARNING already
  says the database is gone), the relay polls meanwhile and listens again, psycopg 3 and
  psycopg2 alike.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import DatabaseError, connection, connections, transaction

from django_idempotency.models import OutboxEntry
from django_idempotency.outbox import core as outbox
from django_idempotency.outbox import store
from django_idempotency.outbox.relay import Relay
from django_idempotency.outbox.transports import OutboxMessage
from testproject.shop.models import Effect
from tests.db_proxy import MySqlProxy, PgProxy
from tests.outbox_helpers import RR, SentIdsTransport

PROXIED = RR
LOGGER = "django_idempotency.outbox.relay"

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.mysql,
    pytest.mark.django_db(transaction=True, databases=["default", RR]),
    pytest.mark.usefixtures("null_default_transport"),
]


def write(*destinations: str, using: str = "default") -> list[str]:
    with transaction.atomic(using=using):
        return [outbox.send(d, {"d": d}, using=using) for d in destinations]


def wait_for(condition: Callable[[], bool], seconds: float = 60.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@contextmanager
def serving(relay: Relay, poll_interval: float) -> Iterator[None]:
    def serve() -> None:
        try:
            relay.serve(poll_interval=poll_interval)
        finally:
            connections.close_all()

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        yield
    finally:
        relay.stop()
        thread.join(60)
        assert not thread.is_alive()


@pytest.fixture
def proxy() -> Iterator[PgProxy]:
    """A proxy in front of the test database, and the alias ``PROXIED`` through it (the
    ``repeatable_read`` mirror of the test database, pointed at the proxy for the test)."""
    settings = connection.settings_dict
    target = (settings["HOST"] or "127.0.0.1", int(settings["PORT"] or 0))
    running: PgProxy
    if connection.vendor == "postgresql":
        running = PgProxy((target[0], target[1] or 5432))
    else:
        running = MySqlProxy((target[0], target[1] or 3306))
    proxied = connections[PROXIED].settings_dict
    saved = dict(proxied)
    connections[PROXIED].close()
    proxied.update(HOST="127.0.0.1", PORT=str(running.port))
    try:
        yield running
    finally:
        connections[PROXIED].close()
        proxied.clear()
        proxied.update(saved)
        running.close()


# --- 4. A database bug is not an outage ----------------------------------------------------------


def relay_records(
    caplog: pytest.LogCaptureFixture, relay: Relay, seconds: float = 0.6
) -> list[logging.LogRecord]:
    with caplog.at_level(logging.DEBUG, logger=LOGGER), serving(relay, poll_interval=0.1):
        time.sleep(seconds)
    return [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


@contextmanager
def table_renamed() -> Iterator[None]:
    table = OutboxEntry._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE {table} RENAME TO {table}_away")
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER TABLE {table}_away RENAME TO {table}")


def test_a_missing_table_is_logged_at_error_with_its_traceback_not_as_an_outage(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with table_renamed():
        records = relay_records(caplog, Relay(transports={"default": SentIdsTransport()}))
    errors = [r for r in records if r.levelno == logging.ERROR]
    # Every failed batch, not once per outage as a lost connection is (2 or more: a loaded run
    # fits only 2 batches into the window).
    assert len(errors) >= 2, [r.getMessage() for r in records]
    assert all(r.exc_info and r.exc_info[0].__name__ == "ProgrammingError" for r in errors)
    assert "not a lost connection" in errors[0].getMessage()
    assert not [r for r in records if "retrying every" in r.getMessage()]  # no outage line


def test_a_violated_constraint_is_logged_at_error_with_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """IntegrityError: a CHECK that the claim's lease breaks (``attempts`` may not grow)."""
    write("bug.topic")
    table = OutboxEntry._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE {table} ADD CONSTRAINT review_bug CHECK (attempts < 1)")
    try:
        records = relay_records(caplog, Relay(transports={"default": SentIdsTransport()}))
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER TABLE {table} DROP CONSTRAINT review_bug")
    errors = [r for r in records if r.levelno == logging.ERROR]
    assert errors, [r.getMessage() for r in records]
    assert all(r.exc_info and r.exc_info[0].__name__ == "IntegrityError" for r in errors)
    assert not [r for r in records if "retrying every" in r.getMessage()]


def test_a_lost_connection_is_still_one_warning_per_outage(
    proxy: PgProxy, caplog: pytest.LogCaptureFixture
) -> None:
    transport = SentIdsTransport()
    relay = Relay(using=PROXIED, transports={"default": transport})
    with caplog.at_level(logging.DEBUG, logger=LOGGER), serving(relay, poll_interval=0.1):
        (before,) = write("before.topic")
        assert wait_for(lambda: before in transport.sent)  # connected, through the proxy
        proxy.refuse(1.0)
        (event,) = write("outage.topic")
        assert wait_for(lambda: event in transport.sent)
    assert proxy.faults["refused"] >= 1
    records = [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]
    lines = [r.getMessage() for r in records]
    assert len(lines) == 2, lines
    assert "retrying every 0.1 s until it answers" in lines[0]
    assert "answers again" in lines[1]
    assert all(r.exc_info is None for r in records)
    # The failed batches, each with its traceback at DEBUG: a few, not a tight loop.
    debug = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.DEBUG]
    failures = [r for r in debug if "database error (failure" in r.getMessage()]
    assert 3 <= len(failures) <= 25, len(failures)


def test_a_lost_commit_answer_is_an_outage_not_a_bug(
    proxy: PgProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """The answer to the claim's COMMIT is lost: Django's atomic block then closes the broken
    connection and opens a new one before the relay sees the error, so the connection looks
    healthy; the error itself says that it was lost (no SQLSTATE, libpq's words)."""
    transport = SentIdsTransport()
    relay = Relay(using=PROXIED, transports={"default": transport})
    rule = proxy.cut(r"^\s*COMMIT\s*$", when="after", following=lease_commit_pattern())
    with caplog.at_level(logging.DEBUG, logger=LOGGER), serving(relay, poll_interval=0.1):
        (event,) = write("cut.topic")
        assert wait_for(lambda: event in transport.sent)
    assert rule.spent
    records = [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]
    lines = [r.getMessage() for r in records]
    assert [r.levelname for r in records] == ["WARNING", "WARNING"], lines
    assert "retrying every" in lines[0] and "1 message(s) of unanswered claims" in lines[1]


def test_an_error_without_sqlstate_on_a_live_connection_is_no_outage() -> None:
    """psycopg's own error for a statement with too many parameters has no SQLSTATE either."""
    if connection.vendor != "postgresql":
        pytest.skip("psycopg's error")
    from django_idempotency.outages import connection_lost

    with pytest.raises(DatabaseError) as raised, connection.cursor() as cursor:
        cursor.execute("SELECT " + ", ".join(["%s"] * 70_000), [1] * 70_000)
    assert not connection_lost(connection, raised.value)


# --- 6. The claim's READ COMMITTED stays in the claim --------------------------------------------


def snapshot_kept(read_twice: Callable[[Callable[[], None]], tuple[Any, Any]]) -> bool:
    """Whether a transaction on ``RR`` keeps its snapshot: a row changed and committed by
    another connection between two reads is not seen by the second (REPEATABLE READ)."""
    Effect.objects.create(name="before")

    def change_elsewhere() -> None:
        Effect.objects.using("default").update(name="changed")

    first, second = read_twice(change_elsewhere)
    assert first == "before"
    return bool(first == second)


def read() -> str:
    return str(Effect.objects.using(RR).values_list("name", flat=True).get())


def isolation() -> str:
    with connections[RR].cursor() as cursor:
        cursor.execute("SHOW transaction_isolation")
        return str(cursor.fetchone()[0])


def test_after_a_relay_step_the_connections_next_transaction_is_repeatable_read() -> None:
    write("isolation.topic")
    relay = Relay(using=RR, transports={"default": SentIdsTransport()})
    assert relay.run_once().sent == 1

    def fresh_transaction(change: Callable[[], None]) -> tuple[str, str]:
        with transaction.atomic(using=RR):
            first = read()
            change()
            if connection.vendor == "postgresql":
                assert isolation() == "repeatable read"
            return first, read()

    assert snapshot_kept(fresh_transaction)


def test_a_relay_step_inside_a_callers_transaction_keeps_its_isolation() -> None:
    write("isolation.topic")
    relay = Relay(using=RR, transports={"default": SentIdsTransport()})

    def around_a_relay_step(change: Callable[[], None]) -> tuple[str, str]:
        with transaction.atomic(using=RR):
            first = read()  # the caller's snapshot is taken
            assert relay.run_once().sent == 1
            change()
            if connection.vendor == "postgresql":
                assert isolation() == "repeatable read"
            return first, read()

    assert snapshot_kept(around_a_relay_step)


# --- 7. A suspect keeps the lease of a claim whose COMMIT went unanswered -----------------------


class Holding(SentIdsTransport):
    """A transport that hangs in ``send`` until released (a relay stalled past its lease)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def send(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        self.entered.set()
        assert self.release.wait(180)
        return super().send(messages)


def lease_commit_pattern() -> str:
    lease = (
        r"attempts = attempts \+ 1" if connection.vendor == "postgresql" else r"`attempts` \+ 1"
    )
    return lease


def test_a_suspect_taken_back_keeps_the_lease_while_its_first_sender_may_still_send(
    proxy: PgProxy,
) -> None:
    """Relay B leased the message and stalls in its send past its 0.5 s lease: the message is
    a suspect, and B may still deliver it. Relay A claims it (alone, as a suspect), and the
    answer to its claim's COMMIT is lost (the proxy cuts it after the server committed). At its
    next claim A takes back what its unanswered claim leased. A suspect must keep that lease:
    released, A and relay C sent it at once, while B was still on it."""
    (event,) = write("suspect.topic")
    stalled = Holding()
    b = Relay(transports={"default": stalled}, lease=0.5)
    errors: list[BaseException] = []

    def run_b() -> None:
        try:
            b.run_once()
        except BaseException as error:  # noqa: BLE001 - re-raised by the test below
            errors.append(error)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run_b)
    thread.start()
    assert stalled.entered.wait(60)
    time.sleep(0.6)  # B's lease runs out: a suspect
    a_transport, c_transport = SentIdsTransport(), SentIdsTransport()
    a = Relay(using=PROXIED, transports={"default": a_transport}, lease=30)
    c = Relay(transports={"default": c_transport}, lease=30)
    rule = proxy.cut(r"^\s*COMMIT\s*$", when="after", following=lease_commit_pattern())
    try:
        with pytest.raises(DatabaseError):
            a.run_once()
        assert rule.spent
        row = OutboxEntry.objects.get(event_id=event)
        assert row.locked_until is not None and row.attempts == 2  # A's lease committed
        assert a.run_once().claimed == 0  # the take-back: the suspect keeps A's lease
        assert c.run_once().claimed == 0
        assert a_transport.sent == c_transport.sent == []
    finally:
        stalled.release.set()
        thread.join(60)
    assert not errors, errors
    assert stalled.sent == [event]
    assert OutboxEntry.objects.get(event_id=event).state == "sent"  # B's sent mark stands


def test_a_fresh_message_of_an_unanswered_claim_is_still_taken_back_at_once(
    proxy: PgProxy,
) -> None:
    """Item 10 itself: a message that never lost a lease is taken back and sent at once."""
    (event,) = write("fresh.topic")
    transport = SentIdsTransport()
    a = Relay(using=PROXIED, transports={"default": transport}, lease=30)
    proxy.cut(r"^\s*COMMIT\s*$", when="after", following=lease_commit_pattern())
    with pytest.raises(DatabaseError):
        a.run_once()
    result = a.run_once()
    assert result.sent == 1 and transport.sent == [event]
    assert a.taken_back == 1
    assert OutboxEntry.objects.get(event_id=event).attempts == 1  # the lost claim uncounted


# --- 8. A lost LISTEN connection --------------------------------------------------------------


def listener_pid(relay: Relay) -> int:
    """The backend of the relay's LISTEN connection, or 0 while it has none."""
    listener = relay.listener
    wrapper = None if listener is None else listener.wrapper
    raw: Any = None if wrapper is None else wrapper.connection
    return 0 if raw is None else int(raw.info.backend_pid)


def test_a_lost_listen_connection_is_one_warning_then_it_listens_again(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("LISTEN is PostgreSQL's")
    monkeypatch.setattr(store.Listener, "RETRY_EVERY", 0.3)
    transport = SentIdsTransport()
    relay = Relay(transports={"default": transport})
    with caplog.at_level(logging.DEBUG, logger=LOGGER), serving(relay, poll_interval=600.0):
        assert wait_for(lambda: listener_pid(relay) != 0)
        lost = listener_pid(relay)
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [lost])
        assert wait_for(lambda: listener_pid(relay) not in (0, lost))
        (event,) = write("relisten.topic")
        # A minute, a guard against a hang: the poll interval (ten) is what a poll would take.
        assert wait_for(lambda: event in transport.sent), "not woken: polling only"
    records = [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]
    assert len(records) == 1, [r.getMessage() for r in records]
    assert records[0].getMessage().startswith("outbox relay: LISTEN connection lost (")
    assert records[0].exc_info is None
    assert any("listening again" in r.getMessage() for r in caplog.records)


def test_psycopg2_a_dropped_listen_connection_is_handled_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """psycopg2's path of :meth:`Listener.wait` on a real connection the server ends: the
    relay is told to look now, the connection is dropped, one WARNING, then quiet polling."""
    if connection.vendor != "postgresql":
        pytest.skip("LISTEN is PostgreSQL's")
    import types

    import psycopg2

    settings = connection.settings_dict
    raw = psycopg2.connect(
        host=settings["HOST"] or "127.0.0.1",
        port=settings["PORT"] or 5432,
        user=settings["USER"],
        dbname=settings["NAME"],
    )
    raw.autocommit = True
    raw.cursor().execute(f"LISTEN {store.NOTIFY_CHANNEL}")
    listener = store.Listener("default")
    listener.driver = "psycopg2"
    listener.wrapper = types.SimpleNamespace(connection=raw, close=raw.close)  # type: ignore[assignment]
    try:
        write("notified.topic")
        assert listener.wait(30.0) is True  # a real notification, through poll()
        pid = raw.get_backend_pid()
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])

        def gone() -> bool:
            with connection.cursor() as cursor:
                cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [pid])
                return bool(cursor.fetchone()[0] == 0)

        assert wait_for(gone)
        with caplog.at_level(logging.DEBUG, logger=LOGGER):
            assert listener.wait(10.0) is True  # lost: look now, a notification may be lost
            assert not listener.listening and raw.closed
            listener.report_loss(outage=False)
            started = time.monotonic()
            assert listener.wait(0.2) is False  # polls meanwhile: it waits, no tight loop
            assert time.monotonic() - started >= 0.19
            listener.report_loss(outage=False)  # reported once
    finally:
        raw.close()
        listener.close()
    records = [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]
    assert len(records) == 1, [r.getMessage() for r in records]
    assert "LISTEN connection lost" in records[0].getMessage()
    assert "server closed the connection" in records[0].getMessage() or "terminat" in (
        records[0].getMessage()
    )
