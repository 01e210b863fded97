"""A phased request's stored body goes with its record (issue 34, 4).

A :class:`FlowRun` holds the raw request body (passwords, card numbers), the query string and
the user. It is deleted with its record by the purge (in the batch's own transaction), by the
admin, by ``Model.delete`` and ``QuerySet.delete``; a partition drop deletes no record, so it
leaves no run behind. The runs are real: a phased view stopped after its first phase.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test import Client, override_settings
from django.urls import reverse
from django.utils import timezone

from django_idempotency.flows.completer import delete_orphans
from django_idempotency.models import FlowRun, IdempotencyRecord
from django_idempotency.retention import partitioning
from django_idempotency.retention.purge import purge_all
from testproject.shop.probe_flows import ProbeError
from tests.probes import post
from tests.test_partitioning import reserve, uuid7_at

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("remote_calls")]

URL = "/probe/flow/?card=4111111111111111"
SECRET = "hunter2-card-4111111111111111"


def abandoned_run(client: Client) -> IdempotencyRecord:
    """A phased request that stopped after its first phase: its run holds the body."""
    key = str(uuid.uuid4())
    with pytest.raises(ProbeError):
        post(client, URL, key, data={"password": SECRET}, headers={"X-Flow-Raise": "one"})
    record = IdempotencyRecord.objects.get(key=key)
    assert FlowRun.objects.get(record=record).request["body"]
    return record


def expire(*records: IdempotencyRecord) -> None:
    past = timezone.now() - timedelta(hours=1)
    IdempotencyRecord.objects.filter(pk__in=[r.pk for r in records]).update(
        expires_at=past, locked_until=past
    )


def runs_of(*records: IdempotencyRecord) -> set[int]:
    return set(
        FlowRun.objects.filter(record_id__in=[r.pk for r in records]).values_list(
            "record_id", flat=True
        )
    )


def no_orphans() -> bool:
    """No run whose record is gone (what the completer's sweep would still have to delete)."""
    return delete_orphans() == 0


def test_the_purge_deletes_the_runs_of_the_records_it_deletes_in_its_batches(
    client: Client,
) -> None:
    expired = [abandoned_run(client) for _ in range(3)]
    live = abandoned_run(client)
    expire(*expired)

    result = IdempotencyRecord.objects.delete_expired(batch_size=2)

    assert (result.deleted, result.batches) == (3, 2)
    assert runs_of(*expired) == set()
    assert runs_of(live) == {live.pk}
    assert no_orphans()


def test_purge_all_deletes_the_runs_too(client: Client) -> None:
    record = abandoned_run(client)
    expire(record)
    purge_all()
    assert not IdempotencyRecord.objects.filter(pk=record.pk).exists()
    assert runs_of(record) == set()
    assert no_orphans()


def test_a_record_revived_before_the_delete_keeps_its_run(client: Client) -> None:
    """The purge selected the record, then a request revived it: record and run are kept."""
    target, other = abandoned_run(client), abandoned_run(client)
    expire(target, other)
    revived: list[str] = []

    def revive_before_the_first_delete(
        execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any
    ) -> Any:
        if not revived and sql.lstrip().upper().startswith("DELETE"):
            revived.append(sql)
            IdempotencyRecord.objects.filter(pk=target.pk).update(
                expires_at=timezone.now() + timedelta(hours=1)
            )
        return execute(sql, params, many, context)

    with connection.execute_wrapper(revive_before_the_first_delete):
        result = IdempotencyRecord.objects.delete_expired()

    assert revived and result.deleted == 1
    assert IdempotencyRecord.objects.filter(pk=target.pk).exists()
    assert runs_of(target) == {target.pk}
    assert runs_of(other) == set()
    assert no_orphans()


def test_the_runs_go_with_records_deleted_through_the_orm(client: Client) -> None:
    one, two, three = (abandoned_run(client) for _ in range(3))

    one.delete()
    IdempotencyRecord.objects.filter(pk__in=[two.pk, three.pk]).delete()

    assert runs_of(one, two, three) == set()
    assert not FlowRun.objects.exists()


def test_the_runs_go_with_records_deleted_in_the_admin(admin_client: Client) -> None:
    one, two, three = (abandoned_run(admin_client) for _ in range(3))
    opts = IdempotencyRecord._meta
    delete = reverse(f"admin:{opts.app_label}_{opts.model_name}_delete", args=[one.pk])
    assert admin_client.post(delete, {"post": "yes"}).status_code == 302
    changelist = reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist")
    response = admin_client.post(
        changelist,
        {"action": "delete_selected", "_selected_action": [two.pk, three.pk], "post": "yes"},
    )
    assert response.status_code == 302

    assert not IdempotencyRecord.objects.exists()
    assert runs_of(one, two, three) == set()
    assert not FlowRun.objects.exists()


def test_the_admins_purge_action_deletes_the_runs(admin_client: Client) -> None:
    expired, live = abandoned_run(admin_client), abandoned_run(admin_client)
    expire(expired)
    opts = IdempotencyRecord._meta
    changelist = reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist")
    response = admin_client.post(
        changelist,
        {"action": "purge_expired", "_selected_action": [expired.pk], "post": "yes"},
        follow=True,
    )
    assert response.status_code == 200
    assert runs_of(expired) == set()
    assert runs_of(live) == {live.pk}


@pytest.mark.postgres
def test_a_partition_drop_leaves_no_run_of_a_deleted_record(client: Client) -> None:
    """Only ProcessedEvent is partitioned: dropping its partitions deletes no record, and the
    purge that drops them deletes the expired records' runs with the records."""
    expired, live = abandoned_run(client), abandoned_run(client)
    expire(expired)
    with override_settings(IDEMPOTENCY={"EVENT_PARTITIONS": "day"}):
        partitioning.convert("default")
        try:
            now = partitioning.database_now("default")
            old = partitioning.floor(now, "day") - timedelta(days=6)
            assert reserve("lifetime", uuid7_at(old + timedelta(hours=1)), processed_at=old)
            later = now + timedelta(days=8)  # old's range ended EVENT_TTL (7 days) before this
            dropped = partitioning.drop_expired_partitions("default", now=later).dropped
            assert partitioning.partition_name(old) in dropped
            assert runs_of(expired, live) == {expired.pk, live.pk}
            assert no_orphans()

            purge_all()  # the purge and its partition maintenance

            assert runs_of(expired) == set()
            assert runs_of(live) == {live.pk}
            assert no_orphans()
        finally:
            if partitioning.is_partitioned("default"):
                partitioning.revert("default")


@pytest.mark.postgres
@pytest.mark.mysql
@pytest.mark.django_db(transaction=True, databases=["default", "repeatable_read"])
def test_the_purge_at_repeatable_read_deletes_the_runs_with_their_records(client: Client) -> None:
    """The purge on a connection at REPEATABLE READ (MariaDB's default level): each batch
    selects, locks and deletes in one transaction, and its runs go with its records."""
    expired = [abandoned_run(client) for _ in range(3)]
    live = abandoned_run(client)
    expire(*expired)

    result = IdempotencyRecord.objects.using("repeatable_read").delete_expired(batch_size=2)

    assert (result.deleted, result.batches) == (3, 2)
    assert runs_of(*expired) == set()
    assert runs_of(live) == {live.pk}
    assert no_orphans()


def orphan(*records: IdempotencyRecord) -> None:
    """Delete ``records`` in raw SQL, as an operator or an older version might: their runs
    stay behind, with the bodies they hold."""
    table = connection.ops.quote_name(IdempotencyRecord._meta.db_table)
    marks = ", ".join(["%s"] * len(records))
    with connection.cursor() as cursor:
        cursor.execute(f"DELETE FROM {table} WHERE id IN ({marks})", [r.pk for r in records])
    assert runs_of(*records) == {r.pk for r in records}


def flow_runs_result(results: list[Any]) -> Any:
    (found,) = [r for r in results if r.label == FlowRun._meta.label]
    return found


def test_the_purge_deletes_orphan_runs_in_its_own_batches(client: Client) -> None:
    """A run whose record is already gone (deleted in raw SQL) is deleted by the purge, in
    batches, without the completer's sweep."""
    orphans = [abandoned_run(client) for _ in range(3)]
    live = abandoned_run(client)
    orphan(*orphans)

    assert flow_runs_result(purge_all(dry_run=True)).deleted == 3
    assert runs_of(*orphans) == {r.pk for r in orphans}  # a dry run deletes nothing
    result = flow_runs_result(purge_all(batch_size=2))

    assert (result.deleted, result.batches, result.finished) == (3, 2, True)
    assert runs_of(*orphans) == set()
    assert runs_of(live) == {live.pk}
    assert no_orphans()


def test_the_orphan_runs_share_the_purges_time_budget(client: Client) -> None:
    orphans = [abandoned_run(client) for _ in range(3)]
    orphan(*orphans)

    result = flow_runs_result(purge_all(batch_size=2, max_seconds=1e-9))

    assert (result.deleted, result.batches, result.finished) == (2, 1, False)
    assert len(runs_of(*orphans)) == 1
    assert flow_runs_result(purge_all(batch_size=2)).deleted == 1
    assert no_orphans()


def test_the_command_reports_the_orphan_runs(client: Client) -> None:
    from io import StringIO

    from django.core.management import call_command

    orphan(abandoned_run(client))
    out = StringIO()
    call_command("idempotency_purge", stdout=out)
    assert "flow runs without a record: deleted 1 in 1 batch" in out.getvalue()
    assert not FlowRun.objects.exists()
