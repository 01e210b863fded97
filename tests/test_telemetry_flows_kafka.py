"""The flow and Kafka counters, each outcome exactly once, read with the SDK's in-memory reader.

Flows through the test project's phased probe views; Kafka through a runner in this process on
the mock cluster (tests/kafka_cluster.py), with the test project's handler.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

pytest.importorskip("opentelemetry.sdk")

from django_idempotency import telemetry
from django_idempotency.flows.phases import FlowFailed
from testproject.shop.probe_flows import ProbeError
from tests.otel_helpers import Sdk, delta, sdk
from tests.probes import post

pytestmark = pytest.mark.django_db(transaction=True)

Key = tuple[str, frozenset[tuple[str, Any]]]


@pytest.fixture
def otel() -> Any:
    yield sdk()
    telemetry.reset()


def only(changes: dict[Key, float], name: str) -> dict[tuple[tuple[str, Any], ...], float]:
    """The changed points of metric ``name``, by their sorted attributes."""
    return {
        tuple(sorted(attributes)): value
        for (metric, attributes), value in changes.items()
        if metric == name
    }


def flows(changes: dict[Key, float], flow: str) -> dict[str, float]:
    found = only(changes, telemetry.FLOW_RUNS)
    return {
        dict(attributes)["idempotency.outcome"]: value
        for attributes, value in found.items()
        if dict(attributes)["idempotency.flow"] == flow
    }


FLOW = "testproject.shop.probe_flows:flow_probe"
UNRESUMABLE = "testproject.shop.probe_flows:flow_unresumable"


def test_flow_runs_resumed_and_completed(client: Client, otel: Sdk, remote_calls: Any) -> None:
    key = str(uuid.uuid4())
    before = otel.counter_values()
    with pytest.raises(ProbeError):
        post(client, "/probe/flow/", key, headers={"X-Flow-Raise": "one"})
    assert flows(delta(before, otel.counter_values()), FLOW) == {}  # paused: no outcome yet
    before = otel.counter_values()
    assert post(client, "/probe/flow/", key).status_code == 201
    assert flows(delta(before, otel.counter_values()), FLOW) == {"resumed": 1, "completed": 1}
    before = otel.counter_values()
    assert post(client, "/probe/flow/", str(uuid.uuid4())).status_code == 201
    assert flows(delta(before, otel.counter_values()), FLOW) == {"completed": 1}
    phases = [
        span.attributes["idempotency.phase"]
        for span in otel.finished()
        if span.name in ("idempotency.flow.phase", "idempotency.flow.call") and span.attributes
    ]
    assert phases[-3:] == ["one", "two", "three"]
    assert [s.name for s in otel.finished() if s.name.startswith("idempotency.flow.")][-3:] == [
        "idempotency.flow.phase",
        "idempotency.flow.call",
        "idempotency.flow.phase",
    ]


def test_flow_runs_failed_and_compensated(client: Client, otel: Sdk, remote_calls: Any) -> None:
    key = str(uuid.uuid4())
    with pytest.raises(ProbeError):
        post(client, "/probe/flow-unresumable/", key, headers={"X-Flow-Raise": "inside-two"})
    before = otel.counter_values()
    assert post(client, "/probe/flow-unresumable/", key).status_code == FlowFailed.status
    changes = flows(delta(before, otel.counter_values()), UNRESUMABLE)
    assert changes == {"resumed": 1, "compensated": 1, "failed": 1}


# --- Kafka ---------------------------------------------------------------------------------------


@pytest.mark.slow  # over 5 s: kept out of make test-quick; CI runs it with the slow tests
@pytest.mark.postgres
@pytest.mark.timeout(180)
def test_kafka_messages_by_outcome_and_dead_letters(kafka_cluster: Any, otel: Sdk) -> None:
    """Applied, duplicate, retried and dead-lettered messages each count once, as the runner's
    own tally says; the dead letter also counts in ``idempotency.kafka.dead_lettered``."""
    from django_idempotency.kafka.runner import ConsumerRunner
    from django_idempotency.kafka.settings import parse_consumers

    topic = kafka_cluster.new_topic("otel-metrics")
    name = "otel.kafka"
    [settings] = parse_consumers(
        "KAFKA_CONSUMERS",
        {
            name: {
                "HANDLER": "testproject.shop.kafka_handlers.apply",
                "TOPICS": [topic],
                "GROUP": f"otel-{uuid.uuid4().hex[:8]}",
                "CONFIG": {"bootstrap.servers": kafka_cluster.bootstrap},
                "MAX_DELIVERIES": 2,
                "RETRY_DELAY": 0.1,
                "POLL_TIMEOUT": 0.2,
            }
        },
    ).values()
    good, poison = str(uuid.uuid4()), str(uuid.uuid4())
    events = [{"event_id": good}, {"event_id": good}, {"event_id": poison, "behaviour": "fail"}]
    # One partition (one key) keeps them in order: the poison message comes last.
    kafka_cluster.produce(topic, events, key=lambda event: "one-key")
    runner = ConsumerRunner(settings)
    before = otel.counter_values()
    runner.run(max_messages=len(events) + 2)  # the poison one fails twice, then dead-letters
    changes = delta(before, otel.counter_values())
    tally = {outcome.value: count for outcome, count in runner.counts.items()}
    assert tally == {"applied": 1, "duplicate": 1, "retry": 2, "dead-lettered": 1}
    counted = {
        dict(attributes)["idempotency.outcome"]: value
        for attributes, value in only(changes, telemetry.KAFKA_MESSAGES).items()
    }
    assert counted == tally
    assert only(changes, telemetry.KAFKA_DEAD_LETTERED) == {(("idempotency.consumer", name),): 1}
    deliveries = Counter(
        {
            dict(attributes)["idempotency.outcome"]: value
            for attributes, value in only(changes, telemetry.CONSUMER_DELIVERIES).items()
        }
    )
    assert deliveries == Counter({"applied": 1, "duplicate": 1, "failed": 2, "parked": 1})
    assert len(kafka_cluster.read(f"{topic}.dlq", 1)) == 1


@pytest.mark.postgres
@pytest.mark.timeout(120)
def test_a_failed_offset_commit_counts_once(kafka_cluster: Any, otel: Sdk) -> None:
    """A commit the broker refuses (here: an offset for a partition the topic does not have,
    which the mock cluster answers with UNKNOWN_TOPIC_OR_PART) is logged and counted."""
    from confluent_kafka import Consumer

    from django_idempotency.kafka.runner import ConsumerRunner
    from django_idempotency.kafka.settings import parse_consumers

    topic = kafka_cluster.new_topic("otel-commit")
    group = f"otel-{uuid.uuid4().hex[:8]}"
    [settings] = parse_consumers(
        "KAFKA_CONSUMERS",
        {
            "otel.commit": {
                "HANDLER": "testproject.shop.kafka_handlers.apply",
                "TOPICS": [topic],
                "GROUP": group,
                "CONFIG": {"bootstrap.servers": kafka_cluster.bootstrap},
            }
        },
    ).values()
    runner = ConsumerRunner(settings)
    consumer = Consumer(
        {
            "bootstrap.servers": kafka_cluster.bootstrap,
            "group.id": group,
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([topic])
    try:
        for _ in range(6):
            consumer.poll(0.5)
        runner._consumer = consumer
        runner._done = {(topic, 99): 5}  # no partition 99: the broker refuses the commit
        before = otel.counter_values()
        runner._commit()
        changes = delta(before, otel.counter_values())
    finally:
        runner._consumer = None
        consumer.close()
    assert changes == {
        (telemetry.KAFKA_COMMIT_FAILURES, frozenset({("idempotency.consumer", "otel.commit")})): 1
    }


@pytest.mark.postgres
@pytest.mark.mysql
@pytest.mark.timeout(180)
def test_a_message_applied_after_its_batch_rolled_back_counts_once(
    kafka_cluster: Any, otel: Sdk
) -> None:
    """Regression: a batch counted the deliveries it applied, and the duplicates it skipped,
    before its COMMIT; when a later message of the batch failed and the batch rolled back,
    the same messages were counted again one at a time, so ``idempotency.consumer.deliveries``
    counted each message before the poison twice. Each message counts once now: the deliveries
    of a batch are counted when its transaction commits. And ``idempotency.kafka.messages``
    counts a committed batch's messages too, as the runner's own tally does."""
    from django_idempotency.kafka.runner import ConsumerRunner, Outcome
    from django_idempotency.models import ProcessedEvent
    from tests.test_kafka_runner_fast import (
        committed,
        effect_ids,
        event,
        produce,
        recording_handler,
        settings_for,
    )

    topic = kafka_cluster.new_topic("otel-batch")
    # BATCH_SIZE=5: six messages one at a time (five, and one more to settle), then a batch
    # whose third message is a duplicate (applied before) and whose fourth one fails.
    values = [event() for _ in range(8)] + [event(poison=True)] + [event() for _ in range(3)]
    ids = [json.loads(v)["event_id"] for v in values]
    settings = settings_for(
        kafka_cluster, topic, batch_size=5, event_id_source="json", max_deliveries=1
    )
    ProcessedEvent.objects.create(
        consumer=settings.name, event_id=ids[7], expires_at=timezone.now()
    )
    produce(kafka_cluster, topic, values)
    runner = ConsumerRunner(settings, recording_handler([], fail=lambda e: "poison" in e))
    before = otel.counter_values()
    # Every message once, and the poison once more: it fails alone, then is dead-lettered.
    runner.run(max_messages=len(values) + 1)
    changes = delta(before, otel.counter_values())

    assert runner.counts == {
        Outcome.APPLIED: 10,
        Outcome.DUPLICATE: 1,
        Outcome.RETRY: 1,
        Outcome.DEAD_LETTERED: 1,
    }
    assert sum(committed(kafka_cluster, settings).values()) == len(values)
    healthy = [i for i in ids if i not in (ids[7], ids[8])]
    assert Counter(effect_ids()) == Counter(healthy)
    deliveries = {
        dict(attributes)["idempotency.outcome"]: value
        for attributes, value in only(changes, telemetry.CONSUMER_DELIVERIES).items()
    }
    assert deliveries == {"applied": 10, "duplicate": 1, "failed": 1, "parked": 1}
    # Regression: the messages of a batch that committed were not counted at all in
    # idempotency.kafka.messages (only those handled one at a time were). A batch did commit:
    # its reservations share one processed_at.
    stamps = ProcessedEvent.objects.filter(consumer=settings.name).values_list("processed_at")
    assert len(set(stamps)) < len(stamps)
    messages = {
        dict(attributes)["idempotency.outcome"]: value
        for attributes, value in only(changes, telemetry.KAFKA_MESSAGES).items()
    }
    assert messages == {outcome.value: count for outcome, count in runner.counts.items()}
