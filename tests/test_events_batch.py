"""process_first_deliveries: a batch of first deliveries in the caller's transaction, on each
database backend: one reservation per event, made for the whole batch in a few statements,
no savepoint per event, and every doubt (a parked event, a reservation another transaction
made meanwhile) raised for the caller to roll back and go one event at a time."""

from __future__ import annotations

import math
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import IntegrityError, OperationalError, connection, transaction
from django.db.transaction import TransactionManagementError
from django.test import override_settings
from django.utils import timezone

from django_idempotency import signals, try_reserve
from django_idempotency.events.core import count_delivery, process_first_deliveries
from django_idempotency.events.ids import new_event_id
from django_idempotency.events.store import chunk_size, fail_reserved
from django_idempotency.exceptions import EventParked, OnCommitFailed
from django_idempotency.models import EventDelivery, ProcessedEvent
from testproject.shop.models import Effect
from tests.lock_waits import session_of, wait_until_blocked
from tests.test_events import (  # noqa: F401 - threads: the fixture
    DOOMS,
    JOIN_TIMEOUT,
    Threads,
    doom_transaction,
    threads,
)

pytestmark = pytest.mark.django_db(transaction=True)


def effect(event: str, ran: list[str], using: str = "default") -> Callable[[], str]:
    def body() -> str:
        ran.append(event)
        Effect.objects.using(using).create(name="batch", payload=event)
        return f"done {event}"

    return body


