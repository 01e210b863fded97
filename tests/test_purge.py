"""The batched purge: exactly the expired rows go, by the database clock, in bounded batches.

Runs on every backend, the race at the end included: a purge that runs while requests and
consumers insert and revive rows loses no live record.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from io import StringIO
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.db import close_old_connections, connection, transaction
from django.db.models import Model
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_idempotency.events.core import try_reserve
from django_idempotency.managers import DatabaseNow, PurgeResult
from django_idempotency.models import (
    EventDelivery,
    FlowRun,
    IdempotencyRecord,
    OutboxEntry,
    ProcessedEvent,
)
from django_idempotency.retention.purge import purge_all
from django_idempotency.tasks import PURGE_TASK_NAME, purge_expired

pytestmark = pytest.mark.django_db

HOUR = timedelta(hours=1)


def make_record(key: str, expires_in: timedelta, **fields: Any) -> IdempotencyRecord:
    return IdempotencyRecord.objects.create(
        owner="user:1",
        key=key,
        fingerprint="0" * 64,
        method="POST",
        path="/api/orders/",
        expires_at=timezone.now() + expires_in,
        **fields,
    )


def make_event(key: str, expires_in: timedelta, consumer: str = "billing") -> ProcessedEvent:
    return ProcessedEvent.objects.create(
        consumer=consumer, event_id=key, expires_at=timezone.now() + expires_in
    )


def make_delivery(key: str, expires_in: timedelta, **fields: Any) -> EventDelivery:
    return EventDelivery.objects.create(
        consumer="billing", event_id=key, expires_at=timezone.now() + expires_in, **fields
    )


def make_sent_message(key: str, expires_in: timedelta) -> OutboxEntry:
    """A sent outbox message (only sent ones expire)."""
    now = timezone.now()
    return OutboxEntry.objects.create(
        event_id=key,
        destination="billing.apply",
        payload={},
        state=OutboxEntry.State.SENT,
        sent_at=now,
        expires_at=now + expires_in,
    )


MAKERS: dict[type[Model], Callable[[str, timedelta], Model]] = {
    IdempotencyRecord: make_record,
    ProcessedEvent: make_event,
    EventDelivery: make_delivery,
    OutboxEntry: make_sent_message,
}


def seed(model: type[Model], expired: int, live: int) -> tuple[set[int], set[int]]:
    make = MAKERS[model]
    gone = {make(f"old-{i}", -HOUR - timedelta(seconds=i)).pk for i in range(expired)}
    kept = {make(f"new-{i}", HOUR + timedelta(seconds=i)).pk for i in range(live)}
    return gone, kept


def pks(model: type[Model]) -> set[int]:
    return set(model._default_manager.values_list("pk", flat=True))


@pytest.mark.parametrize("model", list(MAKERS), ids=lambda m: m.__name__)
def test_purge_deletes_exactly_the_expired_rows(model: type[Model]) -> None:
    expired, live = seed(model, expired=7, live=5)

    result = model._default_manager.delete_expired()  # type: ignore[attr-defined]

    assert pks(model) == live
    assert result.deleted == len(expired) == 7
    assert result.batches == 1
    assert result.finished and not result.dry_run
    assert result.label == model._meta.label
    assert model._default_manager.delete_expired().deleted == 0  # type: ignore[attr-defined]


@pytest.mark.parametrize("model", list(MAKERS), ids=lambda m: m.__name__)
def test_dry_run_counts_and_deletes_nothing(model: type[Model]) -> None:
    expired, live = seed(model, expired=5, live=3)

    result = model._default_manager.delete_expired(  # type: ignore[attr-defined]
        batch_size=2, dry_run=True
    )

    assert (result.deleted, result.batches, result.dry_run) == (5, 3, True)
    assert pks(model) == expired | live


def test_live_lease_is_kept_even_past_expiry() -> None:
    leased = make_record("leased", -HOUR, state="in_progress", locked_until=timezone.now() + HOUR)
    lapsed = make_record("lapsed", -HOUR, state="in_progress", locked_until=timezone.now() - HOUR)
    no_lease = make_record("no-lease", -HOUR, state="in_progress", locked_until=None)
    done = make_record("done", -HOUR, state="completed", locked_until=timezone.now() + HOUR)
    leased_live = make_record(
        "leased-live", HOUR, state="in_progress", locked_until=timezone.now() + HOUR
    )

    result = IdempotencyRecord.objects.delete_expired()

    assert result.deleted == 3
    assert pks(IdempotencyRecord) == {leased.pk, leased_live.pk}
    assert {lapsed.pk, no_lease.pk, done.pk}.isdisjoint(pks(IdempotencyRecord))
    assert IdempotencyRecord.objects.delete_expired(dry_run=True).deleted == 0


def test_expiry_follows_the_database_clock_not_the_app_server() -> None:
    """An app server whose clock runs a day ahead must not purge rows that are still live."""
    _, live = seed(IdempotencyRecord, expired=2, live=2)
    skewed = timezone.now() + timedelta(days=1)

    with mock.patch("django.utils.timezone.now", return_value=skewed):
        result = IdempotencyRecord.objects.delete_expired()

    assert result.deleted == 2
    assert pks(IdempotencyRecord) == live


def test_batches_are_bounded() -> None:
    _, live = seed(ProcessedEvent, expired=25, live=4)

    with CaptureQueriesContext(connection) as queries:
        result = ProcessedEvent.objects.delete_expired(batch_size=10)

    assert (result.deleted, result.batches, result.finished) == (25, 3, True)
    assert pks(ProcessedEvent) == live
    selects = [q["sql"] for q in queries if q["sql"].startswith("SELECT") and "LIMIT" in q["sql"]]
    deletes = [q["sql"] for q in queries if q["sql"].startswith("DELETE")]
    assert len(selects) == 3  # 10, 10, 5: the short batch shows nothing is left
    assert all("LIMIT 10" in sql and "expires_at" in sql.split("ORDER BY")[1] for sql in selects)
    assert len(deletes) == 3
    if connection.features.has_select_for_update_skip_locked:
        assert all("SKIP LOCKED" in sql for sql in selects)


def test_time_budget_stops_between_batches() -> None:
    seed(EventDelivery, expired=25, live=0)

    result = EventDelivery.objects.delete_expired(batch_size=10, max_seconds=1e-9)

    # One batch always runs; then the spent budget stops it, and the next run goes on.
    assert (result.deleted, result.batches, result.finished) == (10, 1, False)
    assert EventDelivery.objects.count() == 15
    assert EventDelivery.objects.delete_expired(batch_size=10, max_seconds=0).deleted == 15


@override_settings(IDEMPOTENCY={"PURGE_BATCH_SIZE": 4, "PURGE_MAX_SECONDS": 0})
def test_defaults_come_from_settings() -> None:
    seed(IdempotencyRecord, expired=9, live=1)

    result = IdempotencyRecord.objects.delete_expired()

    assert (result.deleted, result.batches) == (9, 3)


def test_filters_narrow_the_purge() -> None:
    mine = make_event("a", -HOUR, consumer="mine")
    theirs = make_event("b", -HOUR, consumer="theirs")

    assert ProcessedEvent.objects.filter(consumer="mine").delete_expired().deleted == 1

    assert pks(ProcessedEvent) == {theirs.pk}
    assert not ProcessedEvent.objects.filter(pk=mine.pk).exists()


def test_parked_deliveries_are_kept_until_they_expire() -> None:
    parked_live = make_delivery("p1", HOUR, parked_at=timezone.now(), deliveries=5)
    parked_old = make_delivery("p2", -HOUR, parked_at=timezone.now() - HOUR, deliveries=5)

    assert EventDelivery.objects.delete_expired().deleted == 1

    assert pks(EventDelivery) == {parked_live.pk}
    assert not EventDelivery.objects.filter(pk=parked_old.pk).exists()


@pytest.mark.parametrize(
    "arguments", [{"batch_size": 0}, {"batch_size": True}, {"max_seconds": -1}]
)
def test_invalid_arguments_raise(arguments: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"batch_size|max_seconds"):
        ProcessedEvent.objects.delete_expired(**arguments)


#: What purge_all() reports, in its order: the records, then the flow runs whose record is
#: gone (tests/test_flow_run_lifetime.py seeds those), then the other tables.
PURGED = [IdempotencyRecord, FlowRun, ProcessedEvent, EventDelivery, OutboxEntry]


def test_purge_all_covers_the_four_tables() -> None:
    for model in MAKERS:
        seed(model, expired=3, live=2)

    results = purge_all(batch_size=2, max_seconds=60)

    assert [r.label for r in results] == [m._meta.label for m in PURGED]
    tables = [r for r in results if r.label != FlowRun._meta.label]
    assert [(r.deleted, r.batches, r.finished) for r in tables] == [(3, 2, True)] * 4
    assert all(model._default_manager.count() == 2 for model in MAKERS)
    assert all(r.partitions is None for r in results)


def test_purge_all_shares_a_spent_budget_so_no_table_starves() -> None:
    for model in MAKERS:
        seed(model, expired=5, live=0)

    results = purge_all(batch_size=2, max_seconds=1e-9)

    tables = [r for r in results if r.label != FlowRun._meta.label]
    assert [(r.deleted, r.finished) for r in tables] == [(2, False)] * 4


def test_stats_report_size_backlog_and_counts() -> None:
    make_record("a", -HOUR, state="in_progress", locked_until=timezone.now() + HOUR)
    make_record("b", -HOUR, state="completed")
    make_record("c", HOUR, state="in_progress")
    make_delivery("d", HOUR, parked_at=timezone.now())

    records = IdempotencyRecord.objects.stats()
    deliveries = EventDelivery.objects.stats()

    assert records.expired == 1  # the leased one is not purgeable
    assert records.counts == {"in_progress": 2, "live_leases": 1}
    assert records.oldest_expires_at is not None
    assert records.oldest_expires_at < timezone.now() - timedelta(minutes=59)
    assert deliveries.counts == {"parked": 1}
    assert records.table == "django_idempotency_idempotencyrecord"
    if connection.vendor == "sqlite":
        assert (records.size_bytes, records.approx_rows) == (None, 3)
    else:
        assert records.size_bytes is not None and records.size_bytes > 0
    assert json.loads(json.dumps(records.as_dict()))["counts"]["live_leases"] == 1


# --- the command ------------------------------------------------------------------------------


def run_purge(*args: str) -> str:
    out = StringIO()
    call_command("idempotency_purge", *args, stdout=out)
    return out.getvalue()


def test_command_prints_what_it_did_per_table() -> None:
    seed(IdempotencyRecord, expired=3, live=1)
    seed(ProcessedEvent, expired=1, live=1)

    output = run_purge("--batch-size", "2")

    assert "idempotency records: deleted 3 in 2 batches" in output
    assert "processed events: deleted 1 in 1 batch " in output
    assert "event deliveries: deleted 0 in 0 batches" in output
    assert IdempotencyRecord.objects.count() == 1


def test_command_dry_run_deletes_nothing() -> None:
    seed(IdempotencyRecord, expired=3, live=1)

    output = run_purge("--dry-run")

    assert "idempotency records: would delete 3 in 1 batch" in output
    assert IdempotencyRecord.objects.count() == 4


def test_command_warns_when_the_budget_runs_out() -> None:
    seed(ProcessedEvent, expired=5, live=0)

    output = run_purge("--batch-size", "1", "--max-seconds", "0.000000001")

    assert "stopped at the time budget" in output
    assert "the next run goes on" in output


@pytest.mark.parametrize(
    "args",
    [
        ["--batch-size", "0"],
        ["--batch-size", "x"],
        ["--batch-size", "99999999999999999999"],
        ["--max-seconds", "-1"],
        ["--max-seconds", "nan"],
        ["--max-seconds", "inf"],
        ["--database", "nowhere"],
    ],
)
def test_command_rejects_bad_arguments(args: list[str]) -> None:
    with pytest.raises(CommandError):
        run_purge(*args)


@pytest.mark.parametrize("batch_size", [0, 10**20, True])
def test_purge_all_rejects_a_batch_size_out_of_range(batch_size: int) -> None:
    with pytest.raises(ValueError, match="batch_size"):
        purge_all(batch_size=batch_size)


# --- several databases ------------------------------------------------------------------------


def seed_other() -> tuple[int, int]:
    now = timezone.now()
    old = ProcessedEvent.objects.using("other").create(
        consumer="billing", event_id="old", expires_at=now - HOUR
    )
    with transaction.atomic(using="other"):
        assert try_reserve("new", "billing", using="other")
    return old.pk, ProcessedEvent.objects.using("other").get(event_id="new").pk


@pytest.mark.django_db(databases=["default", "other"])
def test_the_purge_covers_each_database_it_is_given() -> None:
    """Rows a consumer wrote with using="other" are purged when "other" is listed."""
    old, new = seed_other()
    seed(ProcessedEvent, expired=1, live=0)

    purge_all()  # IDEMPOTENCY["DATABASE"] only, as documented
    assert set(ProcessedEvent.objects.using("other").values_list("pk", flat=True)) == {old, new}
    assert not ProcessedEvent.objects.exists()

    results = purge_all(databases=["default", "other"])
    assert [(r.database, r.label) for r in results] == [
        (alias, model._meta.label) for alias in ("default", "other") for model in PURGED
    ]
    assert set(ProcessedEvent.objects.using("other").values_list("pk", flat=True)) == {new}


@pytest.mark.django_db(databases=["default", "other"])
def test_the_command_and_the_task_take_the_databases() -> None:
    seed_other()
    output = run_purge("--database", "default", "--database", "other")
    assert "[other] processed events: deleted 1 in 1 batch" in output
    seed_other_again = ProcessedEvent.objects.using("other").create(
        consumer="billing", event_id="older", expires_at=timezone.now() - HOUR
    )
    result = purge_expired.apply(kwargs={"databases": ["other"]}).get(timeout=30)
    assert result[f"other:{ProcessedEvent._meta.label}"]["deleted"] == 1
    assert not ProcessedEvent.objects.using("other").filter(pk=seed_other_again.pk).exists()
    stats = json.loads(run_purge("--stats", "--database", "other"))
    assert {row["database"] for row in stats} == {"other"}


# --- the DELETE re-checks expiry --------------------------------------------------------------


REVIVE: dict[type[Model], dict[str, Any]] = {
    IdempotencyRecord: {"expires_at": timezone.now() + timedelta(days=3650)},
    ProcessedEvent: {"expires_at": timezone.now() + timedelta(days=3650)},
    EventDelivery: {"expires_at": timezone.now() + timedelta(days=3650)},
    OutboxEntry: {"expires_at": timezone.now() + timedelta(days=3650)},
}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("model", list(MAKERS), ids=lambda m: m.__name__)
def test_a_row_revived_between_the_select_and_the_delete_is_kept(model: type[Model]) -> None:
    """Deterministic: the row is revived after the purge selected it, just before its DELETE."""
    gone, _ = seed(model, expired=3, live=0)
    target = min(gone)
    table = model._meta.db_table
    revived: list[str] = []

    def revive_before_the_delete(
        execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any
    ) -> Any:
        if not revived and sql.lstrip().upper().startswith("DELETE") and table in sql:
            revived.append(sql)
            model._base_manager.filter(pk=target).update(**REVIVE[model])
        return execute(sql, params, many, context)

    with connection.execute_wrapper(revive_before_the_delete):
        result = model._default_manager.delete_expired(batch_size=10)  # type: ignore[attr-defined]

    assert revived, "the purge ran no DELETE"
    assert pks(model) == {target}
    assert result.deleted == 2


def test_command_stats_prints_json() -> None:
    seed(IdempotencyRecord, expired=1, live=1)

    stats = json.loads(run_purge("--stats"))

    assert [s["label"] for s in stats] == [m._meta.label for m in MAKERS]
    assert stats[0]["expired"] == 1
    assert IdempotencyRecord.objects.count() == 2


# --- the Celery task ---------------------------------------------------------------------------


def test_task_is_registered_under_its_public_name() -> None:
    from testproject.celery import app

    app.loader.import_default_modules()  # what a worker does at start: autodiscovery
    assert PURGE_TASK_NAME == "django_idempotency.purge_expired"
    assert PURGE_TASK_NAME in app.tasks
    assert app.tasks[PURGE_TASK_NAME].name == purge_expired.name == PURGE_TASK_NAME


def test_beat_schedule_of_the_test_project_names_the_task() -> None:
    entries = [e for e in settings.CELERY_BEAT_SCHEDULE.values() if e["task"] == PURGE_TASK_NAME]
    assert len(entries) == 1
    assert entries[0]["schedule"] <= timedelta(hours=1)


def test_task_runs_the_purge_eagerly() -> None:
    seed(IdempotencyRecord, expired=3, live=1)
    seed(EventDelivery, expired=2, live=0)

    result = purge_expired.apply(kwargs={"batch_size": 2}).get(timeout=30)

    assert result[IdempotencyRecord._meta.label]["deleted"] == 3
    assert result[IdempotencyRecord._meta.label]["batches"] == 2
    assert result[EventDelivery._meta.label]["deleted"] == 2
    assert result[ProcessedEvent._meta.label] == PurgeResult(
        ProcessedEvent._meta.label, 0, 0, 0.0, finished=True, database="default"
    ).as_dict() | {"seconds": result[ProcessedEvent._meta.label]["seconds"]}
    assert json.loads(json.dumps(result)) == result  # JSON-serializable for any result backend
    assert IdempotencyRecord.objects.count() == 1


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.timeout(360)  # above the worker's start guard (180 s) and the task's (120 s)
@pytest.mark.django_db(transaction=True)
def test_a_real_worker_runs_the_purge_by_its_registered_name(tmp_path: Path) -> None:
    """What Celery beat does: send the task by name; a worker that autodiscovered it runs it."""
    from tests.conftest import require_service
    from tests.services import BROKER_URLS
    from tests.workers import database_url, worker_group

    require_service("redis")
    _, live = seed(IdempotencyRecord, expired=3, live=1)
    with worker_group(
        broker_url=BROKER_URLS["redis"],
        db_url=database_url(connection.settings_dict),
        log_dir=tmp_path,
        label="purge",
        workers=1,
        concurrency=1,
    ) as group:
        result = group.publish(PURGE_TASK_NAME, kwargs={"batch_size": 2})
        try:
            value = result.get(timeout=120)
        except TimeoutError:
            pytest.fail(f"the purge task did not run within 120s\n{group.logs()}")

    assert value[IdempotencyRecord._meta.label]["deleted"] == 3
    assert value[IdempotencyRecord._meta.label]["batches"] == 2
    assert pks(IdempotencyRecord) == live


# --- the race ----------------------------------------------------------------------------------


def _bulk_expired(count: int) -> dict[type[Model], list[int]]:
    now = timezone.now()

    def past(i: int) -> Any:
        return now - HOUR - timedelta(seconds=i)  # higher pk: expired longer ago

    common = {"fingerprint": "0" * 64, "method": "POST", "path": "/api/orders/"}
    records = [
        IdempotencyRecord(owner="user:seed", key=f"old-{i}", expires_at=past(i), **common)
        for i in range(count)
    ]
    events = [
        ProcessedEvent(consumer="seed", event_id=f"old-{i}", expires_at=past(i))
        for i in range(count)
    ]
    deliveries = [
        EventDelivery(consumer="seed", event_id=f"old-{i}", expires_at=past(i))
        for i in range(count // 2)
    ]
    for batch in (records, events, deliveries):
        type(batch[0]).objects.bulk_create(batch)
    return {model: sorted(pks(model)) for model in MAKERS}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.django_db(transaction=True)
def test_purge_racing_requests_and_consumers_loses_no_live_record() -> None:
    """Purge while threads insert live rows and revive expired records (a new claim on an
    expired key takes the old row over). Every row that was live when its writer committed must
    survive; every expired row nobody touched must go."""
    expired = _bulk_expired(300)
    leased = {
        make_record(
            f"leased-{i}", -HOUR, state="in_progress", locked_until=timezone.now() + HOUR
        ).pk
        for i in range(20)
    }
    stop = threading.Event()
    writers = (IdempotencyRecord, ProcessedEvent, EventDelivery)  # the outbox has none here
    inserted: dict[type[Model], list[int]] = {model: [] for model in writers}
    revived: list[int] = []
    errors: list[BaseException] = []

    def worker(body: Callable[[int], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                n = 0
                while not stop.is_set():
                    body(n)
                    n += 1
            except BaseException as exc:  # noqa: BLE001  (re-raised by the main thread's assert)
                errors.append(exc)
            finally:
                close_old_connections()
                connection.close()

        return run

    def request(n: int) -> None:
        inserted[IdempotencyRecord].append(make_record(f"live-{n}", HOUR).pk)

    def consumer(n: int) -> None:
        inserted[ProcessedEvent].append(make_event(f"live-{n}", HOUR).pk)
        inserted[EventDelivery].append(make_delivery(f"live-{n}", HOUR).pk)

    targets = iter(expired[IdempotencyRecord])

    def reviver(n: int) -> None:
        # Newest first while the purge goes oldest first (expires_at order): they meet midway.
        pk = next(targets, None)
        if pk is None:
            stop.wait(0.01)
            return
        later = timezone.now() + HOUR
        if IdempotencyRecord.objects.filter(pk=pk, expires_at__lt=DatabaseNow()).update(
            state="in_progress", token=uuid.uuid4(), locked_until=later, expires_at=later
        ):
            revived.append(pk)

    threads = [threading.Thread(target=worker(f)) for f in (request, consumer, reviver)]
    purged = {model: 0 for model in MAKERS}
    try:  # the writers stop whatever happens, or pytest would hang on them at exit
        for thread in threads:
            thread.start()
        # Let every writer get going first, so the purge meets them (bounded: a loaded machine).
        gate = time.monotonic() + 60.0
        while len(revived) < 5 or not all(inserted.values()):
            assert time.monotonic() < gate and not errors, (
                "writers did not start",
                errors,
                len(revived),
                {m.__name__: len(v) for m, v in inserted.items()},
            )
            time.sleep(0.005)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and not errors:
            for model in MAKERS:
                manager: Any = model._default_manager
                purged[model] += manager.delete_expired(batch_size=25).deleted
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert not errors, errors
    assert not any(thread.is_alive() for thread in threads)
    for model in MAKERS:
        purged[model] += model._default_manager.delete_expired().deleted  # type: ignore[attr-defined]

    records = pks(IdempotencyRecord)
    assert set(inserted[IdempotencyRecord]) <= records
    assert set(revived) <= records
    assert leased <= records
    assert records == set(inserted[IdempotencyRecord]) | set(revived) | leased
    for model in (ProcessedEvent, EventDelivery):
        assert pks(model) == set(inserted[model])
    # Both sides did real work, so the rows met in the middle.
    assert revived and purged[IdempotencyRecord] == len(expired[IdempotencyRecord]) - len(revived)
    assert all(inserted.values())
