"""Proofs of the Kafka consumer runner: real client, real cluster, real consumer processes.

The cluster is librdkafka's mock cluster, started inside the pytest process (see
``tests/kafka_cluster.py``), or the broker named by ``KAFKA_BOOTSTRAP_SERVERS``. Each consumer
is a ``manage.py idempotency_consume shop.kafka`` subprocess on the test database; the handler
(``testproject/shop/kafka_handlers.py``) writes one ``Effect`` per execution, so an event
applied twice shows as two rows. Every test waits until the group has committed every offset of
its topic before it counts.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from django_idempotency.models import EventDelivery, ProcessedEvent
from testproject.shop.models import Effect
from tests.kafka_cluster import Cluster, ConsumerProcess, start_consumer
from tests.workers import database_url

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.django_db(transaction=True),
]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    kafka = Cluster()
    yield kafka
    kafka.close()


@pytest.fixture
def consumers(
    cluster: Cluster, tmp_path: Path
) -> Iterator[Any]:
    """Start consumers on one topic and group; SIGKILL whatever is left after the test."""
    started: list[ConsumerProcess] = []
    topic = cluster.new_topic("runner")
    group = f"group-{uuid.uuid4().hex[:8]}"

    def start(**env: str) -> ConsumerProcess:
        process = start_consumer(
            cluster,
            topic=topic,
            group=group,
            db_url=database_url(connection.settings_dict),
            log_dir=tmp_path,
            name=f"consumer{len(started)}",
            extra_env=env,
        )
        started.append(process)
        return process

    start.topic = topic  # type: ignore[attr-defined]
    start.group = group  # type: ignore[attr-defined]
    yield start
    for process in started:
        if process.process.poll() is None:
            process.kill()


def events(count: int, **fields: Any) -> list[dict[str, Any]]:
    return [{"event_id": str(uuid.uuid4()), **fields} for _ in range(count)]


def effects() -> Counter[str]:
    return Counter(Effect.objects.filter(name="kafka").values_list("payload", flat=True))


def test_each_event_delivered_twice_has_one_effect(cluster: Cluster, consumers: Any) -> None:
    batch = events(40)
    cluster.produce(consumers.topic, batch + batch, key=lambda e: e["event_id"])
    consumer = consumers()
    cluster.wait_caught_up(consumers.topic, consumers.group)

    assert effects() == Counter({e["event_id"]: 1 for e in batch})
    assert ProcessedEvent.objects.filter(consumer="shop.kafka").count() == 40
    assert consumer.terminate() == 0
    assert consumer.output().count("duplicate ignored") == 40
    assert "stopped: 40 applied, 40 duplicate" in consumer.output()


def test_killed_after_the_database_commit_before_the_offset_commit(
    cluster: Cluster, consumers: Any, tmp_path: Path
) -> None:
    [paused] = events(1, behaviour="pause_after_commit")
    after = events(5)
    cluster.produce(consumers.topic, [paused, *after], key=lambda e: "one-partition")
    first = consumers(SHOP_KAFKA_PAUSE_DIR=str(tmp_path))
    marker = tmp_path / f"{paused['event_id']}.committed"
    first.wait_for("assigned")
    deadline_output = ""
    for _ in range(300):
        if marker.exists():
            break
        threading.Event().wait(0.1)
    else:
        deadline_output = first.output()
    assert marker.exists(), deadline_output
    first.kill()  # after COMMIT, before the offset commit

    assert effects() == Counter({paused["event_id"]: 1})
    assert cluster.backlog(consumers.topic, consumers.group) == 6  # nothing committed

    second = consumers()
    cluster.wait_caught_up(consumers.topic, consumers.group)
    assert effects() == Counter({e["event_id"]: 1 for e in [paused, *after]})
    assert second.terminate() == 0
    assert "duplicate ignored: event " + paused["event_id"] in second.output()
