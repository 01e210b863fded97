"""Fast proofs of the Kafka runner, for the quick suite: one per guarantee, in process.

Each test runs :class:`~django_idempotency.kafka.runner.ConsumerRunner` in this process (in a
thread where two consumers take part) on librdkafka's mock cluster (or the broker named by
``KAFKA_BOOTSTRAP_SERVERS``), on the test database, with ``run(max_messages=...)`` bounding the
loop. The hang test alone runs it in a subprocess, which its watchdog must end. The slow proofs
in ``tests/test_kafka_runner.py`` show the same guarantees with real consumer processes, SIGKILL
and rebalances between them.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import pytest

pytest.importorskip("confluent_kafka")

from confluent_kafka import Consumer, Message, Producer, TopicPartition
from django.db import connection, transaction

from django_idempotency.kafka.runner import ConsumerRunner, Outcome, killed_error
from django_idempotency.kafka.settings import ConsumerSettings
from django_idempotency.kafka.watchdog import HANG_EXIT_STATUS
from django_idempotency.models import EventDelivery, ProcessedEvent
from testproject.shop.models import Effect
from tests.kafka_cluster import Cluster, start_consumer
from tests.workers import database_url

pytestmark = [pytest.mark.timeout(120), pytest.mark.django_db(transaction=True)]
#: The quick suite keeps one test per guarantee (offset after the commit, seek-back, commit on
#: revoke; the dead letter before the offset is in tests/test_kafka_guarantees.py); the
#: regressions below each take a group join of several seconds, so they run with the slow
#: tests, on PostgreSQL and MariaDB.
T = TypeVar("T")


def REGRESSION(test: T) -> T:
    return pytest.mark.slow(pytest.mark.postgres(pytest.mark.mysql(test)))


@pytest.fixture
def topic(kafka_cluster: Cluster) -> str:
    return kafka_cluster.new_topic("fast")


def settings_for(cluster: Cluster, topic: str, **changes: Any) -> ConsumerSettings:
    config = {
        "bootstrap.servers": cluster.bootstrap,
        "session.timeout.ms": 6000,
        "heartbeat.interval.ms": 300,
    }
    base = ConsumerSettings(
        name=f"fast-{uuid.uuid4().hex[:6]}",
        handler="testproject.shop.kafka_handlers.apply",
        topics=(topic,),
        group=f"fast-{uuid.uuid4().hex[:8]}",
        config=config,
        max_deliveries=2,
        retry_delay=0.05,
        poll_timeout=0.1,
        producer_config={"bootstrap.servers": cluster.bootstrap},
    )
    return replace(base, **changes)


def produce(cluster: Cluster, topic: str, values: list[bytes], key: bytes = b"one") -> None:
    """Produce raw values, all with one key (one partition, in order), with an event id header
    taken from the JSON value where it has one."""
    reports: list[Any] = []
    for value in values:
        try:
            event_id = json.loads(value).get("event_id")
        except (ValueError, RecursionError, AttributeError):
            event_id = None
        headers = {"event_id": event_id.encode("utf-8", "surrogatepass")} if event_id else {}
        cluster.producer.produce(
            topic,
            value=value,
            key=key,
            headers=headers,
            on_delivery=lambda err, msg: reports.append(err),
        )
    assert cluster.producer.flush(30) == 0
    assert reports == [None] * len(values)


def event(**fields: Any) -> bytes:
    return json.dumps({"event_id": str(uuid.uuid4()), **fields}).encode()


def effect_ids() -> list[str]:
    return list(Effect.objects.filter(name="fast").values_list("payload", flat=True))


def recording_handler(
    seen: list[str], fail: Callable[[dict[str, Any]], bool] = lambda e: False
) -> Callable[[Message], None]:
    def handler(message: Message) -> None:
        body = json.loads(message.value() or b"{}")
        seen.append(body["event_id"])
        Effect.objects.create(name="fast", payload=body["event_id"])
        if fail(body):
            raise RuntimeError(f"failure of {body['event_id']}")

    return handler


def committed(cluster: Cluster, settings: ConsumerSettings) -> dict[int, int]:
    """The group's committed offsets, by partition (those it has committed)."""
    consumer = Consumer({"bootstrap.servers": cluster.bootstrap, "group.id": settings.group})
    try:
        wanted = [TopicPartition(settings.topics[0], p) for p in range(4)]
        return {p.partition: p.offset for p in consumer.committed(wanted, 10) if p.offset >= 0}
    finally:
        consumer.close()