@pytest.fixture
def statements() -> Iterator[list[str]]:
    """Every SQL statement run on the default connection during the test."""
    seen: list[str] = []

    def record(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        yield seen


def test_each_event_is_reserved_and_applied_once_in_the_callers_transaction() -> None:
    ProcessedEvent.objects.create(
        consumer="ledger", event_id="old", topic="t", expires_at=timezone.now()
    )
    ran: list[str] = []
    duplicates: list[str] = []

    def on_duplicate(sender: str, event_id: str, **kwargs: Any) -> None:
        duplicates.append(event_id)

    signals.event_duplicate.connect(on_duplicate)
    try:
        with transaction.atomic():
            results = process_first_deliveries(
                "ledger",
                [(e, effect(e, ran)) for e in ("a", "old", "b", "a")],
                topic="t",
            )
    finally:
        signals.event_duplicate.disconnect(on_duplicate)

    assert [(r.applied, r.result) for r in results] == [
        (True, "done a"),
        (False, None),
        (True, "done b"),
        (False, None),  # a second occurrence in the batch is a duplicate
    ]
    assert ran == ["a", "b"]
    assert duplicates == ["old", "a"]
    assert sorted(ProcessedEvent.objects.values_list("event_id", flat=True)) == ["a", "b", "old"]
    assert EventDelivery.objects.count() == 0  # first deliveries: nothing counted


def test_a_rollback_of_the_callers_transaction_takes_every_reservation_with_it() -> None:
    ran: list[str] = []
    with pytest.raises(RuntimeError), transaction.atomic():
        process_first_deliveries("ledger", [(e, effect(e, ran)) for e in ("a", "b")])
        raise RuntimeError("the caller rolls back")
    assert ProcessedEvent.objects.count() == 0
    assert Effect.objects.count() == 0


def test_the_reservations_of_a_batch_take_three_statements_and_no_savepoint(
    statements: list[str],
) -> None:
    """Regression: each event took a savepoint of its own, and on MariaDB its reservation one
    more (seven statements per message with the handler's insert); now the batch's
    reservations take one read, one insert and one counter read, whatever its size."""
    ran: list[str] = []
    with transaction.atomic():
        statements.clear()
        process_first_deliveries("ledger", [(f"e{i}", effect(f"e{i}", ran)) for i in range(40)])
        batch = list(statements)
    assert len(ran) == 40
    reservations = [s for s in batch if "django_idempotency_" in s]
    assert len(reservations) == 3, reservations
    assert not [s for s in batch if "SAVEPOINT" in s.upper()]
    assert len(batch) == 3 + 40  # and one insert per body


def test_an_event_parked_before_refuses_the_batch_before_any_body_runs() -> None:
    EventDelivery.objects.create(
        consumer="ledger",
        event_id="poison",
        deliveries=3,
        parked_at=timezone.now(),
        expires_at=timezone.now(),
    )
    ran: list[str] = []
    with pytest.raises(EventParked, match="one event at a time"), transaction.atomic():
        process_first_deliveries("ledger", [(e, effect(e, ran)) for e in ("a", "poison", "b")])
    assert ran == []
    assert ProcessedEvent.objects.count() == 0


def test_the_error_an_earlier_delivery_left_is_cleared_with_the_success() -> None:
    EventDelivery.objects.create(
        consumer="ledger",
        event_id="flaky",
        deliveries=1,
        last_error="RuntimeError: the first try",
        expires_at=timezone.now(),
    )
    EventDelivery.objects.create(
        consumer="ledger", event_id="other", last_error="kept", expires_at=timezone.now()
    )
    with transaction.atomic():
        process_first_deliveries("ledger", [("flaky", lambda: None), ("a", lambda: None)])
    errors = dict(EventDelivery.objects.values_list("event_id", "last_error"))
    assert errors == {"flaky": "", "other": "kept"}


def test_more_events_than_one_statement_takes(statements: list[str]) -> None:
    events = [f"e{i}" for i in range(1203)]
    with transaction.atomic():
        process_first_deliveries("ledger", [(e, lambda: None) for e in events])
    assert ProcessedEvent.objects.count() == 1203
    inserts = [s for s in statements if s.startswith("INSERT")]
    # 500 rows per statement, or fewer where Django bounds a statement's values: 199 rows on
    # SQLite under Django 5.2 (999 values); Django 6 reads this SQLite's own limit.
    per = chunk_size(connection)
    if connection.features.max_query_params == 999:
        assert per == 199
    assert len(inserts) == math.ceil(1203 / per) > 1


@pytest.mark.sqlite
def test_a_batch_fits_the_999_values_of_sqlite_before_3_32() -> None:
    """Regression: 500 rows of five values, 2,500 in one statement, where SQLite before 3.32
    (Ubuntu 20.04's 3.31, which Django 5.2 supports) binds at most 999: every batch of more
    than 199 events failed with "too many SQL variables", and the Kafka runner fell back to
    one message at a time each time. This SQLite binds 32,766: the test lowers its limit."""
    with transaction.atomic():
        raw = connection.connection
        assert raw is not None
        before = raw.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 999)
        try:
            process_first_deliveries("ledger", [(f"e{i}", lambda: None) for i in range(450)])
        finally:
            raw.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, before)
    assert ProcessedEvent.objects.count() == 450


def test_outside_a_transaction_it_refuses() -> None:
    with pytest.raises(TransactionManagementError, match=r"inside transaction\.atomic"):
        process_first_deliveries("ledger", [("a", lambda: None)])
    assert ProcessedEvent.objects.count() == 0


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.mysql
def test_an_event_reserved_by_another_transaction_meanwhile_raises(threads: Threads) -> None:  # noqa: F811
    """The read of the processed events only guides the insert: an event another transaction
    holds (uncommitted, so the read misses it) makes the batch's plain insert wait, then raise
    the duplicate-key error once that transaction commits. Never a second reservation."""
    held, release = threading.Event(), threading.Event()

    def other() -> None:
        with transaction.atomic():
            assert try_reserve("raced", "ledger")
            held.set()
            release.wait(JOIN_TIMEOUT)

    threads.start(other)
    assert held.wait(JOIN_TIMEOUT)
    threading.Timer(0.5, release.set).start()
    ran: list[str] = []
    with pytest.raises(IntegrityError), transaction.atomic():
        process_first_deliveries("ledger", [(e, effect(e, ran)) for e in ("a", "raced")])
    threads.join()
    assert release.is_set()  # the insert waited for the other transaction
    assert ran == []
    assert list(ProcessedEvent.objects.values_list("event_id", flat=True)) == ["raced"]


