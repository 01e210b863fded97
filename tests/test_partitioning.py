"""The partitioned ProcessedEvent layout (PostgreSQL): the partition key comes from the event.

The heart of it is :func:`test_late_duplicate_after_the_partition_boundary_is_caught`: a
duplicate that arrives after the partition boundary has passed lands in the same partition as
the first delivery and is refused, while a table keyed on processing time (the control) lets it
through.

Reservations go through the real ``try_reserve``; :func:`reserve` only sets the processing
time (the application clock) so a test can stand on either side of a partition boundary.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from io import StringIO
from typing import Any
from unittest import mock

import pytest
from django.core.checks import CheckMessage
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.db import NotSupportedError, connection, transaction
from django.test import override_settings
from django.utils import timezone

from django_idempotency.checks import check_settings
from django_idempotency.events.core import process_first_deliveries, try_reserve
from django_idempotency.models import ProcessedEvent
from django_idempotency.retention import partitioning

TABLE = ProcessedEvent._meta.db_table
DAY = timedelta(days=1)


def uuid7_at(moment: datetime) -> str:
    """A canonical UUIDv7 string whose timestamp is ``moment`` (to the millisecond)."""
    milliseconds = int(moment.timestamp() * 1000)
    rand = uuid.uuid4().int
    value = (
        milliseconds << 80
        | 0x7 << 76
        | ((rand >> 64) & 0xFFF) << 64
        | 0b10 << 62
        | rand & ((1 << 62) - 1)
    )
    return str(uuid.UUID(int=value))


def reserve(
    consumer: str,
    event_id: str,
    processed_at: datetime,
    occurred_at: datetime | None = None,
    ttl: timedelta = timedelta(days=7),
) -> bool:
    """``try_reserve`` in its own transaction, processed at ``processed_at`` (the app clock)."""
    with mock.patch("django.utils.timezone.now", return_value=processed_at), transaction.atomic():
        return try_reserve(event_id, consumer, ttl=ttl, occurred_at=occurred_at)


def partition_of(consumer: str, event_id: str) -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT tableoid::regclass::text FROM {TABLE} WHERE consumer = %s AND event_id = %s",
            [consumer, event_id],
        )
        return [row[0] for row in cursor.fetchall()]


def partition_names() -> set[str]:
    return {p.name for p in partitioning.partitions("default")}


# --- the partition key (no database) -----------------------------------------------------------


def test_event_time_reads_the_uuid7_timestamp() -> None:
    moment = datetime(2026, 6, 30, 23, 59, 59, 999000, tzinfo=UTC)
    event_id = uuid7_at(moment)

    assert partitioning.event_time(event_id) == moment
    assert partitioning.event_time(uuid.UUID(event_id)) == moment
    assert partitioning.event_time(event_id.upper()) == moment
    assert partitioning.event_time(str(uuid.uuid4())) is None
    assert partitioning.event_time(event_id.replace("-", "")) is None  # canonical form only
    assert partitioning.event_time("order-42:confirmed") is None


def test_partition_time_prefers_the_id_then_the_supplied_time_then_the_fallback() -> None:
    moment = datetime(2026, 6, 1, 12, tzinfo=UTC)
    supplied = datetime(2026, 6, 1, 14, 30, tzinfo=timezone.get_fixed_timezone(120))
    event_id = uuid7_at(moment)

    assert partitioning.partition_time(event_id, supplied) == moment
    assert partitioning.partition_time("order-42", supplied) == datetime(
        2026, 6, 1, 12, 30, tzinfo=UTC
    )
    assert partitioning.partition_time("order-42") == partitioning.FALLBACK_TIME
    with pytest.raises(ValueError, match="timezone-aware"):
        partitioning.partition_time("order-42", datetime(2026, 6, 1))


def test_event_insert_follows_the_setting() -> None:
    plain = partitioning.event_insert("order-42")
    assert (plain.columns, plain.values, plain.conflict_target) == (
        (),
        (),
        ("consumer", "event_id"),
    )


def test_interval_arithmetic() -> None:
    moment = datetime(2026, 12, 31, 23, 59, tzinfo=UTC)
    assert partitioning.floor(moment, "day") == datetime(2026, 12, 31, tzinfo=UTC)
    assert partitioning.next_bound(moment, "day") == datetime(2027, 1, 1, tzinfo=UTC)
    assert partitioning.floor(moment, "month") == datetime(2026, 12, 1, tzinfo=UTC)
    assert partitioning.next_bound(moment, "month") == datetime(2027, 1, 1, tzinfo=UTC)
    assert partitioning.next_bound(datetime(2026, 1, 31, tzinfo=UTC), "month") == datetime(
        2026, 2, 1, tzinfo=UTC
    )


# --- other databases ---------------------------------------------------------------------------


@pytest.mark.sqlite
@pytest.mark.mysql
@pytest.mark.django_db
def test_layout_reports_it_is_not_available_off_postgresql() -> None:
    with pytest.raises(CommandError, match="needs PostgreSQL"):
        call_command("idempotency_partitions", "convert", "--interval", "day")
    with pytest.raises(ImproperlyConfigured, match="needs PostgreSQL"):
        partitioning.convert("default", "day")
    assert partitioning.is_partitioned("default") is False

    with override_settings(IDEMPOTENCY={"EVENT_PARTITIONS": "month"}):
        messages: list[CheckMessage] = check_settings()
        with pytest.raises(ImproperlyConfigured, match="need PostgreSQL"):
            partitioning.event_insert("order-42")
    assert [m.id for m in messages] == ["django_idempotency.E002"]
    assert "need PostgreSQL" in messages[0].msg


@pytest.mark.parametrize("action", ["status", "convert", "maintain", "revert"])
def test_command_refuses_an_unknown_database_alias(action: str) -> None:
    """Once a traceback (ConnectionDoesNotExist), on every backend."""
    with pytest.raises(CommandError, match="Unknown database alias 'nowhere'; DATABASES has"):
        call_command("idempotency_partitions", action, "--database", "nowhere")


def test_bad_interval_is_an_invalid_setting() -> None:
    with override_settings(IDEMPOTENCY={"EVENT_PARTITIONS": "week"}):
        messages = check_settings()
    assert [m.id for m in messages] == ["django_idempotency.E002"]
    assert "'day' or 'month'" in messages[0].msg


# --- PostgreSQL --------------------------------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.django_db
def test_python_and_sql_agree_on_the_partition_key() -> None:
    ids = [
        uuid7_at(datetime(2026, 6, 30, 23, 59, 59, 999000, tzinfo=UTC)),
        uuid7_at(datetime(1999, 1, 1, tzinfo=UTC)),
        uuid7_at(datetime(2100, 2, 28, 1, 2, 3, 4000, tzinfo=UTC)).upper(),
        str(uuid.uuid4()),
        str(uuid.uuid1()),
        uuid7_at(datetime(2026, 1, 1, tzinfo=UTC)).replace("-", ""),
        "order-42:confirmed",
        "0190163d-8694-739b-aea5-966c26f8ad91\n",
    ]
    with connection.cursor() as cursor:
        cursor.execute(partitioning._FUNCTION_SQL)
        for event_id in ids:
            cursor.execute(
                f"SELECT {partitioning.SQL_FUNCTION}(%s, %s)",
                [event_id, partitioning.FALLBACK_TIME],
            )
            assert cursor.fetchone()[0] == partitioning.partition_time(event_id), event_id


@pytest.fixture
def partitioned(db: None) -> Iterator[None]:
    """ProcessedEvent converted to daily partitions inside the test's transaction: the rollback
    at the end brings the plain table back, whatever the test did."""
    with override_settings(IDEMPOTENCY={"EVENT_PARTITIONS": "day"}):
        partitioning.convert("default")
        yield


@pytest.mark.postgres
def test_a_filtered_purge_is_refused_on_the_partitioned_layout(partitioned: None) -> None:
    """The filter was ignored: a purge narrowed to one consumer deleted every consumer's expired
    rows in the timeless and default partitions."""
    past = timezone.now() - timedelta(days=30)
    for consumer in ("billing", "shipping"):
        with transaction.atomic():
            try_reserve("plain-id", consumer)
    ProcessedEvent.objects.update(expires_at=past)
    with pytest.raises(NotSupportedError, match="cannot be narrowed by a filter"):
        ProcessedEvent.objects.filter(consumer="billing").delete_expired()
    assert ProcessedEvent.objects.count() == 2
    assert ProcessedEvent.objects.delete_expired().deleted == 2


@pytest.mark.postgres
def test_late_duplicate_after_the_partition_boundary_is_caught(partitioned: None) -> None:
    boundary = partitioning.next_bound(partitioning.database_now("default"), "day")
    before, after = boundary - timedelta(seconds=1), boundary + timedelta(seconds=1)
    event_id = uuid7_at(boundary - timedelta(seconds=2))

    # The first delivery is processed just before midnight, in the partition of its day.
    assert reserve("billing", event_id, processed_at=before) is True
    # Midnight passes; maintenance runs as it would then; the duplicate arrives after it.
    partitioning.maintain("default", now=after)
    assert reserve("billing", event_id, processed_at=after) is False

    assert partition_of("billing", event_id) == [partitioning.partition_name(boundary - DAY)]
    # Another consumer still gets the event once.
    assert reserve("ledger", event_id, processed_at=after) is True
    assert reserve("ledger", event_id, processed_at=after + DAY) is False

    # Ids without time: the consumer supplies the event's time, read from the message.
    occurred = boundary - timedelta(minutes=5)
    assert reserve("billing", "order-42", processed_at=before, occurred_at=occurred) is True
    assert reserve("billing", "order-42", processed_at=after, occurred_at=occurred) is False
    # ... or supplies none: the fallback key sends every delivery to the timeless partition.
    assert reserve("billing", "order-43", processed_at=before) is True
    assert reserve("billing", "order-43", processed_at=after) is False
    assert partition_of("billing", "order-43") == [f"{TABLE}_timeless"]
    assert ProcessedEvent.objects.filter(consumer="billing").count() == 3


@pytest.mark.postgres
@pytest.mark.django_db
def test_control_a_processing_time_key_lets_the_late_duplicate_through() -> None:
    """What the layout avoids (and proof that the test above can fail): the seed article's
    table keyed on processed_at applies a duplicate that arrives after the boundary."""
    boundary = datetime(2026, 7, 1, tzinfo=UTC)
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE TABLE naive_processed_event (consumer text, event_id text, "
            "processed_at timestamptz, UNIQUE (consumer, event_id, processed_at)) "
            "PARTITION BY RANGE (processed_at)"
        )
        for name, low, high in [
            ("june", "2026-06-01", "2026-07-01"),
            ("july", "2026-07-01", "2026-08-01"),
        ]:
            cursor.execute(
                f"CREATE TABLE naive_{name} PARTITION OF naive_processed_event "
                f"FOR VALUES FROM ('{low}') TO ('{high}')"
            )
        inserted = 0
        for processed_at in (boundary - timedelta(seconds=1), boundary + timedelta(seconds=1)):
            cursor.execute(
                "INSERT INTO naive_processed_event VALUES ('billing', 'evt-1', %s) "
                "ON CONFLICT (consumer, event_id, processed_at) DO NOTHING",
                [processed_at],
            )
            inserted += cursor.rowcount
    assert inserted == 2  # applied twice (the test's rollback drops the table)


@pytest.mark.postgres
def test_convert_keeps_every_row_under_its_event_time(partitioned: None) -> None:
    partitioning.revert("default")
    now = timezone.now()
    recent = uuid7_at(now - timedelta(hours=3))
    old = uuid7_at(now - timedelta(days=400))
    for event_id in (recent, old, "plain-id"):
        ProcessedEvent.objects.create(consumer="c", event_id=event_id, expires_at=now + DAY)
    last_id = ProcessedEvent.objects.order_by("-pk").values_list("pk", flat=True)[0]

    created = partitioning.convert("default", "day", ahead=2)

    assert partitioning.is_partitioned("default")
    # From EVENT_TTL (7 days) ago to 2 days past today, plus the default partition.
    assert len(created) == 7 + 1 + 2
    assert partition_names() == {*created, f"{TABLE}_default", f"{TABLE}_timeless"}
    assert partition_of("c", recent) == [partitioning.partition_name(now - timedelta(hours=3))]
    assert partition_of("c", old) == [f"{TABLE}_default"]  # older than any partition
    assert partition_of("c", "plain-id") == [f"{TABLE}_timeless"]
    assert ProcessedEvent.objects.count() == 3  # the ORM still reads the table
    # Duplicates of converted rows are still caught, and ids go on from the old sequence.
    assert reserve("c", recent, processed_at=now) is False
    assert reserve("c", "plain-id", processed_at=now) is False
    assert reserve("c", "new-id", processed_at=now) is True
    assert ProcessedEvent.objects.get(event_id="new-id").pk > last_id
    with pytest.raises(ImproperlyConfigured, match="partitioned already"):
        partitioning.convert("default", "day")


@pytest.mark.postgres
def test_revert_restores_the_table_the_migrations_describe(partitioned: None) -> None:
    now = timezone.now()
    assert reserve("c", uuid7_at(now), processed_at=now) is True
    before = list(ProcessedEvent.objects.values_list("pk", "event_id"))

    assert partitioning.revert("default") == 1

    assert not partitioning.is_partitioned("default")
    with connection.cursor() as cursor:
        constraints = connection.introspection.get_constraints(cursor, TABLE)
        columns = [c.name for c in connection.introspection.get_table_description(cursor, TABLE)]
    assert constraints["idempotency_event_consumer_uniq"]["columns"] == ["event_id", "consumer"]
    assert constraints[f"{TABLE}_pkey"]["columns"] == ["id"]
    assert {"idem_event_expires_idx", "idem_event_processed_idx"} <= set(constraints)
    assert partitioning.PARTITION_COLUMN not in columns
    assert list(ProcessedEvent.objects.values_list("pk", "event_id")) == before
    created = ProcessedEvent.objects.create(consumer="c", event_id="x", expires_at=now)
    assert created.pk > before[0][0]
    with pytest.raises(ImproperlyConfigured, match="not partitioned"):
        partitioning.revert("default")


@pytest.mark.postgres
def test_expired_partitions_are_dropped_and_live_ones_kept(partitioned: None) -> None:
    now = partitioning.database_now("default")
    today = partitioning.floor(now, "day")
    five_days_ago, six_days_ago = today - 5 * DAY, today - 6 * DAY
    # Events of 6 days ago: one processed then, one processed late (today), still live.
    assert reserve("c", uuid7_at(six_days_ago + timedelta(hours=1)), processed_at=six_days_ago)
    assert reserve("c", uuid7_at(five_days_ago + timedelta(hours=1)), processed_at=five_days_ago)
    late = uuid7_at(five_days_ago + timedelta(hours=2))
    assert reserve("c", late, processed_at=now, ttl=timedelta(days=20))
    # Expired already, but in a range partition: it leaves with its partition, not before.
    short = uuid7_at(today + DAY + timedelta(hours=1))  # tomorrow's partition is not dropped
    assert reserve("c", short, processed_at=now - 2 * DAY, ttl=DAY)
    # Without time, in the timeless partition: one expired, one live.
    assert reserve("c", "plain-old", processed_at=now - 30 * DAY)
    assert reserve("c", "plain-new", processed_at=now)
    later = now + 8 * DAY  # six_days_ago's range ended EVENT_TTL (7 days) before this

    dry = partitioning.drop_expired_partitions("default", now=later, dry_run=True)
    result = partitioning.drop_expired_partitions("default", now=later)

    six, five = (
        partitioning.partition_name(six_days_ago),
        partitioning.partition_name(five_days_ago),
    )
    assert dry.dropped == result.dropped
    assert six in result.dropped
    assert five not in result.dropped
    assert any(name == five and "live rows until" in reason for name, reason in result.kept)
    names = partition_names()
    assert six not in names and five in names
    assert {f"{TABLE}_default", f"{TABLE}_timeless"} <= names  # never dropped
    ranges = [p for p in partitioning.partitions("default") if p.is_range]
    assert all(p.end is not None and p.end > six_days_ago for p in ranges)
    # The purge deletes rows one by one only in the timeless and default partitions; range
    # partitions leave whole.
    purge = ProcessedEvent.objects.delete_expired()
    assert (purge.deleted, purge.finished) == (1, True)
    assert set(ProcessedEvent.objects.values_list("event_id", flat=True)) >= {
        late,
        short,
        "plain-new",
    }
    assert not ProcessedEvent.objects.filter(event_id="plain-old").exists()


@pytest.mark.postgres
def test_new_partition_takes_its_rows_from_the_default_partition(partitioned: None) -> None:
    now = partitioning.database_now("default")
    far = partitioning.floor(now, "day") + 30 * DAY + timedelta(hours=5)
    event_id = uuid7_at(far)  # a producer clock far ahead: no partition yet
    assert reserve("c", event_id, processed_at=now)
    assert partition_of("c", event_id) == [f"{TABLE}_default"]

    created = partitioning.ensure_partitions("default", now=far, ahead=0)

    assert partitioning.partition_name(far) in created
    assert partition_of("c", event_id) == [partitioning.partition_name(far)]
    assert reserve("c", event_id, processed_at=now + DAY) is False
    assert partitioning.ensure_partitions("default", now=far, ahead=0) == []


@pytest.mark.postgres
def test_purge_runs_partition_maintenance(partitioned: None) -> None:
    from django_idempotency.retention.purge import purge_all

    results = {r.label: r for r in purge_all(dry_run=True)}

    maintenance = results[ProcessedEvent._meta.label].partitions
    assert maintenance is not None and maintenance.dry_run
    assert results["django_idempotency.IdempotencyRecord"].partitions is None


@pytest.mark.postgres
@pytest.mark.django_db(databases=["default", "other"])
def test_the_purge_maintains_the_partitions_of_each_database_it_is_given() -> None:
    from django_idempotency.retention.purge import purge_all

    with override_settings(IDEMPOTENCY={"EVENT_PARTITIONS": "day"}):
        partitioning.convert("other")  # rolled back with the test's transaction on "other"
        events = {
            r.database: r
            for r in purge_all(dry_run=True, databases=["default", "other"])
            if r.label == ProcessedEvent._meta.label
        }
    assert events["default"].partitions is None  # "default" keeps the plain table
    assert events["other"].partitions is not None and events["other"].partitions.dry_run


@pytest.mark.postgres
@pytest.mark.parametrize("ahead", ["-1", "367", "3651", "10000000"])
def test_command_refuses_partitions_too_far_ahead(transactional_db: Any, ahead: str) -> None:
    """``--ahead 3651`` (days) ran out of the server's lock table ("out of shared memory"), and
    ``--ahead 10000000`` past the year 9999: tracebacks, both."""
    with pytest.raises(CommandError, match=f"ahead must be from 0 to 366 .* not {ahead}"):
        call_command("idempotency_partitions", "convert", "--interval", "day", "--ahead", ahead)
    assert not partitioning.is_partitioned("default")  # the conversion rolled back


@pytest.mark.postgres
def test_command_converts_maintains_and_reverts(transactional_db: Any) -> None:
    def run(*args: str) -> str:
        out = StringIO()
        call_command("idempotency_partitions", *args, stdout=out)
        return out.getvalue()

    assert "plain table" in run()
    try:
        output = run("convert", "--interval", "month", "--ahead", "1")
        assert "Converted ProcessedEvent to monthly partitions" in output
        assert "set IDEMPOTENCY[\"EVENT_PARTITIONS\"] = 'month'" in output
        status = run("status")
        assert "DEFAULT" in status and "_p" in status
        with override_settings(IDEMPOTENCY={"EVENT_PARTITIONS": "month"}):
            assert "0 partitions would be created" in run("maintain", "--dry-run", "--ahead", "1")
            assert "1 partitions created" in run("maintain", "--ahead", "2")
            purge = StringIO()
            call_command("idempotency_purge", stdout=purge)
            assert "partitions: created 0, dropped 0" in purge.getvalue()
        assert "plain table again (0 rows copied)" in run("revert")
    finally:
        if partitioning.is_partitioned("default"):
            partitioning.revert("default")
    with pytest.raises(CommandError, match="not partitioned"):
        run("revert")


@pytest.fixture
def committed_partitions(transactional_db: None) -> Iterator[None]:
    """Daily partitions committed for real (other connections see them); reverted after."""
    with override_settings(IDEMPOTENCY={"EVENT_PARTITIONS": "day"}):
        partitioning.convert("default")
        try:
            yield
        finally:
            if partitioning.is_partitioned("default"):
                partitioning.revert("default")


@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_drop_waits_at_most_lock_timeout_behind_a_long_transaction(
    committed_partitions: None,
) -> None:
    import psycopg

    now = partitioning.database_now("default")
    old_day = partitioning.floor(now, "day") - 6 * DAY
    assert reserve("c", uuid7_at(old_day + timedelta(hours=1)), processed_at=old_day, ttl=DAY)
    later = now + 2 * DAY
    settings = connection.settings_dict
    other = psycopg.connect(
        dbname=settings["NAME"],
        user=settings["USER"],
        host=settings["HOST"] or "127.0.0.1",
        port=settings["PORT"] or 5432,
        password=settings["PASSWORD"] or None,
    )
    try:
        # A consumer's transaction that read the table and is still open.
        other.execute(f"SELECT count(*) FROM {TABLE}")
        started = time.monotonic()
        busy = partitioning.drop_expired_partitions("default", now=later, lock_timeout="300ms")
        waited = time.monotonic() - started
    finally:
        other.rollback()
        other.close()
    name = partitioning.partition_name(old_day)
    assert name not in busy.dropped
    assert (name, "busy: no lock within 300ms, next run") in busy.kept
    assert waited < 10  # one lock_timeout per partition, never an unbounded wait
    # The next run, with nobody in the way, drops it.
    assert name in partitioning.drop_expired_partitions("default", now=later).dropped
    assert name not in partition_names()


@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_two_maintenance_runs_at_once_do_not_collide(committed_partitions: None) -> None:
    far = partitioning.database_now("default") + 20 * DAY
    results: list[list[str]] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(partitioning.ensure_partitions("default", now=far, ahead=1))
        except BaseException as exc:  # noqa: BLE001  (asserted empty below)
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)

    assert not errors, errors
    created = [name for names in results for name in names]
    assert len(created) == len(set(created))  # each partition made once
    assert partitioning.partition_name(far) in partition_names()
    assert partitioning.ensure_partitions("default", now=far, ahead=1) == []


@pytest.mark.postgres
def test_a_kafka_batch_reserves_one_event_at_a_time_in_the_partitioned_layout(
    partitioned: None,
) -> None:
    """process_first_deliveries (the Kafka runner's batch mode) reserves a batch together on the
    default layout only; here each event goes through process_event, its row keyed by its own
    partition column, and a repeated id is a duplicate."""
    moment = datetime(2026, 3, 4, 5, 6, tzinfo=UTC)
    first, second = uuid7_at(moment), uuid7_at(moment + DAY)
    ran: list[str] = []
    with transaction.atomic():
        results = process_first_deliveries(
            "billing", [(e, lambda e=e: ran.append(e)) for e in (first, second, first)]
        )
    assert [r.applied for r in results] == [True, True, False]
    assert ran == [first, second]
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT event_id, occurred_at FROM {TABLE} ORDER BY occurred_at")
        rows = cursor.fetchall()
    assert rows == [
        (first, partitioning.partition_time(first)),
        (second, partitioning.partition_time(second)),
    ]
