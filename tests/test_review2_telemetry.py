"""Review 2: a failing OpenTelemetry SDK, and garbage trace headers, never break the library.

A span processor that raises (a user's, or an exporter called synchronously by
``SimpleSpanProcessor``'s caller), or a meter whose instruments cannot be made, is logged and
ignored: the request is answered, the consumer applies its event, the relay sends its batch.
A ``traceparent`` that a client or an old row carries, however malformed or large, is ignored.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import transaction
from django.test import Client

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

from django_idempotency import telemetry
from django_idempotency.events.core import process_event
from django_idempotency.models import OutboxEntry
from django_idempotency.outbox import core as outbox
from django_idempotency.outbox.relay import Relay
from tests.probes import post
from tests.test_telemetry import Answering

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("null_default_transport"),  # topic messages, no Celery task call
]


class Broken(RuntimeError):
    pass


class RaisingProcessor(SpanProcessor):
    def on_start(self, span: Any, parent_context: Any = None) -> None:
        raise Broken("span processor on_start")

    def on_end(self, span: Any) -> None:
        raise Broken("span processor on_end")


class RaisingMeter:
    def __getattr__(self, name: str) -> Any:
        def fail(*args: Any, **kwargs: Any) -> Any:
            raise Broken(f"meter.{name}")

        return fail


class RaisingMeterProvider:
    def get_meter(self, *args: Any, **kwargs: Any) -> RaisingMeter:
        return RaisingMeter()


@pytest.fixture
def broken_sdk() -> Iterator[None]:
    provider = TracerProvider()
    provider.add_span_processor(RaisingProcessor())
    telemetry.configure(tracer_provider=provider, meter_provider=RaisingMeterProvider())
    yield
    telemetry.reset()


def test_a_request_is_answered_when_the_sdk_raises(client: Client, broken_sdk: None) -> None:
    first = post(client, "/probe/effect/", "rv2-broken-sdk", {"a": 1})
    replay = post(client, "/probe/effect/", "rv2-broken-sdk", {"a": 1})
    assert first.status_code < 300, first.content
    assert replay.status_code == first.status_code


def test_a_consumer_applies_when_the_sdk_raises(broken_sdk: None) -> None:
    applied: list[int] = []
    process_event("c.rv2", str(uuid.uuid4()), lambda: applied.append(1))
    assert applied == [1]


def test_the_relay_sends_when_the_sdk_raises(broken_sdk: None) -> None:
    with transaction.atomic():
        outbox.send("rv2.topic", {"n": 1})
    Relay(transports={"default": Answering(set())}).run_once()
    assert list(OutboxEntry.objects.values_list("state", flat=True)) == ["sent"]


GARBAGE = [
    "",
    "00-" + "z" * 32 + "-" + "0" * 16 + "-01",
    "00-00000000000000000000000000000000-0000000000000000-01",
    "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    "x" * 1_000_000,
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\n\x00",
]


@pytest.mark.parametrize("value", GARBAGE, ids=range(len(GARBAGE)))
def test_a_garbage_traceparent_is_ignored(value: str) -> None:
    from tests.otel_helpers import sdk

    sdk()
    try:
        headers = {"traceparent": value, "tracestate": value}
        with telemetry.consuming("c.rv2", headers, "e"):
            pass
        with telemetry.sending(headers):
            pass
        assert telemetry.celery_carrier(type("R", (), {"headers": headers})()) == headers
    finally:
        telemetry.reset()


@pytest.mark.parametrize("value", ["abc", b"abc", 42, ["ab", "c"], [("traceparent",)]])
def test_a_foreign_headers_header_does_not_break_a_celery_consumer(value: Any) -> None:
    """A worker makes each message header an attribute of the task request, so a header that a
    client (or ``outbox.publish(headers={"headers": ...})``) named ``headers`` becomes
    ``request.headers``: reading the trace context from it must not raise."""
    from celery.app.task import Context

    request = Context({"headers": value, "traceparent": GARBAGE[3], "id": "x"})
    assert telemetry.celery_carrier(request) == {"traceparent": GARBAGE[3]}


@pytest.mark.broker
def test_a_celery_transport_sends_when_the_sdk_raises(broker_url: str, broken_sdk: None) -> None:
    """The producer span around each publish (``telemetry.sending``) fails: the message is
    still published, and reported sent."""
    from django_idempotency.outbox.transports import CeleryTransport
    from tests.test_transport_batches import celery_app, drain, message
    from tests.workers import delete_queue, new_queue_name

    name = new_queue_name("rv2-otel")
    outgoing = message(name, 0)
    outgoing.headers["traceparent"] = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    transport = CeleryTransport(app=celery_app(broker_url))
    try:
        results = transport.send([outgoing])
        transport.close()
        received = drain(broker_url, name, 1) if results == [None] else []
    finally:
        delete_queue(broker_url, name)
    assert results == [None], results
    assert received[0].headers["event_id"] == outgoing.event_id


def test_a_phased_flow_completes_when_the_sdk_raises(
    client: Client, broken_sdk: None, remote_calls: Any
) -> None:
    assert post(client, "/probe/flow/", str(uuid.uuid4())).status_code == 201


@pytest.mark.postgres
@pytest.mark.timeout(180)
def test_the_kafka_runner_applies_when_the_sdk_raises(
    kafka_cluster: Any, broken_sdk: None
) -> None:
    """The runner's consumer span and counters fail, and a message carries a garbage
    ``traceparent`` header: each message is still applied once, none dead-lettered."""
    from django_idempotency.kafka.runner import ConsumerRunner
    from django_idempotency.kafka.settings import parse_consumers

    topic = kafka_cluster.new_topic("rv2-otel")
    [settings] = parse_consumers(
        "KAFKA_CONSUMERS",
        {
            "rv2.kafka": {
                "HANDLER": "testproject.shop.kafka_handlers.apply",
                "TOPICS": [topic],
                "GROUP": f"rv2-{uuid.uuid4().hex[:8]}",
                "CONFIG": {"bootstrap.servers": kafka_cluster.bootstrap},
                "MAX_DELIVERIES": 2,
                "RETRY_DELAY": 0.1,
                "POLL_TIMEOUT": 0.2,
            }
        },
    ).values()
    good = str(uuid.uuid4())
    kafka_cluster.producer.produce(
        topic,
        value=b'{"event_id": "%s"}' % good.encode(),
        headers={"event_id": good, "traceparent": b"\xff" * 4096, "tracestate": b"x" * 100_000},
    )
    kafka_cluster.producer.flush(30)
    kafka_cluster.produce(topic, [{"event_id": str(uuid.uuid4())}])
    runner = ConsumerRunner(settings)
    runner.run(max_messages=2)
    assert {outcome.value: n for outcome, n in runner.counts.items()} == {"applied": 2}
