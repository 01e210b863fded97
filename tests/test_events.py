"""try_reserve, delivery counting, process_event and new_event_id, on each database backend."""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import (
    DatabaseError,
    IntegrityError,
    OperationalError,
    connection,
    connections,
    transaction,
)
from django.db.transaction import TransactionManagementError
from django.test import override_settings
from django.utils import timezone

from django_idempotency import new_event_id, signals, try_reserve
from django_idempotency.events.core import count_delivery, normalize_event_id, process_event
from django_idempotency.events.ids import checked_event_id
from django_idempotency.events.store import insert_new, mysql_errno
from django_idempotency.exceptions import EventParked, InvalidEventId, MissingEventId
from django_idempotency.models import EventDelivery, ProcessedEvent
from testproject.shop.models import Effect

JOIN_TIMEOUT = 60.0  # a guard against a hang, never a timing


class Boom(Exception):
    pass


class Threads:
    """Run functions in threads, each with its own connection; re-raise their errors."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []

    def start(self, target: Callable[[], Any]) -> None:
        def run() -> None:
            try:
                target()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
                self.errors.append(exc)
            finally:
                connections.close_all()

        thread = threading.Thread(target=run, daemon=True)
        self.threads.append(thread)
        thread.start()

    def join(self) -> None:
        for thread in self.threads:
            thread.join(JOIN_TIMEOUT)
            assert not thread.is_alive(), "a thread did not finish in time"
        if self.errors:
            raise self.errors[0]


@pytest.fixture
def threads() -> Iterator[Threads]:
    runner = Threads()
    yield runner
    for thread in runner.threads:
        thread.join(JOIN_TIMEOUT)


@pytest.fixture
def received() -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """Every consumer signal sent during the test, as (signal name, kwargs)."""
    calls: list[tuple[str, dict[str, Any]]] = []
    receivers = {}
    for name in ("event_duplicate", "event_parked"):

        def receiver(sender: str, _name: str = name, **kwargs: Any) -> None:
            kwargs.pop("signal")
            calls.append((_name, {"sender": sender, **kwargs}))

        receivers[name] = receiver
        getattr(signals, name).connect(receiver)
    yield calls
    for name, receiver in receivers.items():
        getattr(signals, name).disconnect(receiver)


# --- Event ids ----------------------------------------------------------------------------------


def test_a_uuid_is_stored_in_canonical_form() -> None:
    value = uuid.UUID("A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11")
    assert normalize_event_id(value) == "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"


def test_a_string_id_is_kept_as_given() -> None:
    assert normalize_event_id("Order-42/Confirmed") == "Order-42/Confirmed"
    assert normalize_event_id("x" * 255) == "x" * 255


@pytest.mark.parametrize("bad", ["", "   ", "x" * 256, "nul\x00byte"])
def test_an_empty_or_too_long_id_is_a_value_error(bad: str) -> None:
    with pytest.raises(ValueError):
        normalize_event_id(bad)


@pytest.mark.parametrize("bad", [4.2, None, b"bytes", True])
def test_an_id_of_another_type_is_a_type_error(bad: object) -> None:
    with pytest.raises(TypeError):
        normalize_event_id(bad)


@pytest.mark.parametrize(
    "bad",
    ["", "   ", "x" * 256, "nul\x00byte", "\ud800abc", "abc\udfff", 4.2, None, b"id", True],
)
def test_checked_event_id_refuses_an_id_that_cannot_be_stored(bad: object) -> None:
    """A lone surrogate reached the driver and raised UnicodeEncodeError before the delivery was
    counted; every unstorable id is now an InvalidEventId, handled as a missing one."""
    with pytest.raises(InvalidEventId) as caught:
        checked_event_id(bad)
    assert isinstance(caught.value, MissingEventId)
    # The message is storable, so a loop can keep it as the parked delivery's last_error.
    str(caught.value).encode("utf-8")
    assert "\x00" not in str(caught.value)


def test_checked_event_id_keeps_a_storable_id_byte_for_byte() -> None:
    for value in ("order-42 ", "Order-42", "e\u0301", "\u00e9", "\U0001f600", "x" * 255):
        assert checked_event_id(value) == value
    assert checked_event_id(7) == "7"


def test_an_integer_id_is_its_decimal_string() -> None:
    """An outbox primary key is an id: 42 and "42" are the same event."""
    assert normalize_event_id(42) == "42"
    assert normalize_event_id(10**30) == "1" + "0" * 30


@pytest.mark.django_db(transaction=True)
def test_an_integer_id_and_its_string_are_one_event() -> None:
    with transaction.atomic():
        assert try_reserve(42, "ledger") is True
        assert try_reserve("42", "ledger") is False


# --- try_reserve --------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_try_reserve_outside_atomic_raises() -> None:
    with pytest.raises(TransactionManagementError, match=r"inside transaction\.atomic"):
        try_reserve("evt-1", "consumer")
    assert not ProcessedEvent.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_try_reserve_true_once_then_false() -> None:
    event_id = uuid.uuid4()
    with transaction.atomic():
        assert try_reserve(event_id, "ledger", topic="orders") is True
        assert try_reserve(event_id, "ledger") is False
        assert try_reserve(str(event_id), "ledger") is False  # a UUID and its str are one id
        # A duplicate leaves the transaction usable.
        Effect.objects.create(name="after-duplicate")
    with transaction.atomic():
        assert try_reserve(event_id, "ledger") is False
    row = ProcessedEvent.objects.get()
    assert (row.consumer, row.event_id, row.topic) == ("ledger", str(event_id), "orders")
    assert Effect.objects.count() == 1


@pytest.mark.django_db
def test_each_consumer_reserves_an_event_once() -> None:
    with transaction.atomic():
        assert try_reserve("evt", "billing") is True
        assert try_reserve("evt", "shipping") is True
        assert try_reserve("evt", "billing") is False
        assert try_reserve("evt", "shipping") is False


@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_reservation_leaves_nothing() -> None:
    with pytest.raises(Boom), transaction.atomic():
        assert try_reserve("evt", "ledger") is True
        raise Boom
    assert not ProcessedEvent.objects.exists()
    with transaction.atomic():
        assert try_reserve("evt", "ledger") is True


@pytest.mark.django_db
def test_expiry_comes_from_ttl_or_the_setting() -> None:
    before = timezone.now()
    with transaction.atomic():
        try_reserve("default", "c")
        try_reserve("td", "c", ttl=timedelta(hours=2))
        try_reserve("seconds", "c", ttl=60)
        with override_settings(IDEMPOTENCY={"EVENT_TTL": timedelta(days=30)}):
            try_reserve("setting", "c")
    after = timezone.now()
    expected = {
        "default": timedelta(days=7),
        "td": timedelta(hours=2),
        "seconds": timedelta(seconds=60),
        "setting": timedelta(days=30),
    }
    for row in ProcessedEvent.objects.all():
        ttl = expected[row.event_id]
        assert before + ttl <= row.expires_at <= after + ttl
        assert before <= row.processed_at <= after


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"event_id": ""}, ValueError),
        ({"event_id": "x" * 256}, ValueError),
        ({"consumer": ""}, ValueError),
        ({"consumer": "c" * 256}, ValueError),
        ({"topic": "t" * 256}, ValueError),
        ({"ttl": 0}, ValueError),
        ({"ttl": timedelta(seconds=-1)}, ValueError),
        ({"ttl": "1 day"}, TypeError),
        ({"event_id": 1.5}, TypeError),
        ({"event_id": True}, TypeError),
    ],
)
def test_invalid_arguments(kwargs: dict[str, Any], error: type[Exception]) -> None:
    arguments: dict[str, Any] = {"event_id": "evt", "consumer": "c", **kwargs}
    with transaction.atomic(), pytest.raises(error):
        try_reserve(arguments.pop("event_id"), arguments.pop("consumer"), **arguments)
    assert not ProcessedEvent.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_not_null_violation_is_an_error_not_a_duplicate() -> None:
    """The trap of INSERT OR IGNORE / INSERT IGNORE: an error must never read as "0 rows"."""
    now = timezone.now()
    row = {
        "consumer": None,
        "event_id": "evt",
        "topic": "",
        "processed_at": now,
        "expires_at": now,
    }
    with pytest.raises(IntegrityError), transaction.atomic():
        insert_new(connection, ProcessedEvent, row, unique=("consumer", "event_id"))
    assert not ProcessedEvent.objects.exists()


def test_mysql_errno_reads_the_driver_code() -> None:
    assert mysql_errno(IntegrityError(1062, "Duplicate entry")) == 1062
    assert mysql_errno(IntegrityError(1048, "Column 'consumer' cannot be null")) == 1048
    assert mysql_errno(IntegrityError("no code")) is None
    assert mysql_errno(IntegrityError()) is None


# --- Races across threads (one connection each) ------------------------------------------------


@pytest.mark.slow
@pytest.mark.pooler
@pytest.mark.django_db(transaction=True)
def test_racing_threads_reserve_exactly_once(threads: Threads) -> None:
    event_id = str(new_event_id())
    count = 8
    barrier = threading.Barrier(count, timeout=JOIN_TIMEOUT)
    outcomes: list[bool] = []

    def race() -> None:
        barrier.wait()
        with transaction.atomic():
            reserved = try_reserve(event_id, "ledger")
            if reserved:
                Effect.objects.create(name="race", payload=event_id)
                time.sleep(0.1)  # hold the row while the others arrive
        outcomes.append(reserved)

    for _ in range(count):
        threads.start(race)
    threads.join()
    assert sorted(outcomes) == [False] * (count - 1) + [True]
    assert Effect.objects.filter(payload=event_id).count() == 1


@pytest.mark.slow
@pytest.mark.pooler
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("first_commits", [True, False], ids=["commit", "rollback"])
def test_second_reservation_waits_for_the_first_outcome(
    threads: Threads, first_commits: bool
) -> None:
    reserved, release, second_started = threading.Event(), threading.Event(), threading.Event()
    result: dict[str, Any] = {}

    def first() -> None:
        with transaction.atomic():
            result["first"] = try_reserve("evt", "ledger")
            reserved.set()
            release.wait(JOIN_TIMEOUT)
            if not first_commits:
                transaction.set_rollback(True)

    def second() -> None:
        reserved.wait(JOIN_TIMEOUT)
        with transaction.atomic():
            second_started.set()
            result["second"] = try_reserve("evt", "ledger")
            result["first_had_finished"] = release.is_set()

    threads.start(first)
    threads.start(second)
    assert second_started.wait(JOIN_TIMEOUT)
    time.sleep(0.5)  # room for the second call to return early, which would be the bug
    assert "second" not in result, "the second reservation did not wait for the first"
    release.set()
    threads.join()

    assert result["first"] is True
    assert result["first_had_finished"] is True
    assert result["second"] is (not first_commits)
    assert ProcessedEvent.objects.count() == 1


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_postgres_lock_timeout_propagates(threads: Threads) -> None:
    _lock_timeout_propagates(threads, "SET LOCAL lock_timeout = '200ms'")


@pytest.mark.slow
@pytest.mark.mysql
@pytest.mark.django_db(transaction=True)
def test_mariadb_lock_wait_timeout_propagates(threads: Threads) -> None:
    _lock_timeout_propagates(threads, "SET SESSION innodb_lock_wait_timeout = 1")


def _lock_timeout_propagates(threads: Threads, set_timeout: str) -> None:
    reserved, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def holder() -> None:
        with transaction.atomic():
            try_reserve("evt", "ledger")
            reserved.set()
            release.wait(JOIN_TIMEOUT)

    def waiter() -> None:
        reserved.wait(JOIN_TIMEOUT)
        try:
            with transaction.atomic():
                with connection.cursor() as cursor:
                    cursor.execute(set_timeout)
                try_reserve("evt", "ledger")
        except OperationalError as exc:
            errors.append(exc)
        finally:
            release.set()

    threads.start(holder)
    threads.start(waiter)
    threads.join()
    assert len(errors) == 1, "a lock timeout must raise, never read as a duplicate"
    if connection.vendor == "mysql":
        assert mysql_errno(errors[0]) == 1205


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_postgres_serialization_failure_propagates(threads: Threads) -> None:
    """Under REPEATABLE READ, a row committed after the snapshot is a serialization failure."""
    snapshot_taken, committed = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def other() -> None:
        snapshot_taken.wait(JOIN_TIMEOUT)
        with transaction.atomic():
            try_reserve("evt", "ledger")
        committed.set()

    def repeatable_read() -> None:
        try:
            with transaction.atomic():
                with connection.cursor() as cursor:
                    cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                    cursor.execute("SELECT 1")
                snapshot_taken.set()
                committed.wait(JOIN_TIMEOUT)
                try_reserve("evt", "ledger")
        except OperationalError as exc:
            errors.append(exc)

    threads.start(other)
    threads.start(repeatable_read)
    threads.join()
    assert len(errors) == 1
    assert "could not serialize" in str(errors[0])


# --- Counting deliveries ------------------------------------------------------------------------


@pytest.mark.django_db
def test_count_delivery_counts_per_consumer() -> None:
    first = count_delivery("evt", "ledger", topic="orders")
    second = count_delivery("evt", "ledger", topic="orders")
    other = count_delivery("evt", "shipping")
    assert (first.count, first.parked) == (1, False)
    assert (second.count, second.parked) == (2, False)
    assert (other.count, other.parked) == (1, False)
    row = EventDelivery.objects.get(consumer="ledger")
    assert (row.deliveries, row.topic, row.parked_at) == (2, "orders", None)
    assert row.first_delivered_at <= row.last_delivered_at


@pytest.mark.django_db
def test_count_delivery_reports_a_parked_event() -> None:
    count_delivery("evt", "ledger")
    EventDelivery.objects.update(parked_at=timezone.now())
    assert count_delivery("evt", "ledger").parked is True


@pytest.mark.django_db(transaction=True)
def test_the_count_commits_apart_from_the_business_transaction() -> None:
    def body() -> None:
        Effect.objects.create(name="rolled back")
        raise Boom("the body failed")

    with pytest.raises(Boom):
        process_event("ledger", "evt", body)

    assert not Effect.objects.exists()
    assert not ProcessedEvent.objects.exists()
    delivery = EventDelivery.objects.get()
    assert delivery.deliveries == 1
    assert delivery.last_error == "Boom: the body failed"


class Unstorable(Exception):
    """An error whose text holds a NUL and a lone surrogate (an undecodable file name)."""

    def __str__(self) -> str:
        return "in caf\udce9 \x00 here"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("redelivered", [None, False], ids=["counted", "vouched"])
def test_an_error_text_no_database_stores_is_kept_escaped(redelivered: bool | None) -> None:
    """A NUL (refused by PostgreSQL) or a lone surrogate (not UTF-8) in the body's error made
    the write that keeps it fail: a lone surrogate replaced the body's own error with a
    ``UnicodeEncodeError``, and a NUL lost the error on PostgreSQL."""

    def body() -> None:
        raise Unstorable()

    with pytest.raises(Unstorable):
        process_event("ledger", "evt-unstorable", body, redelivered=redelivered)
    delivery = EventDelivery.objects.get(event_id="evt-unstorable")
    assert delivery.last_error == "Unstorable: in caf\\udce9 \\x00 here"
    assert delivery.deliveries == 1
    assert not ProcessedEvent.objects.exists()


# --- process_event ------------------------------------------------------------------------------


DOOMS = ["set_rollback", "an error caught without a savepoint"]


def doom_transaction(how: str) -> None:
    """Leave the open transaction unable to commit without raising, as a buggy body does:
    ``set_rollback(True)``, or (PostgreSQL) a failed statement's error caught without a
    savepoint."""
    if how == "set_rollback":
        transaction.set_rollback(True)
        return
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1 / 0")
    except DatabaseError:
        pass  # the transaction stays aborted


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "redelivered", [False, True, None], ids=["first", "redelivered", "unknown"]
)
@pytest.mark.parametrize("how", DOOMS)
def test_a_body_that_leaves_the_transaction_unable_to_commit_is_a_failed_delivery(
    how: str, redelivered: bool | None
) -> None:
    """Regression: a body that marked the transaction for rollback without raising (or, on
    PostgreSQL, caught a failed statement's error without a savepoint) returned as applied,
    while its COMMIT rolled the effect and the reservation back without an error: the caller
    acked a message that took no effect. It is a failed delivery now: raised and counted."""
    if how != "set_rollback" and connection.vendor != "postgresql":
        pytest.skip("only PostgreSQL aborts a transaction on a failed statement")

    def body() -> None:
        Effect.objects.create(name="doomed", payload={})
        doom_transaction(how)

    with pytest.raises(TransactionManagementError, match="unable to commit"):
        process_event("ledger", "evt-doomed", body, redelivered=redelivered)
    assert not Effect.objects.exists()
    assert not ProcessedEvent.objects.exists()
    [delivery] = EventDelivery.objects.all()
    # Counted as a body that raises is: a redelivery counts the delivery before it too.
    assert delivery.deliveries == (2 if redelivered else 1)
    assert "unable to commit" in delivery.last_error


@pytest.mark.django_db
def test_process_event_runs_the_body_once(
    caplog: pytest.LogCaptureFixture, received: list[tuple[str, dict[str, Any]]]
) -> None:
    calls: list[int] = []

    def body() -> str:
        calls.append(1)
        return "done"

    with caplog.at_level(logging.INFO, logger="django_idempotency"):
        first = process_event("ledger", "evt-7", body, topic="orders")
        again = process_event("ledger", "evt-7", body, topic="orders")

    assert (first.applied, first.result) == (True, "done")
    assert (again.applied, again.result) == (False, None)
    assert calls == [1]
    assert "duplicate ignored: event evt-7, consumer ledger" in caplog.text
    assert received == [
        ("event_duplicate", {"sender": "ledger", "event_id": "evt-7", "topic": "orders"})
    ]


@pytest.mark.django_db(transaction=True)
def test_an_event_delivered_too_often_is_parked(
    caplog: pytest.LogCaptureFixture, received: list[tuple[str, dict[str, Any]]]
) -> None:
    def body() -> None:
        raise Boom

    for _ in range(2):
        with pytest.raises(Boom):
            process_event("ledger", "poison", body, max_deliveries=2)
    with caplog.at_level(logging.ERROR, logger="django_idempotency"):
        with pytest.raises(EventParked, match="delivered 3 times"):
            process_event("ledger", "poison", body, max_deliveries=2)
        with pytest.raises(EventParked, match="is parked"):
            process_event("ledger", "poison", body, max_deliveries=2)

    delivery = EventDelivery.objects.get()
    assert delivery.parked_at is not None
    assert delivery.deliveries == 4
    assert not ProcessedEvent.objects.exists()  # the parking delivery's reservation rolled back
    assert "EVENT PARKED: event poison, consumer ledger" in caplog.text
    assert [r.levelno for r in caplog.records] == [logging.ERROR, logging.ERROR]
    assert received == [
        ("event_parked", {"sender": "ledger", "event_id": "poison", "topic": "", "deliveries": 3})
    ]


@pytest.mark.django_db
def test_max_deliveries_defaults_to_the_setting() -> None:
    def body() -> None:
        raise Boom

    with override_settings(IDEMPOTENCY={"MAX_DELIVERIES": 1}):
        with pytest.raises(Boom):
            process_event("ledger", "evt", body)
        with pytest.raises(EventParked):
            process_event("ledger", "evt", body)


@pytest.mark.django_db
def test_a_processed_event_is_never_parked() -> None:
    process_event("ledger", "evt", lambda: None, max_deliveries=1)
    for _ in range(3):
        assert process_event("ledger", "evt", lambda: None, max_deliveries=1).applied is False
    delivery = EventDelivery.objects.get()
    assert (delivery.deliveries, delivery.parked_at) == (1, None)  # duplicates are not counted


@pytest.mark.django_db
def test_counting_can_be_turned_off() -> None:
    assert process_event("ledger", "evt", lambda: 1, count_deliveries=False).applied
    assert not process_event("ledger", "evt", lambda: 1, count_deliveries=False).applied
    assert not EventDelivery.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("limit", [0, -1, True])
def test_max_deliveries_must_be_positive(limit: int) -> None:
    with pytest.raises(ValueError, match="max_deliveries"):
        process_event("ledger", "evt", lambda: None, max_deliveries=limit)


@pytest.mark.slow
@pytest.mark.pooler
@pytest.mark.postgres
@pytest.mark.mysql
@pytest.mark.django_db(transaction=True)
def test_a_delivery_concurrent_with_a_successful_one_is_not_parked(threads: Threads) -> None:
    """Over the limit, the parking decision waits on the reservation of the delivery in flight.

    (Not on SQLite: there the second delivery's count waits for the first's whole transaction,
    since SQLite lets one writer at a time, so the two can never overlap.)
    """
    in_body, release = threading.Event(), threading.Event()
    outcomes: dict[str, Any] = {}

    def slow_body() -> str:
        Effect.objects.create(name="applied")
        in_body.set()
        release.wait(JOIN_TIMEOUT)
        return "applied"

    def first() -> None:
        outcomes["first"] = process_event("ledger", "evt", slow_body, max_deliveries=1)

    def second() -> None:
        in_body.wait(JOIN_TIMEOUT)
        outcomes["second"] = process_event("ledger", "evt", slow_body, max_deliveries=1)

    threads.start(first)
    threads.start(second)
    assert in_body.wait(JOIN_TIMEOUT)
    deadline = time.monotonic() + JOIN_TIMEOUT
    while EventDelivery.objects.filter(deliveries=2).count() == 0:  # the second was counted
        assert time.monotonic() < deadline
        time.sleep(0.02)
    release.set()
    threads.join()

    assert outcomes["first"].applied is True
    assert outcomes["second"].applied is False
    assert EventDelivery.objects.get().parked_at is None
    assert Effect.objects.count() == 1


# --- new_event_id -------------------------------------------------------------------------------


def test_new_event_id_is_a_uuid7_with_the_current_time() -> None:
    before = time.time_ns() // 1_000_000
    value = new_event_id()
    after = time.time_ns() // 1_000_000
    assert value.version == 7
    assert value.variant == uuid.RFC_4122
    assert before <= value.int >> 80 <= after


def test_new_event_ids_are_strictly_increasing() -> None:
    values = [new_event_id() for _ in range(20_000)]
    assert values == sorted(values)
    assert len(set(values)) == len(values)
    assert all(str(v) < str(w) for v, w in itertools.pairwise(values))


def test_new_event_ids_from_threads_are_unique() -> None:
    results: list[list[uuid.UUID]] = []

    def make() -> None:
        results.append([new_event_id() for _ in range(5_000)])

    workers = [threading.Thread(target=make) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(JOIN_TIMEOUT)
    values = [value for chunk in results for value in chunk]
    assert len(values) == 20_000
    assert len(set(values)) == 20_000


@pytest.mark.postgres
@pytest.mark.django_db
def test_try_reserve_on_the_partitioned_layout() -> None:
    """With EVENT_PARTITIONS, the partition key joins the insert and the conflict target."""
    from django_idempotency.retention import partitioning

    with override_settings(IDEMPOTENCY={"EVENT_PARTITIONS": "day"}):
        partitioning.convert("default")  # inside the test's transaction: rolled back after
        event_id = new_event_id()
        occurred = timezone.now() - timedelta(hours=1)
        with transaction.atomic():
            assert try_reserve(event_id, "ledger") is True
            assert try_reserve(event_id, "ledger") is False
            assert try_reserve("order-42", "ledger", occurred_at=occurred) is True
            assert try_reserve("order-42", "ledger", occurred_at=occurred) is False
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT event_id, occurred_at FROM {ProcessedEvent._meta.db_table} "
                "ORDER BY event_id"
            )
            rows = dict(cursor.fetchall())
    assert rows[str(event_id)] == partitioning.event_time(event_id)
    assert rows["order-42"] == occurred


def test_new_event_ids_stay_ordered_when_the_clock_steps_back_or_the_counter_overflows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from django_idempotency.events import ids as events

    ahead = time.time_ns() // 1_000_000 + 60_000  # the last id came from a clock a minute ahead
    monkeypatch.setattr(events, "_uuid7_last_ms", ahead)
    monkeypatch.setattr(events, "_uuid7_counter", 5)
    first = new_event_id()
    assert first.int >> 80 == ahead  # the same millisecond, counting on
    monkeypatch.setattr(events, "_uuid7_counter", (1 << 42) - 1)  # the counter is exhausted
    second = new_event_id()
    assert second.int >> 80 == ahead + 1  # borrows the next millisecond
    assert first < second < new_event_id()


def test_a_forked_child_starts_a_fresh_uuid7_sequence() -> None:
    from django_idempotency.events import ids as events

    new_event_id()
    events._reset_uuid7_state()  # what os.register_at_fork runs in the child
    assert (events._uuid7_last_ms, events._uuid7_counter) == (0, 0)
    assert new_event_id().int >> 80 >= time.time_ns() // 1_000_000 - 1000


# --- A lock timeout is an error, not "already processed" (quick, on PostgreSQL and MariaDB) -----


@pytest.mark.postgres
@pytest.mark.mysql
@pytest.mark.django_db(transaction=True)
def test_a_lock_timeout_inside_try_reserve_propagates() -> None:
    """A second connection holds the row; the wait times out, and that must raise."""
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with transaction.atomic():
            assert try_reserve("evt-locked", "billing")
            holding.set()
            release.wait(JOIN_TIMEOUT)
            transaction.set_rollback(True)  # the event was never processed

    threads = Threads()
    threads.start(hold)
    try:
        assert holding.wait(JOIN_TIMEOUT)
        with pytest.raises(OperationalError), transaction.atomic():
            with connection.cursor() as cursor:
                if connection.vendor == "postgresql":
                    cursor.execute("SET LOCAL lock_timeout = '50ms'")
                else:
                    cursor.execute("SET SESSION innodb_lock_wait_timeout = 1")
            try_reserve("evt-locked", "billing")
    finally:
        release.set()
        if connection.vendor == "mysql":
            with connection.cursor() as cursor:
                cursor.execute("SET SESSION innodb_lock_wait_timeout = DEFAULT")
        threads.join()
    assert not ProcessedEvent.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_failed_delivery_leaves_no_error_on_an_event_processed_meanwhile() -> None:
    """Celery's autoretry publishes the retry before the failed delivery ends; the retry may
    apply the event (clearing the error) before the failed one records its error."""
    from django_idempotency.events import store as event_store

    count_delivery("evt-late-error", "billing")
    delivery = event_store.Delivery("billing", "evt-late-error", "", 1, False)
    with transaction.atomic():
        assert try_reserve("evt-late-error", "billing")  # the retry applied the event
    event_store.record_error(delivery, RuntimeError("stale"), "default", unless_processed=True)
    assert EventDelivery.objects.get(event_id="evt-late-error").last_error == ""
    event_store.record_error(delivery, RuntimeError("kept"), "default")
    assert EventDelivery.objects.get(event_id="evt-late-error").last_error == "RuntimeError: kept"


@pytest.mark.django_db(transaction=True)
def test_a_failed_delivery_leaves_no_error_once_a_later_delivery_counted_itself() -> None:
    """The later delivery clears the error only if it was there first; after it, none lands."""
    from django_idempotency.events import store as event_store

    first = count_delivery("evt-later", "billing")
    count_delivery("evt-later", "billing")  # the retry, counted before the first one ends
    event_store.record_error(first, RuntimeError("stale"), "default", unless_processed=True)
    assert EventDelivery.objects.get(event_id="evt-later").last_error == ""
