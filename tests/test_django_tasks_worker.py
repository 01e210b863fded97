"""Proofs against real django-tasks-db workers on PostgreSQL, with real SIGKILLs.

Each test enqueues ``@idempotent_task`` tasks of the test project on the ``database`` backend,
runs them in ``manage.py db_worker`` subprocesses, kills those with SIGKILL at the named points,
and counts effects only once every enqueued run has finished.

django-tasks-db never runs a task again once its worker died in the middle of it: the row stays
``RUNNING``. The tests hand such runs back with the recovery recipe of ``docs/django-tasks.md``
(:func:`testproject.shop.tasks_django.requeue_stalled`), and also enqueue the same event again,
as a producer that saw no result would. Either way the effect applies once.

Run it on Django 6.x (``django.tasks``) and on Django 5.2 with the django-tasks backport.
"""

from __future__ import annotations

import signal
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import connection

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

from testproject.shop.tasks_django import (
    WORKER_BACKEND,
    TaskResultStatus,
    effect,
    gated,
    poison,
    requeue_stalled,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.postgres,
    pytest.mark.timeout(600),  # above the sum of its guards against a hang
    pytest.mark.django_db(transaction=True),
]

StartWorker = Callable[[str], DbWorker]


@pytest.fixture
def start(transactional_db: None, tmp_path: Path) -> Iterator[StartWorker]:
    """Start ``db_worker`` processes on the test database; every one is stopped afterwards."""
    started: list[DbWorker] = []
    db_url = database_url(connection.settings_dict)

    def start_worker(name: str) -> DbWorker:
        worker = start_db_worker(db_url=db_url, log_dir=tmp_path, name=name)
        started.append(worker)
        return worker

    yield start_worker
    for worker in started:
        worker.stop()


def finish(results: list[Any], workers: list[DbWorker]) -> list[Any]:
    """Wait until every result has finished, then return their return values (None if FAILED)."""

    def all_finished() -> bool:
        for result in results:
            result.refresh()
        return all(result.is_finished for result in results)

    wait_until(all_finished, "every task run finished", workers)
    return [r.return_value if r.status == TaskResultStatus.SUCCESSFUL else None for r in results]


def effects(consumer: str, event_id: str) -> int:
    return Effect.objects.filter(name=consumer, payload=event_id).count()


def deliveries(consumer: str, event_id: str) -> EventDelivery:
    return EventDelivery.objects.get(consumer=consumer, event_id=event_id)


