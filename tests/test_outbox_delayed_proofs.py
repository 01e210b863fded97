"""Delayed outbox messages with real processes (issue 36): relays (``manage.py
idempotency_relay``), Celery workers and a producer, on the test database; SIGKILLs.

* A message with ``countdown=10`` held by a relay (``CeleryTransport(hold_until_due=True)``) runs
  10 s or more after its COMMIT, exactly once, across a SIGKILL of the relay while it holds it.
* A producer SIGKILLed between its COMMIT and its ``on_commit`` hook: the relay starts the
  countdown, and the task runs once, no earlier than the countdown after the commit.
* Kafka: the relay holds the message until it is due, across a SIGKILL, and the later message of
  its key waits behind it while another key goes at once.

PostgreSQL and MariaDB (the claim and the schedule's SQL differ); the brokers: Redis, and
RabbitMQ on PostgreSQL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.db import connection, transaction

from django_idempotency import new_event_id
from django_idempotency.models import OutboxEntry
from django_idempotency.outbox import core as outbox
from testproject.shop.models import Effect
from testproject.shop.tasks import effect
from tests.outbox_helpers import FAST_RELAY, Process, celery_transports, start_relay, wait_for
from tests.services import BROKER_URLS
from tests.workers import REPO, WorkerGroup, broker_workers_fixture, database_url

pytestmark = [
    pytest.mark.slow,
    pytest.mark.postgres,
    pytest.mark.mysql,
    pytest.mark.timeout(600),  # above the sum of a test's guards against a hang (none is a timing)
    pytest.mark.django_db(transaction=True),
]

WAIT = 120.0
"""A guard against a hang, never a timing: a relay's Django start alone took 11 s on the
loaded CI machine."""
COUNTDOWN = 10
"""Seconds a held message waits: long enough that the test's steps before the due time (a
check that it is held, a SIGKILL) fit on a loaded machine."""


def started(relay: Process) -> None:
    """Wait until ``relay`` serves (its Django start is behind it)."""
    wait_for(lambda: "outbox relay started" in relay.output(), WAIT, "the relay", relay.output)


workers = broker_workers_fixture(
    "workers",
    "delayed",
    workers=1,
    redis_only={
        "mysql": "MariaDB pass: on Redis (the broker side is proven in the PostgreSQL pass)"
    },
)


def applied(event_id: str) -> list[Effect]:
    return list(Effect.objects.filter(name="shop.effect", payload=event_id))


def test_a_held_countdown_runs_once_when_due_across_a_sigkill_of_its_relay(
    workers: WorkerGroup, tmp_path: Path
) -> None:
    transports = celery_transports(workers.broker_url, hold_until_due=True)
    db = database_url(connection.settings_dict)
    first = start_relay(
        *FAST_RELAY, db_url=db, transports=transports, log=tmp_path / "relay-1.log",
        broker_url=workers.broker_url,
    )  # fmt: skip
    event_id = str(new_event_id())
    started(first)
    with transaction.atomic():
        outbox.publish(
            effect, kwargs={"event_id": event_id}, queue=workers.queue, countdown=COUNTDOWN
        )
        before = time.time()
    committed = before  # the COMMIT began: the countdown starts in its first on_commit hook
    time.sleep(2)
    assert OutboxEntry.objects.get(event_id=event_id).state == "pending"  # held
    first.stop(signal.SIGKILL)
    second = start_relay(
        *FAST_RELAY, db_url=db, transports=transports, log=tmp_path / "relay-2.log",
        broker_url=workers.broker_url,
    )  # fmt: skip
    try:
        wait_for(
            lambda: bool(applied(event_id)),
            WAIT + COUNTDOWN,
            "the held message's effect",
            lambda: second.output() + workers.logs(),
        )
        time.sleep(1.0)  # room for a second effect, if there were one
    finally:
        second.stop()
    (done,) = applied(event_id)
    assert done.created_at.timestamp() >= committed + COUNTDOWN
    row = OutboxEntry.objects.get(event_id=event_id)
    assert (row.state, row.attempts) == ("sent", 1)
    assert row.sent_at is not None and row.sent_at.timestamp() >= committed + COUNTDOWN


PRODUCER = """
import os, signal, sys, time
import django
django.setup()
from django.db import transaction
from django_idempotency.outbox import core as outbox
from testproject.shop.tasks import effect

with transaction.atomic():
    # Registered first, it runs first after the COMMIT: the outbox's hook never runs.
    transaction.on_commit(lambda: os.kill(os.getpid(), signal.SIGKILL))
    outbox.publish(effect, kwargs={"event_id": sys.argv[1]}, queue=sys.argv[2], countdown=3)
    print(time.time(), flush=True)
