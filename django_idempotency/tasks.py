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

from django_idempotency.conf import conf
from django_idempotency.extras import missing_extra
from django_idempotency.retention.purge import purge_all
from django_idempotency.retention.reports import PurgeResult

try:
    from celery import shared_task
except ImportError as error:
    raise missing_extra("celery", __name__) from error

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
    """Finish phased requests abandoned past their lease (see
    :mod:`django_idempotency.flows.completer`).

    Schedule it with beat every minute or so, as ``"django_idempotency.complete_flows"``.
    Returns one ``Completion.as_dict()`` per run handled.
    """
    from django_idempotency.flows.completer import (
        DEFAULT_LIMIT,
        DEFAULT_MAX_ATTEMPTS,
        complete_abandoned,
    )

    completions = complete_abandoned(
        limit=limit or DEFAULT_LIMIT, max_attempts=max_attempts or DEFAULT_MAX_ATTEMPTS
    )
    return [done.as_dict() for done in completions]


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
    from django_idempotency.outbox.relay import Relay

    return Relay(batch_size=batch_size).drain(max_seconds=max_seconds).as_dict()
