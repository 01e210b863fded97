"""Review 2: ``CeleryTransport``'s confirm bookkeeping against a real RabbitMQ.

With ``task_send_sent_event`` (what Flower asks for), ``send_task_message`` publishes a second
message, the ``task-sent`` event, on the same producer and so on the same confirm channel. Every
publish takes a delivery tag, so the transport must not count one tag per outbox message: it
would take the event's ack for the next message's confirm, and report sent a message RabbitMQ
refused.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from amqp.exceptions import MessageNacked
from django.utils import timezone
from kombu import Connection, Queue

from django_idempotency.outbox.transports import CeleryTransport
from tests.conftest import require_service
from tests.services import BROKER_URLS
from tests.test_transport_batches import celery_app, message
from tests.workers import new_queue_name

pytestmark = pytest.mark.broker


def test_a_nack_is_not_taken_for_the_ack_of_a_task_sent_event() -> None:
    require_service("rabbitmq")
    url = BROKER_URLS["rabbitmq"]
    name = new_queue_name("rv2-sent-event")
    app = celery_app(url)
    app.conf.task_send_sent_event = True
    # The queue holds one message; RabbitMQ nacks the publishes beyond it.
    limited = Queue(
        name, routing_key=name, queue_arguments={"x-max-length": 1, "x-overflow": "reject-publish"}
    )
    app.conf.task_queues = [limited]
    transport = CeleryTransport(app=app)
    try:
        first = transport.send([message(name, 0, key="a"), message(name, 1, key="b")])
        # The channel is reused: a later call must not take stale answers for its own.
        second = transport.send([message(name, 2, key="c")])
        transport.close()
        with Connection(url) as conn:
            bound = limited.bind(conn.default_channel)
            received = [bound.get(no_ack=True) for _ in range(2)]
    finally:
        with Connection(url) as conn:
            conn.default_channel.queue_delete(name)

    assert first[0] is None
    assert isinstance(first[1], MessageNacked), first  # refused: must not be reported sent
    assert isinstance(second[0], MessageNacked), second
    assert received[0] is not None and received[0].payload[1]["n"] == 0
    assert received[1] is None


def test_an_iso_expires_is_sent_as_send_task_sends_it(broker_url: str) -> None:
    """``publish(task, expires="2026-...T...+00:00")``: the one ``expires`` JSON can hold as a
    moment (a datetime cannot be stored), which ``send_task`` accepts."""
    from tests.test_transport_batches import drain
    from tests.workers import delete_queue

    name = new_queue_name("rv2-expires")
    at = (timezone.now() + timedelta(hours=1)).isoformat()
    app = celery_app(broker_url)
    transport = CeleryTransport(app=app)
    try:
        results = transport.send([message(name, 0, expires=at)])
        transport.close()
        [received] = drain(broker_url, name, 1) if results == [None] else [None]
    finally:
        delete_queue(broker_url, name)

    assert results == [None], results
    assert received is not None
    assert received.headers["expires"] is not None
