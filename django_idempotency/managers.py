"""Managers for the idempotency tables: the batched purge of expired rows, and cheap stats.

Every model gets ``objects.delete_expired(batch_size=None, max_seconds=None, dry_run=False)``:

* It deletes in bounded batches, one short transaction per batch. A batch selects up to
  ``batch_size`` primary keys in ``expires_at`` order (the ``expires_at`` index), then deletes
  those rows by primary key, re-checking the expiry condition in the ``DELETE`` itself, so a
  row that a request revived in between is kept. Where the database supports it (PostgreSQL,
  MariaDB 10.6+, MySQL 8), the select takes ``FOR UPDATE SKIP LOCKED`` so the purge never waits
  on a row a live request holds, and two purges running at once share the work.
* "Expired" is decided by the database clock (:class:`DatabaseNow`), never by the application
  server's, so app servers with skewed clocks agree.
* An :class:`~django_idempotency.models.IdempotencyRecord` that is ``in_progress`` under a live
  lease (``locked_until`` after the database clock) is never deleted, even past ``expires_at``.
* :class:`~django_idempotency.models.EventDelivery` rows are deleted at ``expires_at`` whether or
  not they are parked: a parked event stays parked (and visible in the admin) until its row
  expires, and a replay after that is counted afresh and can be parked again.
* When ``ProcessedEvent`` is range-partitioned (:mod:`django_idempotency.retention.partitioning`),
its
  ``delete_expired`` only deletes rows in the timeless and default partitions; day or month
  partitions are dropped whole by :func:`~django_idempotency.retention.partitioning.maintain`,
  which
  :func:`~django_idempotency.retention.purge.purge_all` runs too. No filter can narrow that, so a
  filtered queryset's ``delete_expired`` raises ``NotSupportedError`` there.

Each queryset works on ``IDEMPOTENCY["DATABASE"]``, or on the alias picked with ``.using()``;
the database router is not consulted. :func:`django_idempotency.retention.purge.purge_all` runs
the purge
over the four tables (records, processed events, deliveries and
sent outbox messages) of every database that holds them.
"""

from __future__ import annotations

import json
import math
import time
from contextlib import nullcontext
from typing import Any, ClassVar, TypeVar, cast

from django.db import NotSupportedError, connections, models, transaction
from django.db.models import Exists, OuterRef, Q

from django_idempotency.clock import DatabaseNow
from django_idempotency.conf import MAX_BATCH_SIZE, conf
from django_idempotency.retention import partitioning
from django_idempotency.retention.reports import PurgeResult, TableStats

__all__ = [
    "STATS_COUNT_LIMIT",
    "DatabaseNow",
    "EventDeliveryQuerySet",
    "ExpiringQuerySet",
    "FlowRunQuerySet",
    "IdempotencyRecordQuerySet",
    "ProcessedEventQuerySet",
    "PurgeResult",
    "TableStats",
]

_M = TypeVar("_M", bound=models.Model)

STATS_COUNT_LIMIT = 10_000
"""The most rows a stats figure counts exactly; past it, the planner's estimate is given."""


def bounded_count(queryset: models.QuerySet[Any], limit: int = STATS_COUNT_LIMIT) -> int:
    """``queryset``'s row count, reading at most ``limit + 1`` rows of an index.

    Up to ``limit`` the figure is exact. Past it, PostgreSQL and MySQL/MariaDB give the
    planner's estimate for the same query (never below ``limit + 1``), so a figure over a table
    of ten million rows costs ``limit`` index entries, not a scan; SQLite counts. The caller
    knows a figure above ``limit`` is an estimate.
    """
    capped = queryset.order_by().values("pk")[: limit + 1].count()
    if capped <= limit:
        return capped
    connection = connections[queryset.db]
    if connection.vendor not in ("postgresql", "mysql"):
        return queryset.count()
    sql, params = queryset.order_by().values("pk").query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute(
            f"EXPLAIN {'(FORMAT JSON) ' if connection.vendor == 'postgresql' else ''}{sql}", params
        )
        if connection.vendor == "postgresql":
            plan = cursor.fetchone()[0]
            if isinstance(plan, str):
                plan = json.loads(plan)
            estimate = int(plan[0]["Plan"]["Plan Rows"])
        else:
            columns = [column[0] for column in cursor.description]
            rows = [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]
            estimate = max((int(row.get("rows") or 0) for row in rows), default=0)
    return max(estimate, capped)


