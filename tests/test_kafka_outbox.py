"""The outbox to Kafka, end to end: outbox.send -> idempotency_relay -> KafkaTransport -> the
(mock) cluster -> idempotency_consume -> one effect per event, with every message sent twice.

The relay and the consumer are real subprocesses on the test database; the cluster is
librdkafka's mock cluster or ``KAFKA_BOOTSTRAP_SERVERS`` (tests/kafka_cluster.py).
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import override_settings

pytest.importorskip("confluent_kafka")

from django_idempotency.models import OutboxEntry
from django_idempotency.outbox import core as outbox
from testproject.shop.models import Effect
from tests.kafka_cluster import Cluster, manage_env, run_manage, start_consumer
from tests.workers import database_url

pytestmark = [
    pytest.mark.slow,
    # PostgreSQL and MariaDB; SQLite's single writer adds nothing the runner does not show there.
    pytest.mark.postgres,
    pytest.mark.mysql,
    pytest.mark.timeout(240),
    pytest.mark.django_db(transaction=True),
]


def transports(kafka_cluster: Cluster) -> dict[str, Any]:
    return {
        "default": {"BACKEND": "django_idempotency.outbox.transports.CeleryTransport"},
        "kafka": {
            "BACKEND": "django_idempotency.kafka.transport.KafkaTransport",
            "OPTIONS": {"config": {"bootstrap.servers": kafka_cluster.bootstrap}},
        },
    }


def relay_once(kafka_cluster: Cluster) -> str:
    env = manage_env(
        database_url(connection.settings_dict),
        IDEMPOTENCY_OUTBOX_TRANSPORTS=json.dumps(transports(kafka_cluster)),
    )
    done = run_manage(env, "idempotency_relay", "--once")
    return done.stdout + done.stderr


def test_outbox_through_the_relay_and_kafka_to_the_runner_one_effect_per_event(
    kafka_cluster: Cluster, tmp_path: Path
) -> None:
    topic = kafka_cluster.new_topic("outbox")
    group = f"group-{uuid.uuid4().hex[:8]}"
    with override_settings(IDEMPOTENCY={"OUTBOX_TRANSPORTS": transports(kafka_cluster)}):
        with transaction.atomic():
            sent = [
                outbox.send(topic, {"n": n}, key=f"order-{n % 5}", transport="kafka")
                for n in range(50)
            ]
        with pytest.raises(RuntimeError), transaction.atomic():
            outbox.send(topic, {"n": "rolled back"}, transport="kafka")
            raise RuntimeError("the producer's transaction rolls back: its message never leaves")

    relay_once(kafka_cluster)
    assert kafka_cluster.count(topic) == 50
    # As if the relay had died after Kafka's acknowledgements, before recording them: every
    # message goes out a second time.
    assert OutboxEntry.objects.filter(state="sent").update(state="pending", sent_at=None) == 50
    relay_once(kafka_cluster)
    assert kafka_cluster.count(topic) == 100

    consumer = start_consumer(
        kafka_cluster,
        topic=topic,
        group=group,
        db_url=database_url(connection.settings_dict),
        log_dir=tmp_path,
        name="consumer",
    )
    try:
        kafka_cluster.wait_caught_up(topic, group)
        assert consumer.terminate() == 0
    finally:
        if consumer.process.poll() is None:
            consumer.kill()

    effects = Counter(Effect.objects.filter(name="kafka").values_list("payload", flat=True))
    assert effects == Counter({event_id: 1 for event_id in sent})
    assert consumer.output().count("duplicate ignored") == 50
