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

from django_idempotency.extras import missing_extra
from django_idempotency.managers import purge_all

try:
    from celery import shared_task
except ImportError as error:
    raise missing_extra("celery", __name__) from error

PURGE_TASK_NAME = "django_idempotency.purge_expired"


@shared_task(name=PURGE_TASK_NAME)
def purge_expired(
    batch_size: int | None = None, max_seconds: float | None = None
) -> dict[str, dict[str, Any]]:
    """Delete expired records, processed events and delivery counters in bounded batches.

    Arguments default to ``IDEMPOTENCY["PURGE_BATCH_SIZE"]`` and ``["PURGE_MAX_SECONDS"]``.
    Returns ``{model label: {"deleted": ..., "batches": ..., "finished": ...}}``; a table that
    is not ``finished`` ran out of time and is continued by the next run. On a partitioned
    ``ProcessedEvent`` table it also creates partitions ahead and drops expired ones.
    """
    return {
        result.label: result.as_dict()
        for result in purge_all(batch_size=batch_size, max_seconds=max_seconds)
    }