def test_the_offset_is_committed_after_the_database_commit(
    kafka_cluster: Cluster, topic: str
) -> None:
    """Inside the transaction, and in its on_commit callback (after COMMIT, before the runner
    goes on), the group has committed nothing yet; after the message, its offset."""
    settings = settings_for(kafka_cluster, topic)
    produce(kafka_cluster, topic, [event()])
    observed: list[dict[int, int]] = []

    def handler(message: Message) -> None:
        Effect.objects.create(name="fast", payload="x")
        observed.append(committed(kafka_cluster, settings))
        transaction.on_commit(lambda: observed.append(committed(kafka_cluster, settings)))

    runner = ConsumerRunner(settings, handler)
    runner.run(max_messages=1)

    assert runner.counts == {Outcome.APPLIED: 1}
    assert observed == [{}, {}]
    assert sum(committed(kafka_cluster, settings).values()) == 1


def test_a_failure_seeks_back_and_the_partition_keeps_its_order(
    kafka_cluster: Cluster, topic: str
) -> None:
    """A handler that fails twice: its message comes back (seek-back), and the message behind
    it waits until it is applied; each is applied once."""
    flaky, after = event(), event()
    produce(kafka_cluster, topic, [flaky, after])
    settings = settings_for(kafka_cluster, topic, max_deliveries=5)
    seen: list[str] = []
    failures: list[str] = []

    def fail(body: dict[str, Any]) -> bool:
        if body["event_id"] == json.loads(flaky)["event_id"] and len(failures) < 2:
            failures.append(body["event_id"])
            return True
        return False

    runner = ConsumerRunner(settings, recording_handler(seen, fail))
    runner.run(max_messages=4)

    flaky_id, after_id = json.loads(flaky)["event_id"], json.loads(after)["event_id"]
    assert seen == [flaky_id, flaky_id, flaky_id, after_id]
    assert sorted(effect_ids()) == sorted([flaky_id, after_id])  # the failures rolled back
    assert runner.counts == {Outcome.RETRY: 2, Outcome.APPLIED: 2}
    assert sum(committed(kafka_cluster, settings).values()) == 2


@pytest.mark.slow  # over 5 s: kept out of make test-quick; CI runs it with the slow tests
def test_a_handler_that_hangs_ends_its_process_after_its_delivery_is_counted(
    kafka_cluster: Cluster, topic: str, tmp_path: Path
) -> None:
    """HANDLER_TIMEOUT: a handler that never returns ends the runner's process (a subprocess
    here: ``manage.py idempotency_consume``), from the watchdog thread, with one log line, as
    a handler that kills its process would. The delivery was counted before the handler, so a
    supervisor's restart redelivers it and MAX_DELIVERIES dead-letters a message that hangs
    every time (the slow proof: the ``hangs`` kind of tests/test_kafka_poison.py). Idle in its
    poll for the whole group join, far longer than the timeout, the runner was not ended."""
    hung = {"event_id": str(uuid.uuid4()), "behaviour": "hang"}
    kafka_cluster.produce(topic, [hung])
    consumer = start_consumer(
        kafka_cluster,
        topic=topic,
        group=f"hang-{uuid.uuid4().hex[:8]}",
        db_url=database_url(connection.settings_dict),
        log_dir=tmp_path,
        name="hung",
        # Short, and ample for the count and the reservation (the process's first queries).
        extra_env={"SHOP_KAFKA_HANDLER_TIMEOUT": "2"},
    )
    try:
        status = consumer.process.wait(90)
    finally:
        if consumer.process.poll() is None:
            consumer.kill()

    output = consumer.output()
    assert status == HANG_EXIT_STATUS, output[-3000:]
    [line] = [line for line in output.splitlines() if "HANDLER HUNG" in line]
    assert f"consumer shop.kafka, event {hung['event_id']}, {topic}[" in line
    assert "past HANDLER_TIMEOUT (2s)" in line
    counter = EventDelivery.objects.get(consumer="shop.kafka", event_id=hung["event_id"])
    assert (counter.deliveries, counter.parked_at) == (1, None)
    assert not Effect.objects.filter(name="kafka").exists()  # rolled back with its process


