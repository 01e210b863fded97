"""Poison for the Kafka runner: whatever a message carries, the loop goes on.

One partition holds a poison message followed by healthy ones. Consumers
(``manage.py idempotency_consume shop.kafka`` subprocesses, ``EVENT_ID="json:event_id"``,
``MAX_DELIVERIES=3``) are started one after another until one survives; the poison message
must end on the dead-letter topic within its limit, and every healthy message be applied once.
A message that hangs its handler is ended by the runner's watchdog (``HANDLER_TIMEOUT``, short
here), and is then dead-lettered as one that kills its consumer is.
Runs on the mock cluster, or on the broker named by ``KAFKA_BOOTSTRAP_SERVERS`` (Tansu).

Each kind runs one message at a time (``BATCH_SIZE=1``) and in batch mode (``BATCH_SIZE=3``).
In batch mode the poison sits behind four warm-up messages (a new owner takes its first
``BATCH_SIZE`` messages one at a time, and one more to settle) and one healthy message, so the
first consumer meets it inside a batch; the test checks that it did, and that healthy messages
shared batches, by the reservations' ``processed_at`` (one per batch).
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections import Counter
from pathlib import Path

import pytest
from confluent_kafka import Producer
from django.db import connection

pytest.importorskip("confluent_kafka")

from django_idempotency.kafka.watchdog import HANG_EXIT_STATUS
from django_idempotency.models import ProcessedEvent
from testproject.shop.models import Effect
from tests.kafka_cluster import Cluster, ConsumerProcess, start_consumer
from tests.workers import database_url

pytestmark = [
    pytest.mark.slow,
    # The runner dead-letters the same way on every backend; PostgreSQL runs the runner's other
    # proofs too (tests/test_kafka_runner.py) and its Hypothesis test, and its pass carries most
    # of the PostgreSQL-only proofs, so this one runs in MariaDB's.
    pytest.mark.mysql,
    pytest.mark.timeout(600),  # above the sum of its guards against a hang
    pytest.mark.django_db(transaction=True),
]


def poison(kind: str) -> tuple[bytes, int, int]:
    """The poison value of ``kind``, the consumer deaths it causes, and its dead-letter
    count (0: it is not poison to the runner, and is applied like a healthy message)."""
    event_id = str(uuid.uuid4())
    if kind == "raises":
        return json.dumps({"event_id": event_id, "behaviour": "fail"}).encode(), 0, 1
    if kind == "exits":  # os._exit in the handler: counted on each consumer, parked on the 4th
        return json.dumps({"event_id": event_id, "behaviour": "exit"}).encode(), 3, 1
    if kind == "hangs":  # past HANDLER_TIMEOUT: the watchdog ends each consumer, as "exits"
        return json.dumps({"event_id": event_id, "behaviour": "hang"}).encode(), 3, 1
    if kind == "huge":  # over librdkafka's default 1 MB message.max.bytes, and it raises
        body = {"event_id": event_id, "behaviour": "fail", "pad": "x" * 1_200_000}
        return json.dumps(body).encode(), 0, 1
    if kind == "deeply-nested":
        return b"[" * 200_000, 0, 1
    if kind == "surrogate-id":
        return b'{"event_id": "\\ud800' + event_id.encode() + b'"}', 0, 1
    if kind == "nul-id":
        return b'{"event_id": "\\u0000' + event_id.encode() + b'"}', 0, 1
    if kind == "surrogate-and-nul-payload":  # a valid id: applied, the odd payload untouched
        return b'{"event_id": "' + event_id.encode() + b'", "x": "\\ud800\\u0000"}', 0, 0
    raise AssertionError(kind)


#: The exit status of a consumer the poison ended: the handler's os._exit(3), or the watchdog's.
EXIT_STATUS = {"hangs": HANG_EXIT_STATUS}


KINDS = [
    "raises",
    "exits",
    "hangs",
    "huge",
    "deeply-nested",
    "surrogate-id",
    "nul-id",
    "surrogate-and-nul-payload",
]


#: The kinds whose event id the runner cannot read: the handler never runs for them.
NO_ID = {"deeply-nested", "surrogate-id", "nul-id"}

BATCH = 3
"""``BATCH_SIZE`` of the batch mode runs."""
WARM_UP = BATCH + 1
"""Messages a new owner takes one at a time before it batches: ``BATCH_SIZE``, and one more to
settle the partition."""

MODES = [
    pytest.param(1, id="one-at-a-time"),
    # Batch mode on PostgreSQL too (the module runs in MariaDB's pass).
    pytest.param(BATCH, id="batch", marks=pytest.mark.postgres),
]


@pytest.mark.parametrize("batch_size", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_poison_is_dead_lettered_and_every_healthy_message_applied_once(
    kafka_cluster: Cluster, tmp_path: Path, kind: str, batch_size: int
) -> None:
    topic = kafka_cluster.new_topic("poison")
    group = f"group-{uuid.uuid4().hex[:8]}"
    value, deaths, dead_letters = poison(kind)
    batched = batch_size > 1
    if batched and deaths:
        # Its first death came in a batch, a first delivery, uncounted (the batch rolled back):
        # one death more before the MAX_DELIVERIES counted ones.
        deaths += 1
    # Batch mode: the warm-up and one healthy message ahead, the poison the second message of
    # its batch, and enough behind it to fill batches after the last owner's warm-up.
    ahead = WARM_UP + 1 if batched else 0
    healthy = [{"event_id": str(uuid.uuid4())} for _ in range(ahead + (8 if batched else 3))]
    bodies = [json.dumps(h).encode() for h in healthy]
    bodies.insert(ahead, value)
    producer = Producer(
        {"bootstrap.servers": kafka_cluster.bootstrap, "message.max.bytes": 4_000_000}
    )
    for body in bodies:
        producer.produce(topic, value=body, key=b"one-partition")
    assert producer.flush(30) == 0

    extra_env = {
        "SHOP_KAFKA_EVENT_ID": "json:event_id",
        "SHOP_KAFKA_BATCH_SIZE": str(batch_size),
        "SHOP_KAFKA_PROBE_DIR": str(tmp_path),
    }
    if kind == "hangs":
        # Short, so the test is; the healthy messages share it, and a fresh process's first
        # transaction at nice 19 on a loaded CI machine must not pass for a hang (2 s was tight).
        extra_env["SHOP_KAFKA_HANDLER_TIMEOUT"] = "5"
    started: list[ConsumerProcess] = []
    try:
        for _ in range(deaths + 1):
            consumer = start_consumer(
                kafka_cluster,
                topic=topic,
                group=group,
                db_url=database_url(connection.settings_dict),
                log_dir=tmp_path,
                name=f"consumer{len(started)}",
                extra_env=extra_env,
            )
            started.append(consumer)
            for _ in range(900):
                if consumer.process.poll() is not None or applied() >= len(healthy):
                    break
                threading.Event().wait(0.1)
            if consumer.process.poll() is None:
                break
            status = EXIT_STATUS.get(kind, 3)
            assert consumer.process.returncode == status, consumer.output()[-3000:]
            if kind == "hangs":
                assert "HANDLER HUNG" in consumer.output(), consumer.output()[-3000:]
        survivor = started[-1]
        assert len(started) == deaths + 1, [c.output()[-2000:] for c in started]
        kafka_cluster.wait_caught_up(topic, group, timeout=90)
        assert survivor.terminate() == 0, survivor.output()[-3000:]
    finally:
        for consumer in started:
            if consumer.process.poll() is None:
                consumer.kill()

    expected = Counter(h["event_id"] for h in healthy)
    if not dead_letters:
        expected[json.loads(value)["event_id"]] += 1
    assert effects() == expected
    dead = kafka_cluster.read(f"{topic}.dlq", 1, timeout=10 if not dead_letters else 60)
    assert [m.value() for m in dead] == [value] * dead_letters
    if kind in ("raises", "huge"):
        # Its handler ran once per counted delivery (MAX_DELIVERIES=3; the fourth is parked
        # before it runs), and in batch mode once more, in the batch that first held it, which
        # rolled back. Regression: each retry came back at the head of a batch, ran there,
        # failed and rolled the batch back again before it ran alone: six runs.
        runs = (tmp_path / f"{json.loads(value)['event_id']}.runs").read_text().split()
        assert len(runs) == 3 + batched, runs
    if batched:
        assert_met_in_a_batch(kind, value, ahead, started[0].output(), tmp_path)
        stamps = Counter(
            ProcessedEvent.objects.filter(consumer="shop.kafka").values_list(
                "processed_at", flat=True
            )
        )
        assert max(stamps.values()) >= 2, stamps  # healthy messages shared a batch


def assert_met_in_a_batch(kind: str, value: bytes, offset: int, log: str, probes: Path) -> None:
    """The first consumer met the poison (at ``offset``) inside a batch of two or more."""
    if kind in NO_ID:
        # No handler runs for it: the batch that held it failed on its id before it began.
        spans = re.findall(
            r"could not start a batch of (\d+) messages: .*?one at a time: consumer \S+, "
            r"\S+@(\d+) to \S+@(\d+)",
            log,
        )
        assert [s for s in spans if int(s[0]) >= 2 and int(s[1]) <= offset <= int(s[2])], log
        return
    runs = (probes / f"{json.loads(value)['event_id']}.runs").read_text().split()
    assert int(runs[0]) >= 2, runs  # its first execution: reserved with its batch-mates


def effects() -> Counter[str]:
    return Counter(Effect.objects.filter(name="kafka").values_list("payload", flat=True))


def applied() -> int:
    return Effect.objects.filter(name="kafka").count()