def test_bodies_run_in_order_after_all_reservations() -> None:
    order: list[str] = []

    def body(event: str) -> Callable[[], None]:
        def run() -> None:
            reserved = set(ProcessedEvent.objects.values_list("event_id", flat=True))
            order.append(f"{event}:{sorted(reserved)}")

        return run

    with transaction.atomic():
        process_first_deliveries("ledger", [(e, body(e)) for e in ("x", "y")])
    assert order == ["x:['x', 'y']", "y:['x', 'y']"]


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.mysql
@pytest.mark.django_db(transaction=True, databases=["default", "repeatable_read"])
@pytest.mark.parametrize("alias", ["default", "repeatable_read"])
def test_an_event_parked_while_the_insert_waits_is_refused(
    threads: Threads,  # noqa: F811
    alias: str,
) -> None:
    """Regression: the batch's first read (of the processed events) fixed the snapshot under
    REPEATABLE READ, and the counters were read in it after the insert had waited for a failed
    delivery that parked the event and gave its reservation up (``_fail_first_delivery``):
    the parked event ran, and was marked processed. On MariaDB (fixed first) the counters are
    a locking read, which reads the latest committed rows whatever the isolation level; the
    batch is refused as parked. On PostgreSQL, whose locking reads see the snapshot too, the
    read also inserts the counters at that level, and the parked one it meets, committed
    after the snapshot, raises a serialization failure: the batch rolls back, and the runner
    goes one message at a time. ``repeatable_read`` is the test database through connections
    at REPEATABLE READ, as ``OPTIONS`` sets it."""
    held, release = threading.Event(), threading.Event()
    session: dict[str, int] = {}

    def failed_delivery() -> None:  # what _fail_first_delivery does, held open a while
        with transaction.atomic():
            assert try_reserve("poison", "ledger")
            held.set()
            assert release.wait(JOIN_TIMEOUT)
            count_delivery("poison", "ledger")
            fail_reserved("default", "ledger", "poison", RuntimeError("died"), park=True)

    ran: list[str] = []

    def batch() -> None:
        session["batch"] = session_of(alias)
        with transaction.atomic(using=alias):
            process_first_deliveries(
                "ledger", [(e, effect(e, ran, alias)) for e in ("a", "poison")], using=alias
            )

    threads.start(failed_delivery)
    assert held.wait(JOIN_TIMEOUT)
    threads.start(batch)
    while "batch" not in session:
        assert not threads.errors, threads.errors
        time.sleep(0.01)
    wait_until_blocked(session["batch"], "the batch's insert")
    release.set()
    if alias != "default" and connection.vendor == "postgresql":
        with pytest.raises(OperationalError, match="could not serialize"):
            threads.join()
    else:
        with pytest.raises(EventParked, match="one event at a time"):
            threads.join()
    assert ran == []
    assert not ProcessedEvent.objects.exists()
    [parked] = EventDelivery.objects.all()
    assert parked.parked_at is not None and parked.last_error == "RuntimeError: died"


@pytest.mark.parametrize("how", DOOMS)
def test_a_body_that_leaves_the_transaction_unable_to_commit_refuses_the_batch(how: str) -> None:
    """Regression: each event had a savepoint, whose release failed once a body had aborted
    the transaction (PostgreSQL) or marked it for rollback, and the batch fell back to one
    event at a time. Without savepoints, the batch's COMMIT rolled every event back without
    an error, and the Kafka runner committed their offsets: the whole batch lost."""
    if how != "set_rollback" and connection.vendor != "postgresql":
        pytest.skip("only PostgreSQL aborts a transaction on a failed statement")

    def doom() -> None:
        doom_transaction(how)

    ran: list[str] = []
    with (
        pytest.raises(TransactionManagementError, match="unable to commit"),
        transaction.atomic(),
    ):
        process_first_deliveries(
            "ledger", [("a", effect("a", ran)), ("b", doom), ("c", effect("c", ran))]
        )
    assert ran == ["a"]
    assert ProcessedEvent.objects.count() == 0


