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

from django_idempotency.managers import purge_all

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


# --- The outbox relay, for sites without a long-running relay process ---------------------------

RELAY_TASK_NAME = "django_idempotency.relay_outbox"


@shared_task(name=RELAY_TASK_NAME, ignore_result=True)
def relay_outbox(max_seconds: float = 50.0, batch_size: int = 500) -> dict[str, int]:
    """Send the outbox messages that are due, for at most ``max_seconds``.

    The alternative to ``manage.py idempotency_relay`` for small sites: schedule it with Celery
    beat more often than ``max_seconds`` (every minute for the default), so runs rarely overlap;
    when they do, they share the work as several relays do. Latency is up to the schedule's
    period. Returns the totals (claimed, sent, failed, parked, released, batches).
    """
    from django_idempotency.relay import Relay

    return Relay(batch_size=batch_size).drain(max_seconds=max_seconds).as_dict()
