"""KafkaTransport, the outbox relay's Kafka transport, against a real client and cluster.

The cluster is librdkafka's mock cluster, or ``KAFKA_BOOTSTRAP_SERVERS``
(tests/kafka_cluster.py).
"""

from __future__ import annotations

import itertools
import json
import re
import uuid
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings
from django.utils import timezone

from django_idempotency.checks import check_outbox_transports

pytest.importorskip("confluent_kafka")
from confluent_kafka import KafkaException, Producer

from django_idempotency.kafka.transport import KafkaTransport
from django_idempotency.outbox.transports import OutboxMessage, Transport
from tests.kafka_cluster import Cluster
from tests.kafka_mock import MockCluster

_ids = itertools.count(1)


def outgoing(
    destination: str,
    payload: Any,
    ordering_key: str | None = None,
    headers: dict[str, str] | None = None,
) -> OutboxMessage:
    return OutboxMessage(
        id=next(_ids),
        event_id=str(uuid.uuid4()),
        destination=destination,
        payload=payload,
        headers=headers or {},
        ordering_key=ordering_key,
        created_at=timezone.now(),
        attempts=1,
    )


@pytest.fixture
def transport(kafka_cluster: Cluster) -> Iterator[KafkaTransport]:
    config = {"bootstrap.servers": kafka_cluster.bootstrap, "message.max.bytes": 20000}
    kafka = KafkaTransport(config)
    yield kafka
    kafka.close()


@pytest.mark.slow
def test_messages_arrive_with_their_event_id_and_keys_keep_their_order(
    kafka_cluster: Cluster, transport: KafkaTransport
) -> None:
    topic = kafka_cluster.new_topic("transport")
    messages = [
        outgoing(topic, {"n": n}, ordering_key=f"order-{n % 3}" if n % 4 else None)
        for n in range(40)
    ]
    messages[1] = outgoing(topic, {"n": 1}, "order-1", headers={"traceparent": "00-abc"})
    assert isinstance(transport, Transport)

    assert transport.send(messages) == [None] * 40

    received = kafka_cluster.read(topic, 40)
    assert len(received) == 40
    by_event = {dict(m.headers() or [])["event_id"].decode(): m for m in received}
    assert set(by_event) == {m.event_id for m in messages}
    assert dict(by_event[messages[1].event_id].headers() or [])["traceparent"] == b"00-abc"
    partitions: defaultdict[bytes, set[int | None]] = defaultdict(set)
    offsets: defaultdict[bytes, list[tuple[int | None, int]]] = defaultdict(list)
    for sent in messages:
        got = by_event[sent.event_id]
        assert json.loads(got.value() or b"") == sent.payload
        if sent.ordering_key is not None:
            assert got.key() == sent.ordering_key.encode()
            partitions[got.key() or b""].add(got.partition())
            offsets[got.key() or b""].append((got.offset(), sent.payload["n"]))
    assert all(len(found) == 1 for found in partitions.values())  # one partition per key
    for pairs in offsets.values():
        assert sorted(pairs) == sorted(pairs, key=lambda pair: pair[1])  # in the outbox order


@pytest.mark.slow
def test_after_a_failure_the_later_messages_of_that_key_are_not_sent(
    kafka_cluster: Cluster, transport: KafkaTransport
) -> None:
    topic = kafka_cluster.new_topic("transport-fail")
    too_big = {"blob": "x" * 50_000}  # over message.max.bytes: refused by the client
    messages = [
        outgoing(topic, {"n": 0}, "a"),
        outgoing(topic, too_big, "a"),
        outgoing(topic, {"n": 2}, "a"),
        outgoing(topic, {"n": 3}, "b"),
        outgoing(topic, {"n": 4}),
    ]

    results = transport.send(messages)

    assert results[0] is None and results[3] is None and results[4] is None
    assert isinstance(results[1], KafkaException)
    assert results[2] is results[1]  # not sent: reported with the failure that held it back
    assert kafka_cluster.count(topic) == 3
    received = kafka_cluster.read(topic, 3)
    assert sorted(json.loads(m.value() or b"")["n"] for m in received) == [0, 3, 4]


@pytest.mark.parametrize(
    ("config", "text"),
    [
        ({}, "bootstrap.servers"),
        ({"bootstrap.servers": "b:9092", "enable.idempotence": False}, "idempotence"),
        ({"bootstrap.servers": "b:9092", "acks": 1}, "acks=all"),
    ],
)
def test_a_weaker_producer_is_refused(config: dict[str, Any], text: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=text):
        KafkaTransport(config)