def _batch_size(value: int | None) -> int:
    if value is None:
        return conf.PURGE_BATCH_SIZE
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_BATCH_SIZE:
        raise ValueError(
            f"batch_size must be a positive integer of at most {MAX_BATCH_SIZE}, not {value!r}."
        )
    return value


def _max_seconds(value: float | None) -> float:
    if value is None:
        return conf.PURGE_MAX_SECONDS
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"max_seconds must be zero (no limit) or a finite number, not {value!r}.")
    return float(value)


class ExpiringQuerySet(models.QuerySet[_M]):
    """Queries shared by the tables, which all expire on ``expires_at``."""

    #: The order a purge batch selects its rows in (an indexed column).
    purge_order: ClassVar[str] = "expires_at"

    def _alias(self) -> str:
        # Records live where the core writes them (IDEMPOTENCY["DATABASE"]) unless the caller
        # picked a database with .using().
        chosen: str | None = self._db  # type: ignore[attr-defined]
        return chosen or conf.DATABASE

    def expired_condition(self) -> Q:
        """The rows the purge may delete now, by the database clock."""
        return Q(expires_at__lt=DatabaseNow())

    def expired(self) -> ExpiringQuerySet[_M]:
        """Rows the purge may delete now."""
        return self.filter(self.expired_condition())

    def delete_expired(
        self,
        batch_size: int | None = None,
        max_seconds: float | None = None,
        dry_run: bool = False,
    ) -> PurgeResult:
        """Delete expired rows in batches of ``batch_size``, for at most ``max_seconds``.

        ``batch_size`` defaults to ``IDEMPOTENCY["PURGE_BATCH_SIZE"]`` and ``max_seconds`` to
        ``IDEMPOTENCY["PURGE_MAX_SECONDS"]`` (0: no limit; the budget is checked after each
        batch, so at least one batch runs). A dry run counts the rows it would delete and
        deletes nothing. Filters on the queryset narrow what is deleted.
        """
        size = _batch_size(batch_size)
        budget = _max_seconds(max_seconds)
        started = time.monotonic()
        alias = self._alias()
        queryset = self.using(alias)
        if dry_run:
            count = queryset.filter(self.expired_condition()).count()
            return PurgeResult(
                label=self.model._meta.label,
                deleted=count,
                batches=math.ceil(count / size),
                seconds=time.monotonic() - started,
                finished=True,
                dry_run=True,
            )
        deleted = batches = 0
        while True:
            selected, removed = queryset._delete_batch(alias, size)
            if selected:
                batches += 1
                deleted += removed
            finished = selected < size
            # The budget is checked after each batch, so every call makes progress.
            if finished or (budget and time.monotonic() - started >= budget):
                break
        return PurgeResult(
            label=self.model._meta.label,
            deleted=deleted,
            batches=batches,
            seconds=time.monotonic() - started,
            finished=finished,
        )

    def _delete_batch(self, alias: str, size: int) -> tuple[int, int]:
        """Delete one batch in one short transaction; return (rows selected, rows deleted)."""
        condition = self.expired_condition()
        locking = connections[alias].features.has_select_for_update_skip_locked
        # Without row locks (SQLite) the select runs on its own and the DELETE is the whole
        # transaction: a read that upgrades to a write could fail with "database is locked".
        with transaction.atomic(using=alias) if locking else nullcontext():
            batch = self.filter(condition).order_by(self.purge_order)
            if locking:
                # Rows a live request has locked are skipped, not waited for.
                batch = batch.select_for_update(skip_locked=True)
            pks = list(batch.values_list("pk", flat=True)[:size])
            if not pks:
                return 0, 0
            removed = self._delete_rows(alias, condition, pks)
        return len(pks), removed

    def _delete_rows(self, alias: str, condition: Q, pks: list[Any]) -> int:
        """Delete the selected rows that still match ``condition``; return how many."""
        # The condition is checked again by the DELETE: a row revived since the select
        # (a new claim on an expired key, a lease taken over) is kept.
        removed, _ = self.model._base_manager.using(alias).filter(condition, pk__in=pks).delete()
        return removed

    def stats(self) -> TableStats:
        """Size, estimated rows, purge backlog and oldest expiry of this table."""
        alias = self._alias()
        queryset = self.using(alias)
        table = self.model._meta.db_table
        size_bytes, approx_rows = _table_size(alias, table)
        if approx_rows is None and connections[alias].vendor == "sqlite":
            approx_rows = queryset.count()
        oldest = queryset.order_by("expires_at").values_list("expires_at", flat=True).first()
        return TableStats(
            label=self.model._meta.label,
            table=table,
            size_bytes=size_bytes,
            approx_rows=approx_rows,
            expired=queryset.filter(self.expired_condition()).count(),
            oldest_expires_at=oldest,
            counts=self._extra_counts(),
        )

    def _extra_counts(self) -> dict[str, int]:
        return {}


