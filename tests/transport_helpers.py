"""What the transport tests share: a Celery app for a broker, outbox messages for a queue, a
queue made and deleted per test, and a reader that takes what landed on a queue."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery import Celery
from django.utils import timezone
from kombu import Connection

from django_idempotency.events.core import new_event_id
from django_idempotency.outbox.transports import OutboxMessage
from tests.workers import delete_queue, new_queue_name


@contextmanager
def fresh_queue(broker_url: str, prefix: str) -> Iterator[str]:
    """A queue name of its own, deleted from the broker afterwards."""
    name = new_queue_name(prefix)
    yield name
    delete_queue(broker_url, name)


def celery_app(broker_url: str) -> Celery:
    app = Celery("transport-test", broker=broker_url, set_as_current=False)
    app.conf.task_create_missing_queues = True
    return app


def message(
    queue: str, n: int, key: str | None = None, payload: Any = None, **options: Any
) -> OutboxMessage:
    """Message ``n`` for ``shop.effect`` on ``queue`` (``options`` join the queue's), or with
    ``payload`` as given."""
    return OutboxMessage(
        id=n,
        event_id=str(new_event_id()),
        destination="shop.effect",
        payload=payload
        if payload is not None
        else {"args": [], "kwargs": {"n": n}, "options": {"queue": queue, **options}},
        headers={"tenant": "acme"},
        ordering_key=key,
        created_at=timezone.now(),
        attempts=1,
    )


def take(broker_url: str, queue: str, timeout: float) -> Any:
    """Take (and ack) the next message on ``queue``, waiting up to ``timeout`` seconds for it;
    its body decoded as a worker accepting JSON, pickle and YAML decodes it."""
    with Connection(broker_url) as connection:
        simple = connection.SimpleQueue(queue, accept=["json", "pickle", "yaml"])
        try:
            item = simple.get(timeout=timeout)
            item.ack()
            return item
        finally:
            simple.close()


def drain(broker_url: str, queue: str, expected: int) -> list[Any]:
    """Take (and ack) ``expected`` messages from ``queue``, waiting up to 10 s for each."""
    received: list[Any] = []
    with Connection(broker_url) as connection:
        simple = connection.SimpleQueue(queue)
        for _ in range(expected):
            item = simple.get(timeout=10)
            item.ack()
            received.append(item)
        simple.close()
    return received
