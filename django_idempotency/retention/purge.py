"""The purge of the four tables, and of the flow runs whose record is gone, over every database
that is asked for, within one time budget.

:func:`purge_all` is what the Celery task :func:`django_idempotency.tasks.purge_expired` and the
``idempotency_purge`` command run. It purges ``IDEMPOTENCY["DATABASE"]`` by default, or each
alias in ``databases``: rows written with ``try_reserve(using=...)``,
``@idempotent_consumer(using=...)`` or a Celery task's ``database`` option live in that alias,
and are purged (and its partitions maintained) only when that alias is listed.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from django.conf import settings

from django_idempotency.conf import conf
from django_idempotency.managers import _batch_size, _max_seconds
from django_idempotency.models import (
    EventDelivery,
    FlowRun,
    IdempotencyRecord,
    OutboxEntry,
    ProcessedEvent,
)
from django_idempotency.retention import partitioning
from django_idempotency.retention.reports import PurgeResult

__all__ = ["purge_all", "purged_databases"]


def purged_databases(databases: Iterable[str] | str | None = None) -> list[str]:
    """The aliases to purge: ``databases`` (checked, duplicates removed), else ``DATABASE``."""
    if databases is None:
        return [conf.DATABASE]
    aliases = [databases] if isinstance(databases, str) else list(databases)
    unknown = [alias for alias in aliases if alias not in settings.DATABASES]
    if unknown or not aliases:
        raise ValueError(
            f"Unknown database alias {', '.join(map(repr, unknown)) or '(none given)'}; "
            f"DATABASES has {', '.join(settings.DATABASES)}."
        )
    return list(dict.fromkeys(aliases))


def purge_all(
    batch_size: int | None = None,
    max_seconds: float | None = None,
    dry_run: bool = False,
    databases: Iterable[str] | str | None = None,
) -> list[PurgeResult]:
    """Purge the four tables of each database within one time budget; one result per table.

    Right after the records, the flow runs whose record is already gone (deleted in raw SQL,
    or by a version whose purge kept the runs) are deleted too, in the same bounded batches
    (their result is labelled ``django_idempotency.FlowRun``): a run holds its request's body,
    which must not outlive its record, whether or not the completer is scheduled.
    ``databases`` lists the aliases to purge (default: ``IDEMPOTENCY["DATABASE"]`` alone).
    Each table of each database gets an equal share of what is left of ``max_seconds`` (a table
    that finishes early leaves its share to the next), so a backlog in one table cannot starve
    the others. Where ``ProcessedEvent`` is range-partitioned, partitions are also created ahead
    and expired ones dropped.
    """
    size = _batch_size(batch_size)
    budget = _max_seconds(max_seconds)
    aliases = purged_databases(databases)
    deadline = time.monotonic() + budget
    jobs: list[tuple[str, Any]] = [
        (alias, model.objects.using(alias))
        for alias in aliases
        for model in (IdempotencyRecord, FlowRun, ProcessedEvent, EventDelivery, OutboxEntry)
    ]
    results: list[PurgeResult] = []
    for position, (alias, queryset) in enumerate(jobs):
        share = 0.0
        if budget:
            # Never 0 (no limit) once the budget is spent: then each table runs one batch.
            share = max((deadline - time.monotonic()) / (len(jobs) - position), 1e-6)
        result = queryset.delete_expired(batch_size=size, max_seconds=share, dry_run=dry_run)
        if queryset.model is ProcessedEvent and partitioning.is_partitioned(alias):
            result = replace(result, partitions=partitioning.maintain(alias, dry_run=dry_run))
        results.append(replace(result, database=alias))
    return results