def waiting_on_a_lock() -> bool:
    """True while another session of the test database waits for a row lock."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        (count,) = cursor.fetchone()
    return bool(count)


def test_the_same_event_enqueued_six_times_on_two_workers_applies_once(
    start: StartWorker,
) -> None:
    workers = [start("dup-1"), start("dup-2")]
    event_id = str(new_event_id())
    results = [effect.using(backend=WORKER_BACKEND).enqueue(event_id, sleep=0.3) for _ in range(6)]

    outcomes = finish(results, workers)

    assert Counter(outcomes) == {"applied": 1, None: 5}
    assert all(r.status == TaskResultStatus.SUCCESSFUL for r in results)
    assert effects("shop.tasks.effect", event_id) == 1
    assert ProcessedEvent.objects.filter(event_id=event_id).count() == 1
    delivery = deliveries("shop.tasks.effect", event_id)
    # Runs counted while the first was in flight; a run after its commit is not counted.
    assert 1 <= delivery.deliveries <= 6
    assert delivery.parked_at is None
    assert {r.worker_ids[0] for r in results} == {"dup-1", "dup-2"}, "both workers took runs"


def test_worker_killed_mid_task_rolls_back_and_the_waiting_duplicate_applies_once(
    start: StartWorker, tmp_path: Path
) -> None:
    workers = [start("mid-1"), start("mid-2")]
    gate = tmp_path / "gate"
    gate.mkdir()
    event_id = str(new_event_id())
    run = gated.using(backend=WORKER_BACKEND)

    first = run.enqueue(event_id, str(gate), "before_commit")
    wait_until((gate / "blocked").exists, "the first run blocks after its write", workers)
    first.refresh()
    holder = next(w for w in workers if w.name == first.worker_ids[0])
    other = next(w for w in workers if w is not holder)
    assert effects("shop.tasks.gated", event_id) == 0  # written, not committed

    # The duplicate goes to the other worker and waits on the first run's reservation.
    duplicate = run.enqueue(event_id, str(gate), "before_commit")
    wait_until(waiting_on_a_lock, "the duplicate waits on the reservation", workers)

    assert holder.kill() == -signal.SIGKILL
    assert finish([duplicate], [other]) == ["applied"]
    assert duplicate.worker_ids == [other.name]
    assert effects("shop.tasks.gated", event_id) == 1

    # The killed run is stuck RUNNING; handed back, it runs again and is a duplicate.
    first.refresh()
    assert first.status == TaskResultStatus.RUNNING
    assert requeue_stalled([gated], older_than=timedelta(0)) == 1
    assert finish([first], [other]) == [None]
    assert first.status == TaskResultStatus.SUCCESSFUL
    assert first.worker_ids == [holder.name, other.name]
    assert effects("shop.tasks.gated", event_id) == 1
    # The killed run and the duplicate were counted; the hand-back found the event processed.
    assert deliveries("shop.tasks.gated", event_id).deliveries == 2
    assert "duplicate ignored" in other.output()


def test_worker_killed_after_commit_before_the_result_is_recorded_runs_no_second_effect(
    start: StartWorker, tmp_path: Path
) -> None:
    worker = start("after-1")
    gate = tmp_path / "gate"
    gate.mkdir()
    event_id = str(new_event_id())
    run = gated.using(backend=WORKER_BACKEND)

    first = run.enqueue(event_id, str(gate), "after_commit")
    wait_until((gate / "blocked").exists, "the first run blocks after its commit", [worker])
    assert effects("shop.tasks.gated", event_id) == 1  # committed with its reservation
    assert worker.kill() == -signal.SIGKILL
    first.refresh()
    assert first.status == TaskResultStatus.RUNNING  # the worker never recorded the result

    # Handed back before another run exists: with older_than=0, a duplicate that a live worker
    # had already taken (RUNNING a moment) would be handed back too (CI saw 2 for 1).
    assert requeue_stalled([gated], older_than=timedelta(0)) == 1
    successor = start("after-2")
    duplicate = run.enqueue(event_id, str(gate), "after_commit")

    assert finish([first, duplicate], [successor]) == [None, None]
    assert effects("shop.tasks.gated", event_id) == 1
    assert ProcessedEvent.objects.filter(event_id=event_id).count() == 1
    assert deliveries("shop.tasks.gated", event_id).deliveries == 1  # both duplicates uncounted


def test_a_task_that_kills_its_worker_every_time_is_parked(start: StartWorker) -> None:
    event_id = str(new_event_id())
    result = poison.using(backend=WORKER_BACKEND).enqueue(event_id)

    for run in (1, 2):  # max_deliveries=2: each run kills its worker, and is handed back
        worker = start(f"poison-{run}")
        assert worker.wait_exit() == -signal.SIGKILL
        assert requeue_stalled([poison], older_than=timedelta(0)) == 1

    survivor = start("poison-3")
    assert finish([result], [survivor]) == [None]
    assert result.status == TaskResultStatus.FAILED
    assert result.errors[0].exception_class_path == "django_idempotency.exceptions.EventParked"
    delivery = deliveries("shop.tasks.poison", event_id)
    assert delivery.deliveries == 3
    assert delivery.parked_at is not None
    assert effects("shop.tasks.poison", event_id) == 0
    assert "EVENT PARKED" in survivor.output()

    # The worker goes on with the next task.
    healthy = str(new_event_id())
    assert finish([effect.using(backend=WORKER_BACKEND).enqueue(healthy)], [survivor]) == [
        "applied"
    ]
    assert survivor.alive()