def _table_size(alias: str, table: str) -> tuple[int | None, int | None]:
    """(bytes, estimated rows) from the catalog, or (None, None) where there is none."""
    connection = connections[alias]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            # The table itself, or the partitions of a partitioned one (whose parent holds
            # no data and no statistics).
            cursor.execute(
                "SELECT COALESCE(SUM(pg_total_relation_size(c.oid)), 0),"
                " SUM(GREATEST(c.reltuples, 0))"
                " FROM pg_class c WHERE c.relkind = 'r' AND (c.oid = %s::regclass"
                " OR c.oid IN (SELECT relid FROM pg_partition_tree(%s::regclass)))",
                [connection.ops.quote_name(table)] * 2,
            )
            size, rows = cursor.fetchone()
            return int(size), None if rows is None else int(rows)
        if connection.vendor == "mysql":
            cursor.execute(
                "SELECT data_length + index_length, table_rows FROM information_schema.tables"
                " WHERE table_schema = DATABASE() AND table_name = %s",
                [table],
            )
            row = cursor.fetchone()
            return (None, None) if row is None else (int(row[0]), int(row[1]))
    return None, None


class IdempotencyRecordQuerySet(ExpiringQuerySet[_M]):
    def live_lease_condition(self) -> Q:
        """Records claimed in lease mode whose lease has not run out."""
        return Q(state="in_progress", locked_until__gt=DatabaseNow())

    def expired_condition(self) -> Q:
        # A record held under a live lease is kept even past expires_at: deleting it would let
        # a retry run the view a second time while the first holder is still working.
        return super().expired_condition() & ~self.live_lease_condition()

    def _delete_rows(self, alias: str, condition: Q, pks: list[Any]) -> int:
        """Delete the selected records that still match ``condition``, and their flow runs.

        A :class:`~django_idempotency.models.FlowRun` holds its request's raw body: it is
        deleted in the batch's transaction, so no body outlives its record. The runs go
        first: on SQLite that write takes the database's write lock before the records are
        read again, and on PostgreSQL and MariaDB the batch's rows are already locked, so the
        records deleted are exactly those whose runs were. Deleting the records through the
        ORM cascades to their runs as well (none are left); ``only("pk")`` keeps that delete
        from loading the stored responses.
        """
        # FlowRun, through the reverse relation: models imports this module.
        runs = cast(type[models.Model], self.model._meta.get_field("flow_run").related_model)
        records = self.model._base_manager.using(alias).filter(condition, pk__in=pks)
        with transaction.atomic(using=alias, savepoint=False):
            runs._base_manager.using(alias).filter(record__in=records.values("pk")).delete()
            _, per_model = records.only("pk").delete()
        return per_model.get(self.model._meta.label, 0)

    def _extra_counts(self) -> dict[str, int]:
        # Both read the (state, locked_until) index, at most STATS_COUNT_LIMIT entries each: a
        # plain count scanned the whole table (ten million rows, seconds).
        queryset = self.using(self._alias())
        return {
            "in_progress": bounded_count(queryset.filter(state="in_progress")),
            "live_leases": bounded_count(queryset.filter(self.live_lease_condition())),
        }


