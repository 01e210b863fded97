"""``CeleryTransport`` against real brokers: what lands on the queue, and what a failure reports.

No worker here: the test reads the queue itself, so it sees exactly the messages the transport
published, with their headers (the worker proofs are in ``test_outbox_proofs.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from django_idempotency.outbox.transports import CeleryTransport
from tests.servers import free_port
from tests.transport_helpers import celery_app, drain, fresh_queue, message

pytestmark = pytest.mark.broker


@pytest.fixture
def queue(broker_url: str) -> Iterator[str]:
    with fresh_queue(broker_url, "transport") as name:
        yield name


@pytest.mark.parametrize("transactions", [False, True], ids=["per-message", "transactions"])
def test_messages_land_with_the_event_id_as_header_and_task_id(
    broker_url: str, queue: str, transactions: bool
) -> None:
    if transactions and not broker_url.startswith("amqp"):
        pytest.skip("AMQP transactions are a RabbitMQ option")
    transport = CeleryTransport(app=celery_app(broker_url), transactions=transactions)
    messages = [message(queue, n, key="k") for n in range(3)]

    assert transport.send(messages) == [None, None, None]
    transport.close()

    received = drain(broker_url, queue, 3)
    for sent, got in zip(messages, received, strict=True):
        assert got.headers["event_id"] == sent.event_id
        assert got.headers["id"] == sent.event_id  # the task id
        assert got.headers["task"] == "shop.effect"
        assert got.headers["tenant"] == "acme"
        args, kwargs, _ = got.payload
        assert (args, kwargs) == ([], {"n": sent.id})


def test_an_unreachable_broker_fails_every_message(broker_url: str) -> None:
    port = free_port()
    down = (
        f"amqp://guest:guest@127.0.0.1:{port}//"
        if broker_url.startswith("amqp")
        else f"redis://127.0.0.1:{port}/0"
    )
    transport = CeleryTransport(app=celery_app(down), connect_timeout=0.5)

    results = transport.send([message("q", n) for n in range(3)])

    assert all(isinstance(result, Exception) for result in results)
    transport.close()


def test_a_bad_payload_fails_its_key_only(broker_url: str, queue: str) -> None:
    transport = CeleryTransport(app=celery_app(broker_url))
    bad = message(queue, 1, key="a", payload={"oops": True})
    messages = [bad, message(queue, 2, key="a"), message(queue, 3, key="b"), message(queue, 4)]

    results = transport.send(messages)
    transport.close()

    assert isinstance(results[0], TypeError) and "outbox.publish()" in str(results[0])
    assert results[1] is results[0]  # behind the failure of its key: not sent
    assert results[2:] == [None, None]
    assert [m.payload[1]["n"] for m in drain(broker_url, queue, 2)] == [3, 4]
