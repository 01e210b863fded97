"""``@idempotent_task`` under ``@task``, run by the ImmediateBackend, on every database.

The ImmediateBackend runs a task when it is enqueued, in this process, and records the outcome
in the returned TaskResult (a failure is ``FAILED`` with the exception's class path, never
raised). The same tasks against a real ``db_worker``, SIGKILLed, are in
``tests/test_django_tasks_worker.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from importlib.util import find_spec
from typing import Any

import pytest
from django.conf import settings
from django.db import transaction
from django.test import Client

from django_idempotency import idempotent_task
from django_idempotency.conf import conf
from django_idempotency.events.core import count_delivery
from django_idempotency.models import EventDelivery, ProcessedEvent
from testproject.shop.models import Effect, LedgerEntry, Order
from tests.workers import REPO

if not settings.TASKS_MODULE:
    pytest.skip(
        "no tasks framework: Django 6.0+ has django.tasks; on Django 5.2 pip install django-tasks",
        allow_module_level=True,
    )

from testproject.shop.tasks_django import (
    WORKER_BACKEND,
    TaskContext,
    TaskResultStatus,
    apply_order_confirmed,
    effect,
    task,
)

pytestmark = pytest.mark.django_db(transaction=True)


@task(takes_context=True)
@idempotent_task("tests.with-context", event_id_arg="ref")
def with_context(context: TaskContext, amount: int, ref: str | int | None = None) -> int:
    Effect.objects.create(name="tests.with-context", payload=str(ref))
    return context.attempt


class Boom(Exception):
    pass


@task()
@idempotent_task("tests.failing")
def failing(event_id: str, fail: bool) -> str:
    Effect.objects.create(name="tests.failing", payload=event_id)
    if fail:
        raise Boom(f"run of {event_id} fails")
    return "applied"


def effects(name: str, event_id: object) -> int:
    return Effect.objects.filter(name=name, payload=str(event_id)).count()


def failure(result: Any) -> str:
    assert result.status == TaskResultStatus.FAILED
    return str(result.errors[0].exception_class_path)


def test_same_event_enqueued_twice_runs_once() -> None:
    first = effect.enqueue(event_id="evt-1")
    second = effect.enqueue(event_id="evt-1")

    assert first.status == second.status == TaskResultStatus.SUCCESSFUL
    assert (first.return_value, second.return_value) == ("applied", None)
    assert effects("shop.tasks.effect", "evt-1") == 1
    assert ProcessedEvent.objects.get(consumer="shop.tasks.effect").event_id == "evt-1"
    # The duplicate was answered by the count's read of the processed event, and not counted.
    assert EventDelivery.objects.get(consumer="shop.tasks.effect").deliveries == 1


def test_positional_and_keyword_event_ids_are_one_event() -> None:
    assert effect.enqueue("evt-1").return_value == "applied"
    assert effect.enqueue(event_id="evt-1", sleep=0.0).return_value is None
    assert effect.enqueue("evt-2", 0.0).return_value == "applied"
    assert effects("shop.tasks.effect", "evt-1") == 1


def test_an_int_event_id_is_its_decimal_string() -> None:
    assert effect.enqueue(42).return_value == "applied"
    assert effect.enqueue("42").return_value is None
    assert ProcessedEvent.objects.get().event_id == "42"


def test_a_uuid_event_id_called_directly_is_its_string() -> None:
    event_id = uuid.uuid4()
    assert effect.call(event_id) == "applied"
    assert effect.enqueue(str(event_id)).return_value is None


def test_the_event_id_parameter_can_be_named_and_follows_the_context() -> None:
    assert with_context.enqueue(100, "ref-1").return_value == 1
    assert with_context.enqueue(amount=100, ref="ref-1").return_value is None
    assert effects("tests.with-context", "ref-1") == 1


@pytest.mark.parametrize(
    ("args", "kwargs"), [((), {}), ((None,), {}), ((), {"event_id": None, "sleep": 0.0})]
)
def test_no_event_id_fails_the_task_and_counts_nothing(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    result = effect.enqueue(*args, **kwargs)

    assert failure(result) == "django_idempotency.exceptions.MissingEventId"
    assert "without an event id" in result.errors[0].traceback
    assert not Effect.objects.exists()
    assert not EventDelivery.objects.exists()


INVALID = "django_idempotency.exceptions.InvalidEventId"


@pytest.mark.parametrize(
    ("event_id", "error", "message"),
    [
        (True, INVALID, "must be a str, an int or a uuid.UUID, not bool"),
        (1.5, INVALID, "must be a str, an int or a uuid.UUID, not float"),
        ({"id": 1}, INVALID, "must be a str, an int or a uuid.UUID, not dict"),
        ("", INVALID, "The event id is empty"),
        ("x" * 256, INVALID, "the most is 255"),
        # The driver refused these inside the task (UnicodeEncodeError, or a DataError on
        # PostgreSQL), after the run had started; now a clear error before the database.
        ("\ud800abc", INVALID, "lone surrogate"),
        ("evt\x00", INVALID, "NUL character"),
    ],
)
def test_an_invalid_event_id_fails_the_task_and_counts_nothing(
    event_id: object, error: str, message: str
) -> None:
    result = effect.enqueue(event_id)

    assert failure(result) == error
    assert message in result.errors[0].traceback
    assert not Effect.objects.exists()
    assert not EventDelivery.objects.exists()


def test_arguments_that_do_not_fit_fail_with_the_task_name() -> None:
    result = failing.enqueue("evt-1")

    assert failure(result) == "builtins.TypeError"
    assert "Task failing was enqueued with arguments that do not fit" in result.errors[0].traceback


def test_a_failed_run_rolls_back_its_effect_and_reservation_and_runs_again() -> None:
    result = failing.enqueue("evt-1", fail=True)

    assert failure(result) == "tests.test_django_tasks.Boom"
    assert not Effect.objects.exists()
    assert not ProcessedEvent.objects.exists()
    delivery = EventDelivery.objects.get(consumer="tests.failing")
    assert "Boom: run of evt-1 fails" in delivery.last_error

    assert failing.enqueue("evt-1", fail=False).return_value == "applied"
    assert effects("tests.failing", "evt-1") == 1
    assert EventDelivery.objects.get(consumer="tests.failing").deliveries == 2


def test_an_event_over_its_delivery_limit_is_parked() -> None:
    # Two runs that died with their worker left only their counts behind.
    for _ in range(conf.MAX_DELIVERIES):
        count_delivery("evt-1", "shop.tasks.effect")

    result = effect.enqueue("evt-1")

    assert failure(result) == "django_idempotency.exceptions.EventParked"
    assert not Effect.objects.exists()
    assert EventDelivery.objects.get(consumer="shop.tasks.effect").parked_at is not None
    assert failure(effect.enqueue("evt-1")) == "django_idempotency.exceptions.EventParked"


def test_enqueued_on_commit_inside_a_transaction_applies_after_commit() -> None:
    with transaction.atomic():
        transaction.on_commit(lambda: effect.enqueue("evt-1"))
        assert not Effect.objects.exists()
    assert effects("shop.tasks.effect", "evt-1") == 1


@pytest.mark.skipif(not find_spec("django_tasks_db"), reason="needs django-tasks-db")
def test_a_database_backend_enqueue_commits_or_rolls_back_with_the_transaction() -> None:
    from django_tasks_db.models import DBTaskResult

    with pytest.raises(Boom), transaction.atomic():
        effect.using(backend=WORKER_BACKEND).enqueue("evt-1")
        raise Boom("the order rolls back")
    assert not DBTaskResult.objects.exists()

    with transaction.atomic():
        result = effect.using(backend=WORKER_BACKEND).enqueue("evt-1")
    assert DBTaskResult.objects.get().id == uuid.UUID(result.id)
    assert result.status == TaskResultStatus.READY  # it waits for a db_worker


def test_wrong_decoration_is_refused_at_import() -> None:
    with pytest.raises(TypeError, match="has no parameter 'event_id'"):

        @idempotent_task("tests.no-id")
        def no_id(order_id: int) -> None: ...

    with pytest.raises(TypeError, match="has no parameter 'event_id'"):

        @idempotent_task("tests.kwargs")
        def only_kwargs(**event_id: Any) -> None: ...

    with pytest.raises(TypeError, match="Put it under @task"):
        idempotent_task("tests.stacked")(effect)  # type: ignore[arg-type]

    with pytest.raises(TypeError, match="coroutine function"):

        @idempotent_task("tests.async")
        async def asynchronous(event_id: str) -> None: ...

    with pytest.raises(ValueError, match="consumer name is empty"):

        @idempotent_task(" ")
        def unnamed(event_id: str) -> None: ...


def test_the_task_keeps_its_name_and_module_path() -> None:
    assert effect.name == "effect"
    assert effect.module_path == "testproject.shop.tasks_django.effect"


def test_the_double_protection_recipe(client: Client) -> None:
    def post(key: str) -> Any:
        return client.post(
            "/api/task-orders/",
            json.dumps({"reference": "A-1", "amount_cents": 1250}),
            content_type="application/json",
            headers={"Idempotency-Key": f'"{key}"'},
        )

    first = post("key-1")
    assert first.status_code == 201, first.content
    event_id = first.json()["event_id"]
    assert post("key-1").json() == first.json()  # a retry is a replay: no second enqueue
    assert Order.objects.count() == 1
    entry = LedgerEntry.objects.get()
    assert (entry.event_id, entry.amount_cents) == (event_id, 1250)

    order_id = first.json()["order_id"]
    again = apply_order_confirmed.enqueue(event_id, order_id, 1250)  # a duplicate enqueue
    assert again.return_value is None
    assert LedgerEntry.objects.count() == 1


def test_the_recipe_view_answers_bad_input_with_a_problem(client: Client) -> None:
    response = client.post(
        "/api/task-orders/",
        "{not json",
        content_type="application/json",
        headers={"Idempotency-Key": '"key-2"'},
    )
    assert response.status_code == 400
    assert response["Content-Type"] == "application/problem+json"
    assert not Order.objects.exists()


WITHOUT_A_TASKS_FRAMEWORK = """
import sys
sys.modules["django.tasks"] = sys.modules["django_tasks"] = sys.modules["django_tasks_db"] = None
import django
django.setup()
from django.conf import settings
from django.urls import resolve
from django_idempotency import idempotent_task

@idempotent_task("tests.no-framework")
def handler(event_id: str) -> None: ...

resolve("/api/orders/")
print(repr(settings.TASKS_MODULE), [app for app in settings.INSTALLED_APPS if "task" in app])
"""


def test_the_adapter_and_the_test_project_load_without_a_tasks_framework() -> None:
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_A_TASKS_FRAMEWORK],
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "testproject.settings"},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "'' []"