class CallbackFailed(RuntimeError):
    pass


def hooking(event: str, ran: list[str], fail: bool = False, robust: bool = False) -> Any:
    """A body that registers ``on_commit`` callbacks recording ``event``; with ``fail``, one
    that raises (``robust``, or not) before the second of them."""

    def body() -> None:
        transaction.on_commit(lambda: ran.append(f"{event} 1"))
        if fail:

            def raises() -> None:
                raise CallbackFailed(f"callback of {event}")

            transaction.on_commit(raises, robust=robust)
        transaction.on_commit(lambda: ran.append(f"{event} 2"))

    return body


def test_a_callback_that_raises_skips_only_its_own_bodys_later_callbacks() -> None:
    """Regression: Django runs a transaction's callbacks until one raises, and raises after
    the COMMIT, so a batch's failing callback skipped every other event's later callbacks and
    came out of the caller's ``atomic`` as if the batch had failed. Each body's callbacks now
    behave as in a transaction of its own: the failure skips the rest of that body's, is
    logged and kept in the event's counter (as ``process_event`` keeps it), and is reported to
    the caller; nothing is raised after the COMMIT."""
    ran: list[str] = []
    reported: list[tuple[int, Exception]] = []
    with transaction.atomic():
        results = process_first_deliveries(
            "ledger",
            [
                ("a", hooking("a", ran)),
                ("b", hooking("b", ran, fail=True)),
                ("c", hooking("c", ran)),
            ],
            on_commit_failed=lambda index, failure: reported.append((index, failure)),
        )
    assert [r.applied for r in results] == [True, True, True]
    assert ran == ["a 1", "a 2", "b 1", "c 1", "c 2"]
    assert ProcessedEvent.objects.count() == 3
    [(index, failure)] = reported
    assert index == 1 and isinstance(failure, OnCommitFailed)
    assert isinstance(failure.__cause__, CallbackFailed)
    [counter] = EventDelivery.objects.all()
    assert counter.event_id == "b" and counter.parked_at is None
    assert counter.last_error.startswith("OnCommitFailed: Event b for consumer 'ledger'")


def test_a_robust_callback_that_raises_is_djangos_to_log() -> None:
    ran: list[str] = []
    reported: list[tuple[int, Exception]] = []
    with transaction.atomic():
        process_first_deliveries(
            "ledger",
            [("a", hooking("a", ran, fail=True, robust=True)), ("b", hooking("b", ran))],
            on_commit_failed=lambda index, failure: reported.append((index, failure)),
        )
    assert ran == ["a 1", "a 2", "b 1", "b 2"]
    assert reported == []
    assert not EventDelivery.objects.exists()


def test_a_rolled_back_batch_runs_no_callback() -> None:
    ran: list[str] = []
    with pytest.raises(CallbackFailed), transaction.atomic():
        process_first_deliveries("ledger", [("a", hooking("a", ran))])
        raise CallbackFailed("the caller's own failure")
    assert ran == []


@pytest.mark.postgres
@pytest.mark.django_db
def test_callbacks_keep_to_their_body_on_the_partitioned_layout(
    django_capture_on_commit_callbacks: Any,
) -> None:
    """With EVENT_PARTITIONS each event goes through process_event in a savepoint; its
    callbacks wait for the caller's commit all the same, and keep to their body too. (The
    layout is converted inside the test's transaction, so the callbacks run as Django's
    test case runs them, from the list a commit would run.)"""
    from django_idempotency.retention import partitioning

    ran: list[str] = []
    reported: list[int] = []
    with override_settings(IDEMPOTENCY={"EVENT_PARTITIONS": "day"}):
        partitioning.convert("default")
        with django_capture_on_commit_callbacks(execute=True), transaction.atomic():
            process_first_deliveries(
                "ledger",
                [(str(new_event_id()), hooking(name, ran, fail=name == "b")) for name in "abc"],
                on_commit_failed=lambda index, failure: reported.append(index),
            )
        assert ran == ["a 1", "a 2", "b 1", "c 1", "c 2"]
        assert reported == [1]