@REGRESSION
def test_a_failed_dead_letter_produce_does_not_move_the_offset(
    kafka_cluster: Cluster, topic: str
) -> None:
    """The dead-letter topic refuses the message (its brokers unreachable, a delivery report
    with an error): the message stays, nothing is committed. Once the topic takes it, it is
    dead-lettered, and only then is its offset committed."""
    produce(kafka_cluster, topic, [b'{"no": "event id"}'])
    settings = settings_for(kafka_cluster, topic)
    runner = ConsumerRunner(settings, recording_handler([]))
    runner._producer = Producer(
        {"bootstrap.servers": "127.0.0.1:1", "message.timeout.ms": 300, "log_level": 0}
    )
    runner.run(max_messages=2)

    assert runner.counts == {Outcome.RETRY: 2}
    assert committed(kafka_cluster, settings) == {}

    healthy = ConsumerRunner(settings, recording_handler([]))
    healthy.run(max_messages=1)
    assert healthy.counts == {Outcome.DEAD_LETTERED: 1}
    assert sum(committed(kafka_cluster, settings).values()) == 1
    [dead] = kafka_cluster.read(f"{topic}.dlq", 1)
    assert dead.value() == b'{"no": "event id"}'


class SilentProducer:
    """A dead-letter producer whose message is never acknowledged: produce() queues it, and
    flush() returns with it still queued and no delivery report (a broker that never
    answers, within the runner's wait)."""

    def __init__(self) -> None:
        self.produced = 0

    def produce(self, *args: Any, **kwargs: Any) -> None:
        self.produced += 1

    def flush(self, timeout: float | None = None) -> int:
        return self.produced


@REGRESSION
def test_an_unacknowledged_dead_letter_produce_does_not_move_the_offset(
    kafka_cluster: Cluster, topic: str
) -> None:
    [poison] = [event()]
    produce(kafka_cluster, topic, [poison])
    settings = settings_for(kafka_cluster, topic, max_deliveries=1)
    runner = ConsumerRunner(settings, recording_handler([], fail=lambda e: True))
    silent = SilentProducer()
    runner._producer = silent  # type: ignore[assignment]
    runner.run(max_messages=3)  # a failure, then parked twice without an acknowledgement

    assert silent.produced == 2
    assert runner.counts == {Outcome.RETRY: 3}
    assert committed(kafka_cluster, settings) == {}
    assert effect_ids() == []
    record = EventDelivery.objects.get(event_id=json.loads(poison)["event_id"])
    assert record.parked_at is not None


@REGRESSION
def test_the_dead_letter_is_acknowledged_before_the_offset_is_committed(
    kafka_cluster: Cluster, topic: str
) -> None:
    """A poison message goes to the dead-letter topic with its headers, then its offset is
    committed, and the message behind it is applied. (The quick proof, which also catches a
    dead letter whose acknowledgement is not awaited, is in tests/test_kafka_guarantees.py, on
    a mock cluster whose groups form at once; this one runs on KAFKA_BOOTSTRAP_SERVERS too.)"""
    poison, after = event(), event()
    produce(kafka_cluster, topic, [poison, after])
    settings = settings_for(kafka_cluster, topic, max_deliveries=1)
    order: list[str] = []

    class Watched(ConsumerRunner):
        def _dead_letter(self, message: Message, error: str, deliveries: int) -> Outcome:
            outcome = super()._dead_letter(message, error, deliveries)
            order.append(f"dead-lettered, committed: {committed(kafka_cluster, settings)}")
            return outcome

    poison_id = json.loads(poison)["event_id"]
    runner = Watched(settings, recording_handler([], fail=lambda e: e["event_id"] == poison_id))
    runner.run(max_messages=3)

    assert runner.counts == {Outcome.RETRY: 1, Outcome.DEAD_LETTERED: 1, Outcome.APPLIED: 1}
    assert order == ["dead-lettered, committed: {}"]
    assert sum(committed(kafka_cluster, settings).values()) == 2
    [dead] = kafka_cluster.read(f"{topic}.dlq", 1)
    headers = dict(dead.headers() or [])
    assert headers["event_id"] == poison_id.encode()
    assert headers["dlq.error"].startswith(b"RuntimeError: failure of")
    assert effect_ids() == [json.loads(after)["event_id"]]


