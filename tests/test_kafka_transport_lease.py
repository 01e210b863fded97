"""KafkaTransport within the relay's lease (:meth:`KafkaTransport.limit_to_lease`).

A relay hands its lease to its transports before each batch. Without a bound, a broker that
cannot be reached held a Kafka batch for the transport's ``timeout`` plus a margin (35 s by
default): with a shorter lease another relay took the batch over and sent it too. The bound
keeps one flush within a quarter of the lease, and librdkafka's ``message.timeout.ms`` within
the flush, so a message is never delivered after the transport reported it failed (issue 35,
item 5).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import close_old_connections, transaction
from django.test import override_settings

pytest.importorskip("confluent_kafka")
from confluent_kafka import Producer

from django_idempotency.kafka.transport import KafkaTransport
from django_idempotency.models import OutboxEntry
from django_idempotency.outbox import core as outbox
from django_idempotency.outbox.relay import BatchResult, Relay
from tests.kafka_mock import MockCluster, mock_cluster
from tests.outbox_helpers import NULL_TRANSPORTS

NOWHERE = {"bootstrap.servers": "127.0.0.1:1", "log_level": 0}


def bounds(transport: KafkaTransport) -> tuple[float, int]:
    """The flush's wait (seconds) and librdkafka's ``message.timeout.ms``, checking that the
    second never outlives the first."""
    millis = transport.config["message.timeout.ms"]
    assert isinstance(millis, int) and 1 <= millis <= transport.wait * 1000, transport.config
    assert "delivery.timeout.ms" not in transport.config  # one name, no alias to win over it
    return transport.wait, millis


def test_a_relay_lease_bounds_the_flush_and_the_message_timeout() -> None:
    transport = KafkaTransport(NOWHERE)  # timeout 30 s
    assert bounds(transport) == (35.0, 30_000)
    transport.limit_to_lease(200)  # a quarter is 50 s: already within
    assert bounds(transport) == (35.0, 30_000)
    transport.limit_to_lease(60)  # 15 s: librdkafka gives up 5 s before the flush does
    assert bounds(transport) == (15.0, 10_000)
    transport.limit_to_lease(8)  # 2 s: the margin is half of it
    assert bounds(transport) == (2.0, 1_000)
    transport.limit_to_lease(60)  # a longer lease never loosens the bound
    assert bounds(transport) == (2.0, 1_000)
    assert transport.timeout == 1.0
    for wrong in (0, -1, math.nan, True, "8"):
        with pytest.raises(ValueError, match="lease"):
            transport.limit_to_lease(wrong)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"message.timeout.ms": 20_000}, 1_000),  # longer than the limit: lowered
        ({"delivery.timeout.ms": "20000"}, 1_000),  # the alias, likewise
        ({"message.timeout.ms": 30_000, "delivery.timeout.ms": 500}, 500),  # the shorter one
        ({"message.timeout.ms": 500}, 500),  # already within: kept
    ],
)
def test_a_configured_message_timeout_is_lowered_into_the_lease(
    config: dict[str, Any], expected: int
) -> None:
    transport = KafkaTransport({**NOWHERE, **config})
    transport.limit_to_lease(8)
    assert bounds(transport) == (2.0, expected)


def test_a_producer_built_before_the_limit_is_built_again_with_it() -> None:
    built: list[dict[str, Any]] = []

    def factory(config: dict[str, Any]) -> Producer:
        built.append(config)
        return Producer(config)

    class Recording(KafkaTransport):
        producer_factory = staticmethod(factory)

    transport = Recording(NOWHERE)
    try:
        first = transport._open()
        transport.limit_to_lease(200)  # nothing to change: the same producer
        assert transport._open() is first
        transport.limit_to_lease(8)
        second = transport._open()
        assert second is not first
        transport.limit_to_lease(8)  # the relay calls it before every batch
        assert transport._open() is second
    finally:
        transport.close()
    assert [config["message.timeout.ms"] for config in built] == [30_000, 1_000]


@pytest.fixture
def kafka_down() -> Iterator[MockCluster]:
    """A mock cluster of its own, whose one broker the test takes down and brings back."""
    with mock_cluster(brokers=1) as cluster:
        yield cluster


LEASE = 8.0
"""The relays' lease: a quarter of it (2 s) bounds a batch; 35 s (the transport's own bound)
would outlive it four times."""
WAIT = 60.0
"""How long the test waits for what it waits for, on a loaded machine."""


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.django_db(transaction=True)
def test_a_relay_with_a_short_lease_fails_a_batch_kafka_never_got_before_another_takes_it(
    kafka_down: MockCluster,
) -> None:
    """The broker cannot be reached. Two relays poll, each with a transport of its own: the one
    that claims the message fails the batch within a quarter of its lease, and records the
    attempt while it still holds the lease, so the other never takes the message over (without
    the bound it did after 8 s, while the first still waited, and both sent it). Once the broker
    is back, a later message goes through the first one's producer, and the failed one never
    arrives: librdkafka had given up on it before the transport reported it failed."""
    topic = kafka_down.new_topic("lease")
    config = {"bootstrap.servers": kafka_down.bootstrap, "log_level": 0}
    entry = {"BACKEND": "django_idempotency.kafka.transport.KafkaTransport"}
    kafka_down.down()
    transports = [KafkaTransport(config), KafkaTransport(config)]
    kafka = {**entry, "OPTIONS": {"config": config}}
    with override_settings(IDEMPOTENCY={"OUTBOX_TRANSPORTS": {**NULL_TRANSPORTS, "kafka": kafka}}):
        with transaction.atomic():
            first = outbox.send(topic, {"n": 1}, key="order-1", transport="kafka")
        results: list[tuple[int, BatchResult]] = []
        errors: list[BaseException] = []
        stop = threading.Event()

        def poll(index: int) -> None:
            relay = Relay(
                transports={"kafka": transports[index]}, lease=LEASE, backoff=60, max_backoff=60
            )
            try:
                while not stop.is_set():
                    results.append((index, relay.run_once()))
                    time.sleep(0.1)
            except BaseException as exc:  # noqa: BLE001 - the test fails on it below
                errors.append(exc)
            finally:
                close_old_connections()

        threads = [threading.Thread(target=poll, args=(index,)) for index in (0, 1)]
        try:
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + WAIT
            # Until the failed attempt is recorded, or another relay claimed the message again.
            while not (row := OutboxEntry.objects.get(event_id=first)).last_error:
                assert row.attempts < 2, "the batch outlived its lease: another relay took it"
                assert time.monotonic() < deadline and not errors, errors
                time.sleep(0.1)
        finally:
            stop.set()
            for thread in threads:
                thread.join(WAIT)
        assert errors == [], errors
        claims = [(index, result) for index, result in results if result.claimed]
        assert len(claims) == 1, claims  # nobody took the batch over
        sender, result = claims[0]
        assert (result.claimed, result.failed) == (1, 1), result
        row = OutboxEntry.objects.get(event_id=first)
        assert (row.state, row.attempts, row.locked_until) == (OutboxEntry.State.PENDING, 1, None)

        # The broker is back: a later message (another key) goes through the same producer.
        kafka_down.up()
        with transaction.atomic():
            second = outbox.send(topic, {"n": 2}, key="order-2", transport="kafka")
        relay = Relay(
            transports={"kafka": transports[sender]}, lease=LEASE, backoff=0.01, max_backoff=0.1
        )
        deadline = time.monotonic() + WAIT
        try:
            while OutboxEntry.objects.get(event_id=second).state != OutboxEntry.State.SENT:
                assert time.monotonic() < deadline, OutboxEntry.objects.get(event_id=second)
                relay.run_once()
                time.sleep(0.2)
        finally:
            for transport in transports:
                transport.close()
    assert [json.loads(m.value() or b"") for m in kafka_down.read(topic)] == [{"n": 2}]
    assert OutboxEntry.objects.get(event_id=first).attempts == 1  # never sent again