class FlowRunQuerySet(ExpiringQuerySet[_M]):
    """A :class:`~django_idempotency.models.FlowRun` expires with its record: the record's purge
    and every ORM delete take it along. What is left is a run whose record is already gone (a
    record deleted in raw SQL, or by a version whose purge kept the runs), holding a request
    body: an orphan. Here "expired" means orphaned, so that ``delete_expired`` (and the purge,
    :func:`~django_idempotency.retention.purge.purge_all`, which calls it right after the
    records') deletes orphans in the same bounded batches, in primary-key order, re-checking
    in the ``DELETE`` that the record is still gone. The completer's ``delete_orphans()`` is
    one such batch."""

    purge_order = "pk"

    def expired_condition(self) -> Q:
        # IdempotencyRecord, through the relation: models imports this module.
        records = cast(type[models.Model], self.model._meta.get_field("record").related_model)
        return Q(~Exists(records._base_manager.filter(pk=OuterRef("record_id"))))

    def orphans(self) -> FlowRunQuerySet[_M]:
        """The runs whose record is gone."""
        return self.filter(self.expired_condition())


class ProcessedEventQuerySet(ExpiringQuerySet[_M]):
    def delete_expired(
        self,
        batch_size: int | None = None,
        max_seconds: float | None = None,
        dry_run: bool = False,
    ) -> PurgeResult:
        alias = self._alias()
        if not partitioning.is_partitioned(alias):
            return super().delete_expired(batch_size, max_seconds, dry_run)
        # Range partitions are dropped whole by partitioning.maintain(); rows only need
        # deleting one by one in the timeless and default partitions (ids without time, late
        # events). A filter cannot apply to either, so it is refused: it used to be ignored,
        # and a purge narrowed to one consumer deleted every consumer's expired rows.
        if self.query.has_filters():
            raise NotSupportedError(
                "ProcessedEvent is range-partitioned (EVENT_PARTITIONS): its purge drops whole "
                "partitions and cannot be narrowed by a filter. Call "
                "ProcessedEvent.objects.delete_expired() without one."
            )
        return partitioning.purge_row_partitions(
            alias,
            batch_size=_batch_size(batch_size),
            max_seconds=_max_seconds(max_seconds),
            dry_run=dry_run,
        )


class EventDeliveryQuerySet(ExpiringQuerySet[_M]):
    def _extra_counts(self) -> dict[str, int]:
        parked = self.using(self._alias()).filter(parked_at__isnull=False)
        return {"parked": bounded_count(parked)}


class OutboxEntryQuerySet(ExpiringQuerySet[_M]):
    """Sent outbox messages expire ``OUTBOX_TTL`` after sending, ``external`` ones (read from the
    log) ``OUTBOX_TTL`` after they were written; pending and parked never do."""

    def lag_seconds(self) -> float:
        """Seconds since the oldest pending message was written (0 when none is pending)."""
        oldest = (
            self.using(self._alias())
            .filter(state="pending")
            .order_by("id")
            .values_list("created_at", flat=True)
            .first()
        )
        if oldest is None:
            return 0.0
        from django.utils import timezone

        return max(float((timezone.now() - oldest).total_seconds()), 0.0)

    def _extra_counts(self) -> dict[str, int]:
        queryset = self.using(self._alias())
        return {
            "pending": bounded_count(queryset.filter(state="pending")),
            "parked": bounded_count(queryset.filter(state="parked")),
            "lag_seconds": round(self.lag_seconds()),
        }
