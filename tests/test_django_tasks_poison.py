"""Poison tasks against real django-tasks-db workers on PostgreSQL: the loop goes on.

Between two healthy tasks, one parametrised proof enqueues a task that raises on every run, one
that ends its worker (``os._exit``), a huge one, a nested one, one whose event id cannot be
stored, and ones with a lone surrogate or a NUL in the id. Each healthy task is applied once;
each poison task ends parked (after at most ``max_deliveries`` runs of its body) or failed with
a clear error, never applied, and the worker that comes last is still running.

What differs from Celery (tests/test_consumer_poison.py): django-tasks-db never runs a task
again by itself. A task that raises is FAILED; the producer's next enqueue of the same event is
the next delivery (here three enqueues, the third parked). A run whose worker died stays
``RUNNING`` until the recovery recipe of docs/django-tasks.md hands it back. There is no time
limit, so nothing can hang "past" one. A lone surrogate or a NUL never reaches the worker on
PostgreSQL: the enqueue itself is refused (``jsonb`` takes neither).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import DatabaseError, connection, transaction

from django_idempotency import new_event_id
from django_idempotency.models import EventDelivery, ProcessedEvent
from testproject.shop.models import Effect
from tests.db_workers import DbWorker, start_db_worker, wait_until
from tests.workers import database_url

if not (settings.TASKS_MODULE and find_spec("django_tasks_db")):
    pytest.skip(
        "needs a tasks framework (Django 6.0+, or django-tasks on 5.2) and django-tasks-db",
        allow_module_level=True,
    )

from testproject.shop.tasks_django import WORKER_BACKEND, TaskResultStatus, requeue_stalled
from tests.poison_tasks_django import apply, exits, raises

pytestmark = [
    pytest.mark.slow,
    pytest.mark.postgres,
    pytest.mark.timeout(600),  # above the sum of its guards against a hang
    pytest.mark.django_db(transaction=True),
]

MAX_DELIVERIES = 2


@pytest.fixture
def workers(transactional_db: None, tmp_path: Path) -> Iterator[Callable[[], DbWorker]]:
    started: list[DbWorker] = []
    db_url = database_url(connection.settings_dict)

    def start() -> DbWorker:
        worker = start_db_worker(db_url=db_url, log_dir=tmp_path, name=f"w{len(started)}")
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


def enqueue(task: Any, *args: Any, **kwargs: Any) -> Any:
    return task.using(backend=WORKER_BACKEND).enqueue(*args, **kwargs)


def nested(depth: int) -> Any:
    value: Any = "bottom"
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "kind", ["raises", "exits", "huge", "nested", "over-length-id", "surrogate-id", "nul-id"]
)
def test_a_poison_task_is_parked_or_failed_and_the_healthy_ones_apply_once(
    workers: Callable[[], DbWorker], kind: str
) -> None:
    event_id = str(new_event_id())
    healthy = [str(new_event_id()) for _ in range(2)]
    results = [enqueue(apply, healthy[0])]
    expect_parked = kind in ("raises", "exits")
    if kind == "raises":
        # django-tasks never retries: the producer's enqueues are the deliveries.
        results += [enqueue(raises, event_id) for _ in range(MAX_DELIVERIES + 1)]
    elif kind == "exits":
        results.append(enqueue(exits, event_id))
    elif kind == "huge":
        results.append(enqueue(apply, event_id, payload=["y" * 1000] * 4000))
    elif kind == "nested":
        results.append(enqueue(apply, event_id, payload=nested(100)))
    elif kind == "over-length-id":
        results.append(enqueue(apply, "x" * 300))
    else:
        bad = event_id + ("\ud800" if kind == "surrogate-id" else "\x00")
        with pytest.raises((DatabaseError, UnicodeError)), transaction.atomic():
            enqueue(apply, bad)  # refused by PostgreSQL's jsonb: it never reaches a worker
    results.append(enqueue(apply, healthy[1]))

    started = [workers()]

    def finished_or_dead() -> bool:
        for result in results:
            result.refresh()
        return all(r.is_finished for r in results) or not started[-1].alive()

    for _ in range(MAX_DELIVERIES + 2):
        wait_until(finished_or_dead, "every task finished, or the worker died", started)
        if all(r.is_finished for r in results):
            break
        # The worker died mid-task (exits): hand the run back, as docs/django-tasks.md says.
        assert requeue_stalled([exits], older_than=timedelta(0)) == 1
        started.append(workers())
    assert all(r.is_finished for r in results), [r.status for r in results]

    for event in healthy:
        assert Effect.objects.filter(name="events.tasks.apply", payload=event).count() == 1
    last = results[-2]  # the poison's last run
    if expect_parked:
        consumer = f"events.tasks.{kind}"
        delivery = EventDelivery.objects.get(consumer=consumer, event_id=event_id)
        assert delivery.parked_at is not None
        assert delivery.deliveries == MAX_DELIVERIES + 1  # the body ran twice, no more
        assert last.status == TaskResultStatus.FAILED
        assert last.errors[-1].exception_class_path.endswith("EventParked")
        assert not ProcessedEvent.objects.filter(consumer=consumer).exists()
        assert not Effect.objects.filter(name=consumer).exists()
    elif kind in ("huge", "nested"):
        assert last.status == TaskResultStatus.SUCCESSFUL
        assert ProcessedEvent.objects.filter(event_id=event_id).count() == 1
    elif kind == "over-length-id":
        assert last.status == TaskResultStatus.FAILED
        assert last.errors[-1].exception_class_path.endswith("InvalidEventId")
        assert "the most is 255" in last.errors[-1].traceback
        assert not EventDelivery.objects.filter(event_id__startswith="xxx").exists()
    assert started[-1].alive()  # the loop went on