@pytest.mark.parametrize(
    ("config", "timeout", "text"),
    [
        ({"message.timeout.ms": 60_000}, 30.0, "longer than the transport's timeout (30 s)"),
        ({"message.timeout.ms": "30001"}, 30.0, "longer than the transport's timeout"),
        ({"delivery.timeout.ms": 2_000}, 1.5, "'delivery.timeout.ms' to 2000, longer than"),
        ({"message.timeout.ms": 0}, 30.0, "0 is no limit at all"),
        ({"message.timeout.ms": "soon"}, 30.0, "not a positive number of milliseconds"),
        ({}, float("nan"), "timeout must be a positive number of seconds"),
        ({}, 0, "timeout must be a positive number of seconds"),
    ],
)
def test_a_message_timeout_that_outlives_the_transport_is_refused(
    config: dict[str, Any], timeout: float, text: str
) -> None:
    """Issue 35 item 5: a message.timeout.ms above the transport's timeout let librdkafka
    deliver a message after send() had reported it failed; the relay sent it again, and the
    topic held it twice (test_nothing_is_delivered_after_the_transport_reported_a_failure).
    Refused when the transport is built, and by the system checks (E032)."""
    options = {"config": {"bootstrap.servers": "127.0.0.1:1", **config}, "timeout": timeout}
    with pytest.raises(ImproperlyConfigured, match=re.escape(text)):
        KafkaTransport(**options)
    entry = {"BACKEND": "django_idempotency.kafka.transport.KafkaTransport", "OPTIONS": options}
    with override_settings(IDEMPOTENCY={"OUTBOX_TRANSPORTS": {"default": entry}}):
        [error] = [m for m in check_outbox_transports() if m.id == "django_idempotency.E032"]
    assert text in error.msg
    assert "['OUTBOX_TRANSPORTS']['default']['OPTIONS']" in error.msg


@pytest.mark.parametrize(
    "config",
    [{}, {"message.timeout.ms": 30_000}, {"delivery.timeout.ms": "5000"}],
)
def test_a_message_timeout_within_the_transport_timeout_passes(config: dict[str, Any]) -> None:
    options = {"config": {"bootstrap.servers": "127.0.0.1:1", **config}}
    entry = {"BACKEND": "django_idempotency.kafka.transport.KafkaTransport", "OPTIONS": options}
    with override_settings(IDEMPOTENCY={"OUTBOX_TRANSPORTS": {"default": entry}}):
        assert check_outbox_transports() == []
    # One name for librdkafka (the alias would otherwise win by coming last), in milliseconds.
    built = KafkaTransport(**options).config
    assert built["message.timeout.ms"] in (30_000, 5_000) and "delivery.timeout.ms" not in built


def test_nothing_is_delivered_after_the_transport_reported_a_failure(
    kafka_mock: MockCluster,
) -> None:
    """A real producer on librdkafka's mock cluster: the first message's topic does not exist
    yet (and the brokers do not create topics), so it waits in librdkafka's queue and the
    transport reports it failed after its ``timeout``. Then the topic is created and a second
    message is sent through the same producer: the topic holds the second one only. With a
    ``message.timeout.ms`` longer than the ``timeout`` (librdkafka's default is 300 s), the
    first one was still queued, and went out with the second: the relay, told it had failed,
    would have written it a second time."""
    topic = f"idem-late-{uuid.uuid4().hex[:8]}"
    config = {"bootstrap.servers": kafka_mock.bootstrap, "allow.auto.create.topics": False}
    transport = KafkaTransport(config, timeout=1.0)
    try:
        [failed] = transport.send([outgoing(topic, {"n": 1}, "order-1")])
        assert isinstance(failed, (KafkaException, TimeoutError)), failed
        kafka_mock.create_topic(topic)
        # The producer learns of the new topic at its next metadata refresh, which may take
        # more than the 1 s timeout on a loaded machine: send again until it goes. Each
        # attempt reported failed must not be delivered either, so the topic still holds one.
        for _attempt in range(30):
            [second] = transport.send([outgoing(topic, {"n": 2}, "order-1")])
            if second is None:
                break
            assert isinstance(second, (KafkaException, TimeoutError)), second
        assert second is None, second
    finally:
        transport.close()
    assert [json.loads(m.value() or b"") for m in kafka_mock.read(topic)] == [{"n": 2}]


class EarlyFlush(Producer):
    """A producer whose ``flush`` returns at once, before any delivery report is served."""

    def flush(self, *args: Any, **kwargs: Any) -> int:
        return len(self)


class EarlyFlushTransport(KafkaTransport):
    producer_factory = EarlyFlush


def test_a_message_without_a_delivery_report_is_an_error(kafka_cluster: Cluster) -> None:
    topic = kafka_cluster.new_topic("transport-no-report")
    transport = EarlyFlushTransport({"bootstrap.servers": kafka_cluster.bootstrap}, timeout=2)
    messages = [outgoing(topic, {"n": n}, "a" if n % 2 else None) for n in range(4)]

    results = transport.send(messages)
    transport.close()

    assert all(isinstance(result, TimeoutError) for result in results), results


@pytest.mark.parametrize(
    ("destination", "payload", "headers", "error"),
    [
        ("", {}, {}, ValueError),
        ("a" * 250, {}, {}, ValueError),
        ("..", {}, {}, ValueError),
        ("orders events", {}, {}, ValueError),
        ("orders\n", {}, {}, ValueError),
        ("orders", {"at": object()}, {}, TypeError),
        ("orders", {"x": float("nan")}, {}, ValueError),
        ("orders", {}, {"n": 1}, TypeError),
    ],
)
def test_a_message_kafka_can_never_take_is_refused(
    destination: str, payload: Any, headers: Any, error: type[Exception]
) -> None:
    transport = KafkaTransport({"bootstrap.servers": "127.0.0.1:1"})

    with pytest.raises(error):
        transport.validate_message(destination, payload, headers)


def test_a_valid_kafka_message_passes() -> None:
    transport = KafkaTransport({"bootstrap.servers": "127.0.0.1:1"})

    transport.validate_message("shop.orders-v1_x", {"n": [1, "é"]}, {"traceparent": "00"})