"""


def test_a_producer_killed_before_its_hook_leaves_the_countdown_to_the_relay(
    workers: WorkerGroup, tmp_path: Path
) -> None:
    event_id = str(new_event_id())
    db = database_url(connection.settings_dict)
    producer = subprocess.run(
        [sys.executable, "-c", PRODUCER, event_id, workers.queue],
        cwd=REPO,
        env={
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "testproject.settings",
            "DATABASE_URL": db,
            "CELERY_BROKER_URL": workers.broker_url,
        },
        capture_output=True,
        timeout=WAIT,
        check=False,
    )
    assert producer.returncode == -signal.SIGKILL, producer.stderr.decode()
    committed = float(producer.stdout.decode().split()[-1])
    row = OutboxEntry.objects.get(event_id=event_id)
    assert row.available_at is not None and row.available_at.year == 9999  # not started

    relay = start_relay(
        *FAST_RELAY, db_url=db, transports=celery_transports(workers.broker_url),
        log=tmp_path / "relay.log", broker_url=workers.broker_url,
    )  # fmt: skip
    try:
        wait_for(
            lambda: bool(applied(event_id)),
            WAIT,
            "the effect",
            lambda: relay.output() + workers.logs(),
        )
        time.sleep(1.0)
    finally:
        relay.stop()
    (done,) = applied(event_id)
    row = OutboxEntry.objects.get(event_id=event_id)
    assert row.due_at is not None and row.due_at.timestamp() >= committed + 3
    assert done.created_at >= row.due_at  # Celery held it until its eta: the due time
    assert "started the countdown of 1 message" in relay.output()


@pytest.mark.usefixtures("django_db_setup")
def test_kafka_holds_a_message_until_due_and_its_key_behind_it_across_a_sigkill(
    kafka_cluster: object, tmp_path: Path
) -> None:
    pytest.importorskip("confluent_kafka")
    from django.test import override_settings

    from tests.kafka_cluster import Cluster

    assert isinstance(kafka_cluster, Cluster)
    topic = kafka_cluster.new_topic("delayed")
    kafka = {
        "BACKEND": "django_idempotency.kafka.transport.KafkaTransport",
        "OPTIONS": {"config": {"bootstrap.servers": kafka_cluster.bootstrap}},
    }
    transports = {
        "default": {"BACKEND": "django_idempotency.outbox.transports.CeleryTransport"},
        "kafka": kafka,
    }
    db = database_url(connection.settings_dict)
    redis = BROKER_URLS["redis"]

    def relay(log: str) -> Process:
        return start_relay(
            *FAST_RELAY, db_url=db, transports=json.dumps(transports), log=tmp_path / log,
            broker_url=redis,
        )  # fmt: skip

    first = relay("relay-1.log")
    started(first)
    with override_settings(IDEMPOTENCY={"OUTBOX_TRANSPORTS": transports}), transaction.atomic():
        outbox.send(topic, {"n": "held"}, key="k", countdown=COUNTDOWN, transport="kafka")
        outbox.send(topic, {"n": "behind"}, key="k", transport="kafka")
        outbox.send(topic, {"n": "free"}, key="j", transport="kafka")
        before = time.time()
    committed = before  # the COMMIT began: the countdown starts in its first on_commit hook
    wait_for(lambda: kafka_cluster.count(topic) >= 1, WAIT, "the free message", first.output)
    time.sleep(1.0)
    assert kafka_cluster.count(topic) == 1  # the held one and its key wait
    first.stop(signal.SIGKILL)
    second = relay("relay-2.log")
    try:
        wait_for(
            lambda: kafka_cluster.count(topic) >= 3, WAIT + COUNTDOWN, "all three", second.output
        )
        time.sleep(1.0)
    finally:
        second.stop()
    messages = kafka_cluster.read(topic, 3)
    assert kafka_cluster.count(topic) == 3  # each once
    by_name = {json.loads(m.value())["n"]: m for m in messages}
    assert set(by_name) == {"held", "behind", "free"}
    held, behind = by_name["held"], by_name["behind"]
    assert held.partition() == behind.partition()
    assert held.offset() < behind.offset()  # the key's order
    # Produced once due; Kafka stamps whole milliseconds (rounded down), so the stamp may
    # read up to 1 ms before the moment it was produced.
    assert held.timestamp()[1] / 1000 >= committed + COUNTDOWN - 0.001
