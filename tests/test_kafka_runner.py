"""Proofs of the Kafka consumer runner: real client, real cluster, real consumer processes.

The cluster is librdkafka's mock cluster, started inside the pytest process (see
``tests/kafka_cluster.py``), or the broker named by ``KAFKA_BOOTSTRAP_SERVERS``. Each consumer
is a ``manage.py idempotency_consume shop.kafka`` subprocess on the test database; the handler
(``testproject/shop/kafka_handlers.py``) writes one ``Effect`` per execution, so an event
applied twice shows as two rows. Every test waits until the group has committed every offset of
its topic before it counts.
"""

from __future__ import annotations

import re
import subprocess
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

pytest.importorskip("confluent_kafka")

from django_idempotency.kafka.runner import killed_error
from django_idempotency.models import EventDelivery, ProcessedEvent
from testproject.shop.kafka_handlers import CONSUMER
from testproject.shop.models import Effect
from tests.kafka_cluster import (
    Cluster,
    ConsumerProcess,
    consumer_env,
    run_manage,
    start_consumer,
)
from tests.workers import database_url

pytestmark = [
    pytest.mark.slow,
    # PostgreSQL and MariaDB; SQLite's single writer adds nothing the runner does not show there.
    pytest.mark.postgres,
    pytest.mark.mysql,
    pytest.mark.timeout(480),  # above the sum of its guards against a hang
    pytest.mark.django_db(transaction=True),
]


