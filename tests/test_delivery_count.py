"""The delivery count of process_event: the SQL it sends, a duplicate that writes nothing, the
asynchronous count on PostgreSQL (``ASYNC_DELIVERY_COUNT``), and a poison message that SIGKILLs
a real process on every delivery, parked with either setting."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from django.db import OperationalError, connection, connections, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_idempotency import new_event_id
from django_idempotency.events.core import (
    _park_and_raise,
    count_delivery,
    park_message,
    process_event,
)
from django_idempotency.exceptions import EventParked, OnCommitFailed
from django_idempotency.models import EventDelivery, ProcessedEvent
from django_idempotency.signals import event_duplicate, event_parked
from testproject.shop.models import Effect
from tests.workers import REPO, database_url

ASYNC = {"ASYNC_DELIVERY_COUNT": True}
COUNT_FUNCTION = "django_idempotency_count_v1"
RESERVE_FUNCTION = "django_idempotency_reserve_v2"
TRANSACTION_CONTROL = ("BEGIN", "COMMIT", "SAVEPOINT", "RELEASE SAVEPOINT", "ROLLBACK TO")


def statements(queries: CaptureQueriesContext) -> list[str]:
    """The statements sent, without transaction control (which differs between backends)."""
    sql = [str(query["sql"]) for query in queries.captured_queries]
    return [s for s in sql if not s.upper().startswith(TRANSACTION_CONTROL)]


def apply_effect() -> str:
    Effect.objects.create(name="counted")
    return "applied"


def deliver(event_id: str = "evt") -> tuple[Any, list[str]]:
    with CaptureQueriesContext(connection) as queries:
        outcome = process_event("ledger", event_id, apply_effect)
    return outcome, statements(queries)


def delivery_table() -> str:
    return connection.ops.quote_name(EventDelivery._meta.db_table)


def processed_table() -> str:
    return connection.ops.quote_name(ProcessedEvent._meta.db_table)


@pytest.mark.pooler
@pytest.mark.django_db(transaction=True)
def test_a_first_delivery_counts_then_reserves_then_applies() -> None:
    outcome, sent = deliver()

    assert outcome.applied is True
    if connection.vendor == "mysql":
        # A plain read of the processed event, the upsert and its read-back, then the rest.
        assert sent[0].startswith(f"SELECT 1 FROM {processed_table()}")
        assert sent[1].startswith(f"INSERT INTO {delivery_table()}")
        assert "ON DUPLICATE KEY UPDATE" in sent[1]
        assert sent[2].startswith("SELECT")
        counted = 3
    elif connection.vendor == "postgresql":
        # One query: the count function (migration 0006) commits apart, then the reservation's
        # opens the business transaction (tests/test_pg_roundtrips.py counts the round trips).
        assert sent[0].startswith(f"SELECT * FROM {COUNT_FUNCTION}(")
        assert f"); COMMIT; BEGIN; SELECT {RESERVE_FUNCTION}(" in sent[0]
        counted = 0
    else:
        # One statement: counted only WHERE NOT EXISTS the processed event.
        assert sent[0].startswith(f"INSERT INTO {delivery_table()}")
        assert f"WHERE NOT EXISTS (SELECT 1 FROM {processed_table()} WHERE" in sent[0]
        assert "RETURNING" in sent[0]
        counted = 1
    if connection.vendor != "postgresql":
        assert sent[counted].startswith(f"INSERT INTO {processed_table()}")
    assert sent[counted + 1].startswith("INSERT INTO")  # the effect
    assert len(sent) == counted + 2
    assert EventDelivery.objects.get().deliveries == 1


@pytest.mark.pooler
@pytest.mark.django_db(transaction=True)
def test_a_duplicate_writes_nothing() -> None:
    deliver()
    before = EventDelivery.objects.get()
    received: list[dict[str, Any]] = []

    def receiver(**kwargs: Any) -> None:
        received.append({k: v for k, v in kwargs.items() if k != "signal"})

    event_duplicate.connect(receiver)
    try:
        with CaptureQueriesContext(connection) as queries:
            outcome = process_event("ledger", "evt", apply_effect)
    finally:
        event_duplicate.disconnect(receiver)

    assert (outcome.applied, outcome.result) == (False, None)
    sent = [str(query["sql"]) for query in queries.captured_queries]
    if connection.vendor == "postgresql":
        # The query that counts and reserves: both found the processed event. It opened the
        # business transaction, which commits having written nothing.
        assert sent == ["BEGIN", sent[1], "COMMIT"], sent
        assert sent[1].startswith(f"SELECT * FROM {COUNT_FUNCTION}(")
        assert f"; COMMIT; BEGIN; SELECT {RESERVE_FUNCTION}(" in sent[1]
    else:
        # Not even a BEGIN or a COMMIT: the count's own statement found the processed event.
        assert len(sent) == 1, sent
        if connection.vendor == "mysql":
            assert sent[0].startswith(f"SELECT 1 FROM {processed_table()}")
        else:
            assert "WHERE NOT EXISTS" in sent[0]
    assert ProcessedEvent.objects.count() == 1
    after = EventDelivery.objects.get()
    assert (after.deliveries, after.last_delivered_at) == (1, before.last_delivered_at)
    assert Effect.objects.count() == 1
    assert received == [{"sender": "ledger", "event_id": "evt", "topic": ""}]


@pytest.mark.django_db(transaction=True)
def test_a_failed_delivery_is_counted_and_the_next_one_too() -> None:
    def fail() -> None:
        raise RuntimeError("the body failed")

    with pytest.raises(RuntimeError):
        process_event("ledger", "evt", fail)
    outcome, _ = deliver()

    assert outcome.applied is True
    assert EventDelivery.objects.get().deliveries == 2


@pytest.mark.postgres
@pytest.mark.django_db
def test_the_guard_finds_a_processed_event_in_its_partition() -> None:
    """With EVENT_PARTITIONS, the guard asks for the partition key too, as the reservation's
    conflict target does."""
    from django_idempotency.retention import partitioning

    with override_settings(IDEMPOTENCY={"EVENT_PARTITIONS": "day"}):
        partitioning.convert("default")  # inside the test's transaction: rolled back after
        event_id = str(new_event_id())
        first, sent = deliver(event_id)
        again, duplicate = deliver(event_id)

    assert (first.applied, again.applied) == (True, False)
    column = connection.ops.quote_name(partitioning.PARTITION_COLUMN)
    assert f"{column} = " in sent[0].split("NOT EXISTS", 1)[1]
    assert len(duplicate) == 1
    assert EventDelivery.objects.get().deliveries == 1


# --- ASYNC_DELIVERY_COUNT (PostgreSQL) ----------------------------------------------------------


def synchronous_commit() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SHOW synchronous_commit")
        return str(cursor.fetchone()[0])


@pytest.mark.pooler
@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_the_async_count_leaves_the_business_commit_synchronous() -> None:
    seen: list[str] = []

    def body() -> None:
        seen.append(synchronous_commit())
        Effect.objects.create(name="counted")

    with override_settings(IDEMPOTENCY=ASYNC), CaptureQueriesContext(connection) as queries:
        assert process_event("ledger", "evt", body).applied

    count = next(str(q["sql"]) for q in queries.captured_queries if COUNT_FUNCTION in q["sql"])
    # The function's last argument: it runs set_config('synchronous_commit', 'off', true).
    assert count.startswith(f"SELECT * FROM {COUNT_FUNCTION}(")
    assert ", true); COMMIT; BEGIN; " in count
    # Scoped to the count's own transaction: the effect's COMMIT waits on its flush
    # (and so makes the count durable with it), and the session is left as it was.
    assert seen == ["on"]
    assert synchronous_commit() == "on"
    assert EventDelivery.objects.get().deliveries == 1


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_inside_an_outer_transaction_the_count_is_never_asynchronous() -> None:
    with (
        override_settings(IDEMPOTENCY=ASYNC),
        CaptureQueriesContext(connection) as queries,
        transaction.atomic(),
    ):
        assert process_event("ledger", "evt", apply_effect).applied
        # set_config(..., true) here would last until the OUTER commit, the business one.
        assert synchronous_commit() == "on"

    counts = [str(q["sql"]) for q in queries.captured_queries if COUNT_FUNCTION in str(q["sql"])]
    assert len(counts) == 1 and counts[0].endswith(", false)"), counts


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_by_default_the_count_commits_synchronously() -> None:
    _, sent = deliver()
    assert "set_config" not in sent[0]
    assert ", false); COMMIT; BEGIN; " in sent[0]


@pytest.mark.postgres
@pytest.mark.mysql
@pytest.mark.django_db(transaction=True)
def test_the_count_stays_committed_when_the_reservation_fails() -> None:
    """The count commits before the reservation runs: here the reservation waits on another
    transaction that holds the event, and gives up (``lock_timeout``), so nothing is applied;
    the delivery is counted all the same, and the next one counts as the second."""
    other = connections.create_connection(connection.alias)
    try:
        with other.cursor() as cursor:
            # Another delivery holds the event: its reservation is not committed yet.
            other.set_autocommit(False)
            cursor.execute(
                f"INSERT INTO {processed_table()} (consumer, event_id, topic, processed_at, "
                "expires_at) VALUES (%s, %s, '', %s, %s)",
                ["ledger", "evt", timezone.now(), timezone.now() + timedelta(days=1)],
            )
        with connection.cursor() as cursor:
            if connection.vendor == "mysql":
                cursor.execute("SET SESSION innodb_lock_wait_timeout = 1")
            else:
                cursor.execute("SET lock_timeout = '200ms'")
        try:
            with pytest.raises(OperationalError):
                process_event("ledger", "evt", apply_effect)
        finally:
            with connection.cursor() as cursor:
                if connection.vendor == "mysql":
                    cursor.execute("SET SESSION innodb_lock_wait_timeout = DEFAULT")
                else:
                    cursor.execute("RESET lock_timeout")
        assert EventDelivery.objects.get().deliveries == 1
        assert not Effect.objects.exists()
        other.rollback()  # the other delivery failed
    finally:
        other.close()

    outcome, _ = deliver()
    assert outcome.applied is True
    assert EventDelivery.objects.get().deliveries == 2


# --- redelivered: what the broker says of a message ----------------------------------------------


def fail() -> None:
    raise RuntimeError("the body failed")


@pytest.mark.pooler
@pytest.mark.django_db(transaction=True)
def test_a_first_delivery_the_broker_vouches_for_skips_its_count() -> None:
    with CaptureQueriesContext(connection) as queries:
        outcome = process_event("ledger", "evt", apply_effect, redelivered=False)

    assert (outcome.applied, outcome.result) == (True, "applied")
    sent = statements(queries)
    if connection.vendor == "postgresql":
        # The reservation's call reads the counter too (its last argument), then the effect.
        assert sent[0].startswith(f"SELECT {RESERVE_FUNCTION}(") and sent[0].endswith(", true)")
        assert len(sent) == 2, sent
    else:
        # The reservation, a plain read of the counter, the effect: no count, no commit of its
        # own.
        assert sent[0].startswith(f"INSERT INTO {processed_table()}")
        assert sent[1].startswith("SELECT") and delivery_table() in sent[1]
        assert len(sent) == 3, sent
    assert not any("ON CONFLICT" in s and delivery_table() in s for s in sent)
    assert not EventDelivery.objects.exists()
    assert Effect.objects.count() == 1
    assert process_event("ledger", "evt", apply_effect, redelivered=False).applied is False


@pytest.mark.django_db(transaction=True)
def test_a_failed_first_delivery_counts_itself_and_a_success_clears_its_error() -> None:
    with pytest.raises(RuntimeError, match="the body failed"):
        process_event("ledger", "evt", fail, redelivered=False)
    counter = EventDelivery.objects.get()
    assert (counter.deliveries, counter.last_error) == (1, "RuntimeError: the body failed")

    # A retry is a new message, a first delivery again (Celery publishes one).
    assert process_event("ledger", "evt", apply_effect, redelivered=False).applied is True
    counter.refresh_from_db()
    assert (counter.deliveries, counter.last_error) == (1, "")
    assert Effect.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_redelivery_counts_the_first_delivery_that_skipped_its_count() -> None:
    # The first delivery died with its process: nothing of it is left in the database.
    assert process_event("ledger", "evt", apply_effect, redelivered=True).applied is True
    assert EventDelivery.objects.get().deliveries == 2


@pytest.mark.django_db(transaction=True)
def test_a_parked_event_refuses_a_first_delivery_before_its_body_runs() -> None:
    ran: list[bool] = []
    for _ in range(3):  # max_deliveries=2: the third delivery is parked
        with pytest.raises((RuntimeError, EventParked)):
            process_event("ledger", "evt", fail, max_deliveries=2)
    assert EventDelivery.objects.get().parked_at is not None

    with pytest.raises(EventParked, match="is parked"):
        process_event("ledger", "evt", lambda: ran.append(True), redelivered=False)
    assert ran == []
    assert not ProcessedEvent.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_first_deliveries_that_keep_failing_park_the_event() -> None:
    """A loop of retries, each a new message, ends: the failure that passes the limit parks the
    event, and the next delivery is refused without running."""
    parked: list[dict[str, Any]] = []

    def receiver(**kwargs: Any) -> None:
        parked.append({k: v for k, v in kwargs.items() if k != "signal"})

    ran: list[bool] = []

    def failing() -> None:
        ran.append(True)
        fail()

    event_parked.connect(receiver)
    try:
        for _ in range(2):
            with pytest.raises(RuntimeError):
                process_event("ledger", "evt", failing, max_deliveries=2, redelivered=False)
    finally:
        event_parked.disconnect(receiver)
    counter = EventDelivery.objects.get()
    assert counter.deliveries == 2 and counter.parked_at is not None
    assert parked == [{"sender": "ledger", "event_id": "evt", "topic": "", "deliveries": 2}]

    # As with a count before each delivery: the body ran max_deliveries times, and the next
    # delivery is refused before it runs, and counted.
    with pytest.raises(EventParked, match=r"is parked \(3 deliveries\)"):
        process_event("ledger", "evt", failing, max_deliveries=2, redelivered=False)
    assert ran == [True, True]
    assert EventDelivery.objects.get().deliveries == 3
    assert not Effect.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_an_on_commit_failure_of_a_first_delivery_is_recorded_on_its_counter() -> None:
    def body() -> None:
        Effect.objects.create(name="counted")
        transaction.on_commit(fail)

    with pytest.raises(OnCommitFailed):
        process_event("ledger", "evt", body, redelivered=False)
    counter = EventDelivery.objects.get()
    assert counter.last_error.startswith("OnCommitFailed: ")
    assert ProcessedEvent.objects.filter(event_id="evt").exists()


@pytest.mark.postgres
@pytest.mark.mysql
@pytest.mark.django_db(transaction=True)
def test_a_failed_first_delivery_leaves_no_error_on_a_retry_that_applied_the_event() -> None:
    """Celery's autoretry publishes the retry before the failed delivery has ended. The retry
    reserves the event as soon as the failure rolls back, while the failure is still counting
    itself: the failure must wait for the retry, find the event applied, and record nothing.
    (Recording it at once, as a count before the reservation would, leaves an error on an
    applied event that nothing clears.)"""
    failed_holds, retry_holds, go = threading.Event(), threading.Event(), threading.Event()
    outcomes: dict[str, Any] = {}

    def failing_body() -> None:
        failed_holds.set()
        time.sleep(0.3)  # the retry arrives meanwhile and waits on the reservation
        raise RuntimeError("first attempt")

    def retry_body() -> str:
        retry_holds.set()
        go.wait(10)  # the failure's own bookkeeping runs now, while this one is in flight
        Effect.objects.create(name="counted")
        return "applied"

    def deliver_in_thread(name: str, body: Any) -> None:
        try:
            outcomes[name] = process_event("ledger", "evt", body, redelivered=False).result
        except Exception as exc:  # noqa: BLE001 - asserted below
            outcomes[name] = exc
        finally:
            connections.close_all()

    failed = threading.Thread(target=deliver_in_thread, args=("failed", failing_body))
    failed.start()
    assert failed_holds.wait(60)
    retry = threading.Thread(target=deliver_in_thread, args=("retry", retry_body))
    retry.start()
    assert retry_holds.wait(60)
    time.sleep(0.3)  # time for the failure to count itself, were it not waiting
    go.set()
    failed.join(60)  # guards against a hang, not timings
    retry.join(60)

    assert isinstance(outcomes["failed"], RuntimeError)
    assert outcomes["retry"] == "applied"
    assert Effect.objects.count() == 1
    assert not EventDelivery.objects.exclude(last_error="").exists()


@pytest.mark.django_db
def test_redelivered_must_be_a_bool_or_none() -> None:
    with pytest.raises(TypeError, match="redelivered must be True, False or None"):
        process_event("ledger", "evt", apply_effect, redelivered="no")  # type: ignore[arg-type]


# --- A poison message that SIGKILLs its process, on every delivery -----------------------------

POISON = textwrap.dedent(
    """
    import os, signal, sys
    import django
    django.setup()
    from django.test import override_settings
    from django_idempotency.events.core import process_event
    from django_idempotency.exceptions import EventParked
    from testproject.shop.models import Effect

    def body():
        Effect.objects.create(name="poison")
        os.kill(os.getpid(), signal.SIGKILL)

    # "flag": the broker's redelivered flag, False on the first delivery and True after it.
    redelivered = {"sync": None, "async": None, "flag-first": False, "flag-again": True}
    with override_settings(IDEMPOTENCY={"ASYNC_DELIVERY_COUNT": sys.argv[1] == "async"}):
        try:
            process_event(
                "poison", "evt-poison", body, max_deliveries=2,
                redelivered=redelivered[sys.argv[1]],
            )
        except EventParked:
            sys.exit(3)
    """
)
PARKED_EXIT = 3


@pytest.mark.slow
@pytest.mark.pooler
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("count", ["sync", "async", "flag"])
def test_a_poison_message_that_kills_its_process_is_parked(count: str) -> None:
    """sync, async: every delivery counted (ASYNC_DELIVERY_COUNT off, on). flag: the broker
    vouches for the first delivery (redelivered=False), which skips its count; the later ones
    say redelivered=True and count for it."""
    env = {
        "DJANGO_SETTINGS_MODULE": "testproject.settings",
        "DATABASE_URL": database_url(connection.settings_dict),
        "PYTHONPATH": str(REPO),
    }
    codes = []
    for delivery in range(3):
        mode = count if count != "flag" else ("flag-first" if delivery == 0 else "flag-again")
        run = subprocess.run(
            [sys.executable, "-c", POISON, mode],
            cwd=REPO,
            env={**os.environ, **env},
            capture_output=True,
            timeout=600,  # a bound, not a timing: the matrix lanes run at nice 19
        )
        codes.append(run.returncode)
        assert run.returncode in (-signal.SIGKILL, PARKED_EXIT), run.stderr.decode()[-2000:]

    # Two deliveries died with their process, after their count committed; the third is parked.
    assert codes == [-signal.SIGKILL, -signal.SIGKILL, PARKED_EXIT]
    delivery = EventDelivery.objects.get(consumer="poison")
    assert (delivery.deliveries, delivery.parked_at is not None) == (3, True)
    assert not Effect.objects.exists()
    assert not ProcessedEvent.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_parking_an_already_parked_delivery_signals_once_and_keeps_parked_at() -> None:
    """Two deliveries may each decide to park one event (two workers past the limit at once),
    and a message without an id may be parked again when the broker redelivers it. The second
    park must neither signal again (an alert would fire twice) nor move ``parked_at`` (the admin
    and the purge read it as the moment the event was given up)."""
    parked: list[str] = []

    def receiver(**kwargs: Any) -> None:
        parked.append(kwargs["event_id"])

    event_parked.connect(receiver)
    try:
        delivery = count_delivery("evt-twice", "ledger", using="default")
        for _ in range(2):
            with pytest.raises(EventParked):
                _park_and_raise(delivery, 1, "default")
            if len(parked) == 1 and not EventDelivery.objects.filter(parked_at=None).exists():
                first_parked_at = EventDelivery.objects.get(event_id="evt-twice").parked_at
        for _ in range(2):
            park_message("ledger", "task-7", "no event id")
            if len(parked) == 2:
                first_message_parked_at = EventDelivery.objects.get(
                    event_id="no-event-id:task-7"
                ).parked_at
    finally:
        event_parked.disconnect(receiver)

    assert parked == ["evt-twice", "no-event-id:task-7"]
    assert EventDelivery.objects.get(event_id="evt-twice").parked_at == first_parked_at
    message = EventDelivery.objects.get(event_id="no-event-id:task-7")
    assert message.parked_at == first_message_parked_at
    assert message.deliveries == 2  # each delivery of the message still counts
