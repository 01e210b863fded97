"""``OutboxTask`` and ``OutboxTaskMixin`` (issue 36, item 2): converting a call is changing its
method name, ``delay_on_commit`` to ``delay_in_outbox``, ``apply_async_on_commit`` to
``apply_in_outbox``; each writes the row ``outbox.publish()`` writes. The guide's section runs in
``tests/test_docs_guides.py``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from django.db import transaction
from django.db.transaction import TransactionManagementError

from django_idempotency import IdempotentConsumer
from django_idempotency.models import OutboxEntry
from django_idempotency.outbox import OutboxTask, OutboxTaskMixin
from django_idempotency.outbox import core as outbox

pytestmark = pytest.mark.django_db


@pytest.fixture
def app() -> Iterator[Celery]:
    """An app whose every task is an ``OutboxTask``, as ``task_cls`` makes them."""
    app = Celery("outbox-task-test", set_as_current=False, task_cls=OutboxTask)
    yield app
    app.close()


def test_delay_in_outbox_takes_delay_on_commits_arguments(app: Celery) -> None:
    @app.task(name="shop.remind", shared=False)
    def remind(order_id: int, channel: str = "mail") -> None: ...

    assert isinstance(remind, OutboxTask)
    assert callable(remind.delay_on_commit)  # still Celery's Django task
    with transaction.atomic():
        event_id = remind.delay_in_outbox(7, channel="sms")
        with_outbox = outbox.publish(remind, (8,), {"channel": "sms"})

    by_delay, by_publish = OutboxEntry.objects.order_by("id")
    assert by_delay.event_id == event_id and by_publish.event_id == with_outbox
    assert (by_delay.destination, by_delay.payload) == (
        "shop.remind",
        {"args": [7], "kwargs": {"channel": "sms"}, "options": {}},
    )
    assert by_delay.payload["options"] == by_publish.payload["options"]


def test_apply_in_outbox_takes_apply_asyncs_arguments_and_the_outboxs(app: Celery) -> None:
    @app.task(name="shop.remind", shared=False)
    def remind(order_id: int) -> None: ...

    with transaction.atomic():
        remind.apply_in_outbox((7,), key="order-7", countdown=60, queue="reminders", priority=3)

    (row,) = OutboxEntry.objects.all()
    assert row.ordering_key == "order-7"
    assert row.payload == {
        "args": [7],
        "kwargs": {},
        "options": {"queue": "reminders", "priority": 3},
    }
    assert row.due_at is not None  # the countdown, started at the commit
    assert 59 <= (row.due_at - row.created_at).total_seconds() <= 65


def test_a_call_the_task_cannot_take_is_refused(app: Celery) -> None:
    @app.task(name="shop.remind", shared=False)
    def remind(order_id: int) -> None: ...

    with transaction.atomic(), pytest.raises(TypeError, match="signature"):
        remind.delay_in_outbox(1, 2)


@pytest.mark.django_db(transaction=True)
def test_outside_a_transaction_it_says_so(app: Celery) -> None:
    @app.task(name="shop.remind", shared=False)
    def remind(order_id: int) -> None: ...

    with pytest.raises(TransactionManagementError, match=r"transaction\.atomic"):
        remind.delay_in_outbox(1)


def test_the_mixin_goes_in_front_of_a_consumer_base(app: Celery) -> None:
    class OutboxConsumer(OutboxTaskMixin, IdempotentConsumer):
        pass

    @app.task(base=OutboxConsumer, bind=True, name="shop.consume", shared=False)
    def consume(self: Any, event_id: str) -> None: ...

    with transaction.atomic():
        event_id = consume.delay_in_outbox(event_id="evt-1")
    assert event_id == "evt-1"  # the call's own event id, as the consumer reads it