@pytest.fixture
def consumers(kafka_cluster: Cluster, tmp_path: Path) -> Iterator[Any]:
    """Start consumers on one topic and group; SIGKILL whatever is left after the test."""
    started: list[ConsumerProcess] = []
    topic = kafka_cluster.new_topic("runner")
    group = f"group-{uuid.uuid4().hex[:8]}"

    def start(**env: str) -> ConsumerProcess:
        process = start_consumer(
            kafka_cluster,
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


@pytest.mark.second_broker
def test_each_event_delivered_twice_has_one_effect(kafka_cluster: Cluster, consumers: Any) -> None:
    batch = events(40)
    kafka_cluster.produce(consumers.topic, batch + batch, key=lambda e: e["event_id"])
    consumer = consumers()
    kafka_cluster.wait_caught_up(consumers.topic, consumers.group)

    assert effects() == Counter({e["event_id"]: 1 for e in batch})
    assert ProcessedEvent.objects.filter(consumer="shop.kafka").count() == 40
    assert consumer.terminate() == 0
    assert consumer.output().count("duplicate ignored") == 40
    assert "stopped: 40 applied, 40 duplicate" in consumer.output()


@pytest.mark.second_broker
def test_killed_after_the_database_commit_before_the_offset_commit(
    kafka_cluster: Cluster, consumers: Any, tmp_path: Path
) -> None:
    [paused] = events(1, behaviour="pause_after_commit")
    after = events(5)
    kafka_cluster.produce(consumers.topic, [paused, *after], key=lambda e: "one-partition")
    first = consumers(SHOP_KAFKA_PAUSE_DIR=str(tmp_path))
    marker = tmp_path / f"{paused['event_id']}.committed"
    wait_for_file(marker, first)
    first.kill()  # after COMMIT, before the offset commit

    assert effects() == Counter({paused["event_id"]: 1})
    assert kafka_cluster.backlog(consumers.topic, consumers.group) == 6  # nothing committed

    second = consumers()
    kafka_cluster.wait_caught_up(consumers.topic, consumers.group)
    assert effects() == Counter({e["event_id"]: 1 for e in [paused, *after]})
    assert second.terminate() == 0
    assert "duplicate ignored: event " + paused["event_id"] in second.output()


def test_sigterm_finishes_the_message_in_hand_and_commits_its_offset(
    kafka_cluster: Cluster, consumers: Any, tmp_path: Path
) -> None:
    [slow] = events(1, behaviour="slow")
    kafka_cluster.produce(consumers.topic, [slow])
    consumer = consumers(SHOP_KAFKA_PAUSE_DIR=str(tmp_path))
    wait_for_file(tmp_path / f"{slow['event_id']}.started", consumer)

    assert consumer.terminate() == 0  # sent while the handler sleeps in its transaction

    assert effects() == Counter({slow["event_id"]: 1})
    assert kafka_cluster.backlog(consumers.topic, consumers.group) == 0
    assert "SIGTERM: stopping after this message" in consumer.output()
    assert "stopped: 1 applied" in consumer.output()


def wait_for_file(path: Path, consumer: ConsumerProcess, timeout: float = 120.0) -> None:
    for _ in range(int(timeout * 10)):
        if path.exists():
            return
        if consumer.process.poll() is not None:
            break
        threading.Event().wait(0.1)
    raise AssertionError(f"{path.name} never appeared:\n{consumer.output()}")


@pytest.mark.second_broker
def test_poison_message_is_dead_lettered_and_the_consumer_goes_on(
    kafka_cluster: Cluster, consumers: Any
) -> None:
    [poison] = events(1, behaviour="fail")
    [flaky] = events(1, behaviour="fail_twice")
    healthy = events(5)
    no_id = {"behaviour": "none", "note": "no event id"}
    # One key, one partition: the healthy events queue up behind the poison message.
    kafka_cluster.produce(
        consumers.topic, [poison, flaky, no_id, *healthy], key=lambda e: "one-partition"
    )
    consumer = consumers()
    kafka_cluster.wait_caught_up(consumers.topic, consumers.group)

    applied = Counter({e["event_id"]: 1 for e in [flaky, *healthy]})
    assert effects() == applied  # the failures rolled their effects back
    dead = kafka_cluster.read(f"{consumers.topic}.dlq", 2)
    assert len(dead) == 2
    by_id = {dict(m.headers() or []).get("event_id"): m for m in dead}
    headers = dict(by_id[poison["event_id"].encode()].headers() or [])
    assert headers["dlq.deliveries"] == b"4"  # MAX_DELIVERIES=3, parked on the 4th
    assert headers["dlq.error"].startswith(b"RuntimeError: poison message")
    assert headers["dlq.topic"] == consumers.topic.encode()
    assert headers["dlq.consumer"] == b"shop.kafka"
    assert headers["dlq.offset"] == b"0"
    missing = dict(by_id[None].headers() or [])
    assert missing["dlq.error"].startswith(b"MissingEventId")
    assert by_id[None].value() is not None and b"no event id" in by_id[None].value()
    assert EventDelivery.objects.get(event_id=poison["event_id"]).parked_at is not None
    assert consumer.process.poll() is None  # still consuming
    assert consumer.terminate() == 0
    stopped = consumer.output().rsplit("stopped: ", 1)[1]
    assert {"6 applied", "2 dead-lettered", "5 retry"} <= set(stopped.strip().split(", "))


def until_one_survives(
    consumers: Any, applied: int, most: int = 6, status: int = -9, **env: str
) -> tuple[int, Any]:
    """Start consumers (with ``env``) one after another until one is still running once
    ``applied`` effects exist; every one before it must have died with ``status`` (SIGKILL's by
    default). Returns the deaths and the survivor."""
    for deaths in range(most):
        consumer = consumers(**env)
        # Up to 120 s for it to die or apply: a guard, its Django start alone took 11 s on CI.
        for _ in range(1200):
            if consumer.process.poll() is not None or len(effects()) >= applied:
                break
            threading.Event().wait(0.1)
        if consumer.process.poll() is None:
            return deaths, consumer
        assert consumer.process.returncode == status, consumer.output()
    raise AssertionError(f"{most} consumers died one after another")


def test_a_message_that_kills_its_consumer_is_dead_lettered_after_max_deliveries(
    kafka_cluster: Cluster, consumers: Any
) -> None:
    """A message that kills every consumer ends in the dead-letter topic, and the messages
    behind it are applied. It sits after applied messages, whose partition skips the count of
    later messages (first deliveries): its first death is not counted, but it is then the first
    message every next owner meets, so it is counted on each of them, and parked one death
    later than a killer that is the first message a consumer meets."""
    before, after = events(2), events(2)
    [killer] = events(1, behaviour="die")
    kafka_cluster.produce(
        consumers.topic, [*before, killer, *after], key=lambda e: "one-partition"
    )
    deaths, consumer = until_one_survives(consumers, applied=4)
    # The first death was a first delivery, not counted; then three counted ones (MAX_DELIVERIES
    # =3), and the fifth consumer parks it.
    assert deaths == 4
    kafka_cluster.wait_caught_up(consumers.topic, consumers.group)

    assert effects() == Counter({e["event_id"]: 1 for e in [*before, *after]})
    [dead] = kafka_cluster.read(f"{consumers.topic}.dlq", 1)
    assert dict(dead.headers() or [])["dlq.deliveries"] == b"4"
    assert dict(dead.headers() or [])["dlq.error"] == killed_error(4).encode()
    counted = dict(EventDelivery.objects.values_list("event_id", "deliveries"))
    # The first message of the first consumer, the killer, and the first message its last
    # owner met after dead-lettering it; every other one skipped its count.
    assert counted == {before[0]["event_id"]: 1, killer["event_id"]: 4, after[0]["event_id"]: 1}
    assert consumer.terminate() == 0


@pytest.mark.second_broker
def test_two_consumers_through_rebalances_apply_each_event_once(
    kafka_cluster: Cluster, consumers: Any
) -> None:
    """Offsets are committed only on a revoke or a stop here (COMMIT_INTERVAL of ten minutes),
    so every message handed over in a rebalance shows whether the revoke committed first."""
    batches = [events(60) for _ in range(3)]
    by_key = lambda e: e["event_id"]  # noqa: E731 - spread over every partition
    rarely = {"SHOP_KAFKA_COMMIT_INTERVAL": "600"}
    first = consumers(**rarely)
    kafka_cluster.produce(consumers.topic, batches[0], key=by_key)
    first.wait_for("assigned")
    wait_for_effects(60)
    second = consumers(**rarely)  # joins: every partition is revoked and shared out again
    second.wait_for("assigned")
    kafka_cluster.produce(consumers.topic, batches[1], key=by_key)
    wait_for_effects(120)
    assert first.terminate() == 0  # leaves: the second takes every partition
    kafka_cluster.produce(consumers.topic, batches[2], key=by_key)
    wait_for_effects(180)
    assert second.terminate() == 0
    assert kafka_cluster.backlog(consumers.topic, consumers.group) == 0

    assert effects() == Counter({e["event_id"]: 1 for batch in batches for e in batch})
    assert "revoked" in first.output() and second.output().count("assigned") >= 2
    # The revoked partitions' offsets were committed before they moved, so nothing came twice,
    # except from a partition whose revoke commit the coordinator refused (the mock cluster
    # sometimes answers REBALANCE_IN_PROGRESS), which the runner logs. A commit refused while
    # the partition stays is retried with the next one, and brings no duplicate.
    logs = first.output() + second.output()
    partition_of = {
        dict(m.headers() or [])["event_id"].decode(): m.partition()
        for m in kafka_cluster.read(consumers.topic, 180)
    }
    refused = {
        int(partition)
        for line in logs.splitlines()
        if "offset commit refused as the partitions were revoked" in line
        for partition in re.findall(re.escape(consumers.topic) + r"\[(\d+)\]", line)
    }
    twice = re.findall(r"duplicate ignored: event (\S+),", logs)
    assert {partition_of[event] for event in twice} <= refused, (twice, refused)


def wait_for_effects(count: int, timeout: float = 120.0) -> None:
    for _ in range(int(timeout * 10)):
        if Effect.objects.filter(name="kafka").count() >= count:
            return
        threading.Event().wait(0.1)
    raise AssertionError(f"{Effect.objects.filter(name='kafka').count()} effects, not {count}")


def test_dead_letter_replay_applies_the_event_once(
    kafka_cluster: Cluster, consumers: Any, tmp_path: Path
) -> None:
    [poison] = events(1, behaviour="fail")
    kafka_cluster.produce(consumers.topic, [poison])
    broken = consumers()
    kafka_cluster.wait_caught_up(consumers.topic, consumers.group)
    assert broken.terminate() == 0
    assert effects() == Counter()
    [dead] = kafka_cluster.read(f"{consumers.topic}.dlq", 1)

    replay = replay_command(kafka_cluster, consumers.topic, consumers.group)
    assert replay.stdout.strip().endswith("1 replayed"), replay.stdout + replay.stderr
    again = replay_command(kafka_cluster, consumers.topic, consumers.group)
    assert again.stdout.strip().endswith("nothing to replay"), again.stdout + again.stderr
    assert not EventDelivery.objects.filter(event_id=poison["event_id"]).exists()  # un-parked

    fixed = consumers(SHOP_KAFKA_FIXED="1")
    kafka_cluster.wait_caught_up(consumers.topic, consumers.group)
    assert effects() == Counter({poison["event_id"]: 1})
    # The same dead letter replayed once more, by hand: skipped as a duplicate.
    kafka_cluster.producer.produce(
        consumers.topic,
        value=dead.value(),
        headers=[(n, v) for n, v in dead.headers() or [] if not n.startswith("dlq.")],
    )
    kafka_cluster.producer.flush(10)
    kafka_cluster.wait_caught_up(consumers.topic, consumers.group)
    assert effects() == Counter({poison["event_id"]: 1})
    assert fixed.terminate() == 0
    assert "duplicate ignored: event " + poison["event_id"] in fixed.output()


def replay_command(
    kafka_cluster: Cluster, topic: str, group: str
) -> subprocess.CompletedProcess[str]:
    db_url = database_url(connection.settings_dict)
    env = consumer_env(kafka_cluster, topic=topic, group=group, db_url=db_url)
    return run_manage(env, "idempotency_consume", "--replay-dead-letters", CONSUMER)