@pytest.mark.slow  # over 5 s: kept out of make test-quick; CI runs it with the slow tests
def test_revoked_partitions_commit_their_offsets_before_they_move(
    kafka_cluster: Cluster, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    """With COMMIT_INTERVAL of ten minutes, offsets are committed only on a revoke or a stop.
    A second consumer joins: each partition it takes was committed by the first consumer's
    revoke, so it applies nothing again. The mock cluster now and then refuses a revoke's
    commit (REBALANCE_IN_PROGRESS), which the runner logs by partition: only those partitions
    may come again, as duplicates."""
    settings = settings_for(kafka_cluster, topic, commit_interval=600.0)
    values = [event() for _ in range(20)]
    for number, value in enumerate(values):
        produce(kafka_cluster, topic, [value], key=f"key-{number}".encode())
    first = ConsumerRunner(settings, recording_handler([]))
    second = ConsumerRunner(settings, recording_handler([]))
    threads = [threading.Thread(target=runner.run) for runner in (first, second)]
    with caplog.at_level(logging.INFO, "django_idempotency.kafka.runner"):
        try:
            threads[0].start()
            wait_until(lambda: len(effect_ids()) == 20)
            assert committed(kafka_cluster, settings) == {}  # the interval is long
            threads[1].start()
            wait_until(lambda: bool(second._assigned) and not first._assigned & second._assigned)
            taken = {partition for _, partition in second._assigned}
            wait_until(
                lambda: taken <= set(committed(kafka_cluster, settings)) | refused(caplog, topic)
            )
        finally:
            for runner in (first, second):
                runner.stop()
            for thread in threads:
                thread.join(30)
    refusals = refused(caplog, topic)
    assert second.counts.keys() <= {Outcome.DUPLICATE}  # nothing new was left for it
    if not refusals:
        assert Outcome.DUPLICATE not in second.counts
    # (Both stop at once, so their last commits race a rebalance: not counted here.)
    assert sorted(effect_ids()) == sorted(json.loads(v)["event_id"] for v in values)


def refused(caplog: pytest.LogCaptureFixture, topic: str) -> set[int]:
    """Partitions whose commit at a revoke the coordinator refused, as the runner logged."""
    return {
        int(partition)
        for record in caplog.records
        if "refused as the partitions were revoked" in record.getMessage()
        for partition in re.findall(re.escape(topic) + r"\[(\d+)\]", record.getMessage())
    }


def wait_until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


# --- Poison ids and values: dead-lettered, and the loop goes on ------------------------------


@REGRESSION
@pytest.mark.parametrize(
    "poison",
    [
        pytest.param(b'{"event_id": "\\ud800abc"}', id="lone-surrogate-id"),
        pytest.param(b'{"event_id": "a\\u0000b"}', id="nul-id"),
        pytest.param(json.dumps({"event_id": "x" * 256}).encode(), id="over-length-id"),
        pytest.param(b"[" * 200_000, id="deeply-nested"),
        pytest.param(b"\xff\xfe not json", id="not-json"),
    ],
)
def test_a_poison_json_id_is_dead_lettered_and_the_loop_goes_on(
    kafka_cluster: Cluster, topic: str, poison: bytes
) -> None:
    after = event()
    produce(kafka_cluster, topic, [poison, after])
    settings = settings_for(kafka_cluster, topic, event_id_source="json")
    runner = ConsumerRunner(settings, recording_handler([]))
    runner.run(max_messages=2)

    assert runner.counts == {Outcome.DEAD_LETTERED: 1, Outcome.APPLIED: 1}
    assert effect_ids() == [json.loads(after)["event_id"]]
    assert sum(committed(kafka_cluster, settings).values()) == 2
    [dead] = kafka_cluster.read(f"{topic}.dlq", 1)
    assert dead.value() == poison
    assert dict(dead.headers() or [])["dlq.error"].startswith(b"MissingEventId: ")
    assert (
        not ProcessedEvent.objects.filter(consumer=settings.name)
        .exclude(event_id=json.loads(after)["event_id"])
        .exists()
    )


def test_a_consumer_killed_by_a_message_says_so_in_dlq_error() -> None:
    """The header of a message parked without a recorded error (each delivery died with its
    consumer): the slow SIGKILL proof checks it on the dead-letter topic."""
    assert killed_error(4) == (
        "EventParked: no delivery of 4 ended; the consumer died while handling it (killed, "
        "out of memory, crashed, or hung past HANDLER_TIMEOUT)"
    )


@REGRESSION
def test_a_refused_offset_commit_is_retried_and_logged_once(
    kafka_cluster: Cluster, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A commit the coordinator refuses (here: made by a client that is not a member of the
    group while another one is) stays pending and goes with the next commit; one warning."""
    settings = settings_for(kafka_cluster, topic)
    produce(kafka_cluster, topic, [event()])
    member = ConsumerRunner(settings, recording_handler([]))
    thread = threading.Thread(target=member.run)
    thread.start()
    outsider = ConsumerRunner(settings, recording_handler([]))
    outsider._consumer = Consumer(
        {"bootstrap.servers": kafka_cluster.bootstrap, "group.id": settings.group}
    )
    try:
        wait_until(lambda: bool(member._assigned))
        outsider._done[topic, 3] = 7
        with caplog.at_level(logging.WARNING, "django_idempotency.kafka.runner"):
            outsider._commit()
            outsider._commit()
    finally:
        member.stop()
        thread.join(30)
        outsider._consumer.close()
    assert outsider._done == {(topic, 3): 7}  # kept for the next commit, not dropped
    refusals = [r for r in caplog.records if "offset commit refused" in r.getMessage()]
    assert len(refusals) == 1, [r.getMessage() for r in caplog.records]
    assert "retried with the next commit" in refusals[0].getMessage()


@REGRESSION
def test_a_retry_pauses_its_partition_and_the_others_go_on(
    kafka_cluster: Cluster, topic: str
) -> None:
    """A failed message waits out RETRY_DELAY (an hour here) with its partition paused, not in
    a sleep of the loop: the other partitions' messages are applied meanwhile, and the consumer
    keeps polling (so it stays within max.poll.interval.ms)."""
    poison = event()
    healthy = [event() for _ in range(6)]
    # The poison message on partition 0, the healthy ones on the others.
    for number, value in enumerate([poison, *healthy]):
        kafka_cluster.producer.produce(topic, value=value, partition=number % 3 + (number > 0))
    assert kafka_cluster.producer.flush(30) == 0
    poison_id = json.loads(poison)["event_id"]
    settings = settings_for(kafka_cluster, topic, retry_delay=3600.0, event_id_source="json")
    seen: list[str] = []
    runner = ConsumerRunner(
        settings, recording_handler(seen, fail=lambda e: e["event_id"] == poison_id)
    )
    thread = threading.Thread(target=runner.run)
    thread.start()
    try:
        # The poison's partition may be fetched last (CI saw the healthy ones applied first):
        # wait for both, or the check below is of a message never delivered.
        wait_until(lambda: len(effect_ids()) == len(healthy) and poison_id in seen, timeout=60)
    finally:
        runner.stop()
        thread.join(30)
    assert seen.count(poison_id) == 1  # not delivered again within the hour
    assert sorted(effect_ids()) == sorted(json.loads(v)["event_id"] for v in healthy)
    assert runner.counts == {Outcome.RETRY: 1, Outcome.APPLIED: len(healthy)}


@REGRESSION
def test_replay_idles_from_the_assignment_and_keeps_the_key_partition(
    kafka_cluster: Cluster, topic: str
) -> None:
    """The replay's idle time (here shorter than the group join) counts from the assignment,
    so it finds the waiting dead letters; each goes back to the partition its key hashes to
    under murmur2_random, the partitioner of KafkaTransport (librdkafka's default hashes
    differently)."""
    settings = settings_for(kafka_cluster, topic)
    murmur = Producer(
        {"bootstrap.servers": kafka_cluster.bootstrap, "partitioner": "murmur2_random"}
    )
    keys = [f"order-{number}".encode() for number in range(8)]
    reports: list[Any] = []
    for key in keys:
        murmur.produce(
            topic, value=event(), key=key, on_delivery=lambda err, msg: reports.append(msg)
        )
    assert murmur.flush(30) == 0
    home = {msg.key(): msg.partition() for msg in reports}
    for msg in reports:
        dead = [
            ("event_id", json.loads(msg.value())["event_id"].encode()),
            ("dlq.consumer", settings.name.encode()),
            ("dlq.topic", topic.encode()),
        ]
        murmur.produce(f"{topic}.dlq", value=msg.value(), key=msg.key(), headers=dead)
    assert murmur.flush(30) == 0

    from django_idempotency.kafka.replay import replay_dead_letters

    # Shorter than the group join (about 3 s on the mock cluster), long enough for a first fetch
    # on a loaded machine.
    counts = replay_dead_letters(settings, idle=2.0)

    assert counts == {"replayed": len(keys)}
    replayed = kafka_cluster.read(topic, 2 * len(keys))
    assert len(replayed) == 2 * len(keys)
    assert {(m.key(), m.partition()) for m in replayed} == set(home.items())
