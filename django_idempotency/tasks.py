"""Celery tasks of django-idempotency.

``purge_expired`` is a ``shared_task``, so it binds to whatever Celery app the project runs (the
app's ``autodiscover_tasks()`` finds this module in ``INSTALLED_APPS``). Schedule it with Celery
beat under its registered name::

    CELERY_BEAT_SCHEDULE = {
        "idempotency-purge": {
            "task": "django_idempotency.purge_expired",
            "schedule": timedelta(minutes=15),
        },
    }
"""

from __future__ import annotations

from typing import Any

from celery import shared_task

from django_idempotency.conf import conf
from django_idempotency.purge import purge_all
from django_idempotency.reports import PurgeResult

PURGE_TASK_NAME = "django_idempotency.purge_expired"


@shared_task(name=PURGE_TASK_NAME)
def purge_expired(
    batch_size: int | None = None,
    max_seconds: float | None = None,
    databases: list[str] | None = None,
) -> dict[str, dict[str, Any]]:
    """Delete expired records, processed events and delivery counters in bounded batches.

    Arguments default to ``IDEMPOTENCY["PURGE_BATCH_SIZE"]`` and ``["PURGE_MAX_SECONDS"]``;
    ``databases`` lists the aliases to purge (default ``IDEMPOTENCY["DATABASE"]``): list every
    alias that consumers write to with ``using=`` or a task's ``database`` option. Returns
    ``{model label: {"deleted": ..., "batches": ..., "finished": ...}}``, the label prefixed
    with ``"<alias>:"`` for an alias other than ``DATABASE``; a table that is not ``finished``
    ran out of time and is continued by the next run. On a partitioned ``ProcessedEvent`` table
    it also creates partitions ahead and drops expired ones.
    """
    return {
        _key(result): result.as_dict()
        for result in purge_all(
            batch_size=batch_size, max_seconds=max_seconds, databases=databases
        )
    }


def _key(result: PurgeResult) -> str:
    if result.database in (None, conf.DATABASE):
        return result.label
    return f"{result.database}:{result.label}"


COMPLETE_FLOWS_TASK_NAME = "django_idempotency.complete_flows"


@shared_task(name=COMPLETE_FLOWS_TASK_NAME)
def complete_flows(
    limit: int | None = None, max_attempts: int | None = None
) -> list[dict[str, Any]]:
    """Finish phased requests abandoned past their lease (see :mod:`django_idempotency.completer`).

    Schedule it with beat every minute or so, as ``"django_idempotency.complete_flows"``.
    Returns one ``Completion.as_dict()`` per run handled.
    """
    from django_idempotency.completer import (
        DEFAULT_LIMIT,
        DEFAULT_MAX_ATTEMPTS,
        complete_abandoned,
    )

    completions = complete_abandoned(
        limit=limit or DEFAULT_LIMIT, max_attempts=max_attempts or DEFAULT_MAX_ATTEMPTS
    )
    return [done.as_dict() for done in completions]
