"""The test project's Django tasks (``django.tasks``; the django-tasks backport on Django 5.2).

* :data:`apply_order_confirmed` is the demo's ledger task: one
  :class:`~testproject.shop.models.LedgerEntry` per ``OrderConfirmed`` event id, enqueued by
  ``POST /api/task-orders/`` (:mod:`testproject.shop.views_tasks`).
* :func:`requeue_stalled` is the recovery recipe of ``docs/django-tasks.md`` for django-tasks-db,
  whose worker never runs a task again once it died in the middle of it.
* The other tasks exist for the tests (``tests/test_django_tasks*.py``): each writes one
  :class:`~testproject.shop.models.Effect` per run of its body, named after its consumer, with the
  event id as payload. The blocking and killing ones run only in a ``db_worker`` (the ``database``
  backend), never in a test process or a web server.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.db import transaction
from django.utils import timezone

from django_idempotency.events.django_tasks import idempotent_task
from testproject.shop.models import Effect, LedgerEntry

try:
    from django.tasks.base import Task, TaskContext, TaskResultStatus, task  # Django 6.0+
except ImportError:  # Django 5.2 with the django-tasks backport
    from django_tasks.base import Task, TaskContext, TaskResultStatus, task

WORKER_BACKEND = "database"
"""The TASKS alias that ``db_worker --backend database`` runs (see testproject/settings.py)."""
BLOCK_TIMEOUT = 120.0


# --8<-- [start:task]
@task()
@idempotent_task("billing.ledger-tasks")
def apply_order_confirmed(event_id: str, order_id: int, amount_cents: int) -> int:
    """Apply an ``OrderConfirmed`` event to the ledger, once per event id."""
    entry = LedgerEntry.objects.create(
        order_id=order_id, event_id=event_id, amount_cents=amount_cents
    )
    return entry.pk


# --8<-- [end:task]


# --8<-- [start:requeue]
def requeue_stalled(tasks: Iterable[Task[Any, Any]], older_than: timedelta) -> int:
    """Hand back to django-tasks-db the runs of ``tasks`` whose worker died; return how many.

    A ``db_worker`` killed in the middle of a task leaves its row ``RUNNING``, and no worker runs
    it again. These tasks are idempotent, so a second run is safe even if the first one committed
    or is still going (the second waits on the event's reservation, then skips).
    """
    from django_tasks_db.models import DBTaskResult

    return (
        DBTaskResult.objects.running()
        .filter(
            task_path__in=[t.module_path for t in tasks],
            started_at__lt=timezone.now() - older_than,
        )
        .update(status=TaskResultStatus.READY)
    )


# --8<-- [end:requeue]


# --- Tasks for the tests ------------------------------------------------------------------------


@task()
@idempotent_task("shop.tasks.effect")
def effect(event_id: Any = None, sleep: float = 0.0) -> str:
    """Write one Effect; ``sleep`` holds the transaction open, so duplicates contend."""
    Effect.objects.create(name="shop.tasks.effect", payload=str(event_id))
    if sleep:
        time.sleep(sleep)
    return "applied"


@task(takes_context=True)
@idempotent_task("shop.tasks.gated")
def gated(context: TaskContext, event_id: str, gate: str, point: str) -> str:
    """Write an Effect; on the first run, block (for the test to SIGKILL the worker) at ``point``.

    ``point`` is ``"before_commit"`` (inside the transaction, after the write) or
    ``"after_commit"`` (after the transaction committed, before the worker records the result).
    The test waits for ``<gate>/blocked`` to appear.
    """
    _only_in_a_worker(context)
    Effect.objects.create(name="shop.tasks.gated", payload=event_id)
    if _first_run(Path(gate)):
        if point == "before_commit":
            _block(Path(gate))
        elif point == "after_commit":
            transaction.on_commit(lambda: _block(Path(gate)))
        else:
            raise ValueError(f"point must be before_commit or after_commit, not {point!r}")
    return "applied"


@task(takes_context=True)
@idempotent_task("shop.tasks.poison", max_deliveries=2)
def poison(context: TaskContext, event_id: str) -> str:
    """Kill the worker process every time: parked after 2 runs."""
    _only_in_a_worker(context)
    Effect.objects.create(name="shop.tasks.poison", payload=event_id)
    os.kill(os.getpid(), signal.SIGKILL)
    return "unreachable"


def _only_in_a_worker(context: TaskContext) -> None:
    if context.task_result.backend != WORKER_BACKEND:
        raise RuntimeError(
            "This task blocks or kills its process; it runs only in a db_worker, not on the "
            f"{context.task_result.backend!r} backend."
        )


def _first_run(gate: Path) -> bool:
    try:
        (gate / "entered").touch(exist_ok=False)
    except FileExistsError:
        return False
    return True


def _block(gate: Path) -> None:
    (gate / "blocked").touch()
    deadline = time.monotonic() + BLOCK_TIMEOUT
    while time.monotonic() < deadline:
        time.sleep(0.05)
    raise TimeoutError(f"the worker was not killed within {BLOCK_TIMEOUT}s")
