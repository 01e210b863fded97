"""A Kafka cluster for the Kafka tests, and real consumer processes on it.

Without ``KAFKA_BOOTSTRAP_SERVERS``, the cluster is librdkafka's mock cluster: a client created
with ``test.mock.num.brokers`` starts mock brokers inside this (the pytest) process, listening
on local TCP ports and speaking the Kafka protocol, consumer groups and offset commits included.
Their addresses are read back from the cluster's metadata and handed to the consumer
subprocesses, which connect to them like to any broker. The cluster lives as long as the client
that created it. It cannot create topics through the admin API: a topic springs into existence,
with 4 partitions, when a producer first asks for its metadata.

With ``KAFKA_BOOTSTRAP_SERVERS=host:port``, the same tests run against that broker, and topics
are created with the admin API (4 partitions, the broker's replication factor).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

REPO = Path(__file__).resolve().parent.parent
PARTITIONS = 4
REAL_BROKER = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "")


class Cluster:
    """A Kafka cluster: the mock one (kept alive by this object) or a real broker."""

    def __init__(self) -> None:
        self._owner: Producer | None = None
        if REAL_BROKER:
            self.bootstrap = REAL_BROKER
        else:
            self._owner = Producer({"test.mock.num.brokers": 3, "log_level": 3})
            brokers = self._owner.list_topics(timeout=10).brokers.values()
            self.bootstrap = ",".join(f"{b.host}:{b.port}" for b in brokers)
        self.producer = Producer(
            {"bootstrap.servers": self.bootstrap, "enable.idempotence": True, "acks": "all"}
        )

    @property
    def is_mock(self) -> bool:
        return self._owner is not None

    def new_topic(self, label: str) -> str:
        """A topic of its own for one test, with :data:`PARTITIONS` partitions."""
        topic = f"idem-{label}-{uuid.uuid4().hex[:8]}"
        if self.is_mock:
            self.producer.list_topics(topic, timeout=10)  # auto-created by the metadata request
        else:
            admin = AdminClient({"bootstrap.servers": self.bootstrap})
            for future in admin.create_topics([NewTopic(topic, PARTITIONS)]).values():
                future.result(30)
        return topic

    def produce(
        self,
        topic: str,
        events: Iterable[Mapping[str, Any]],
        *,
        key: Callable[[Mapping[str, Any]], str | None] = lambda event: None,
    ) -> None:
        """Produce JSON ``events``, each with its ``event_id`` (if any) in a header too, and wait
        until every one is acknowledged."""
        reports: list[Any] = []
        count = 0
        for event in events:
            headers = {"event_id": str(event["event_id"])} if "event_id" in event else {}
            self.producer.produce(
                topic,
                value=json.dumps(event).encode(),
                key=key(event),
                headers=headers,
                on_delivery=lambda err, msg: reports.append(err),
            )
            count += 1
            self.producer.poll(0)
        assert self.producer.flush(30) == 0
        errors = [err for err in reports if err is not None]
        assert len(reports) == count and not errors, errors

    def read(self, topic: str, count: int, timeout: float = 60.0) -> list[Message]:
        """The first ``count`` messages of ``topic`` (all partitions), read by a new group."""
        consumer = Consumer(
            {
                "bootstrap.servers": self.bootstrap,
                "group.id": f"reader-{uuid.uuid4().hex[:8]}",
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,
            }
        )
        consumer.subscribe([topic])
        messages: list[Message] = []
        deadline = time.monotonic() + timeout
        try:
            while len(messages) < count and time.monotonic() < deadline:
                message = consumer.poll(0.5)
                if message is not None and message.error() is None:
                    messages.append(message)
        finally:
            consumer.close()
        return messages

    def count(self, topic: str) -> int:
        """How many messages ``topic`` holds (the sum of its partitions' high watermarks)."""
        return sum(self._log_ends(topic).values())

    def backlog(self, topic: str, group: str) -> int:
        """Messages of ``topic`` whose offsets ``group`` has not committed."""
        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": group})
        try:
            partitions = [TopicPartition(topic, p) for p in range(PARTITIONS)]
            committed = consumer.committed(partitions, timeout=10)
            ends = self._log_ends(topic)
            behind = 0
            for partition in committed:
                low, _ = consumer.get_watermark_offsets(partition, timeout=10)
                behind += ends[partition.partition] - (
                    partition.offset if partition.offset >= 0 else low
                )
            return behind
        finally:
            consumer.close()

    def _log_ends(self, topic: str) -> dict[int, int]:
        """Each partition's log-end offset (the next offset to be written).

        On the mock cluster (and Kafka), the high watermark. Tansu 0.6 answers ListOffsets
        (latest) with the offset of the last message instead, one less than Kafka's log end:
        there, the messages at and past the watermark are read to find the end.
        """
        reader = Consumer(
            {
                "bootstrap.servers": self.bootstrap,
                "group.id": f"ends-{uuid.uuid4().hex[:8]}",
                "enable.auto.commit": False,
            }
        )
        try:
            ends = {
                p: reader.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                for p in range(PARTITIONS)
            }
            if self.is_mock:
                return ends
            reader.assign([TopicPartition(topic, p, ends[p]) for p in range(PARTITIONS)])
            while (message := reader.poll(1.0)) is not None:
                if message.error() is None:
                    partition, offset = message.partition(), message.offset()
                    assert partition is not None and offset is not None
                    ends[partition] = max(ends[partition], offset + 1)
            return ends
        finally:
            reader.close()

    def wait_caught_up(self, topic: str, group: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with suppress(KafkaException):
                if self.backlog(topic, group) == 0:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"group {group} still behind on {topic}")
            time.sleep(0.3)

    def close(self) -> None:
        self.producer.flush(10)
        # Dropping the last reference destroys a client (Producer.close() is only in newer
        # releases); the mock cluster goes with the client that created it.
        del self.producer
        self._owner = None


@dataclass
class ConsumerProcess:
    """One ``manage.py idempotency_consume shop.kafka`` subprocess."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float = 60.0, count: int = 1) -> None:
        deadline = time.monotonic() + timeout
        while self.output().count(text) < count:
            if self.process.poll() is not None:
                raise RuntimeError(f"consumer {self.name} exited:\n{self.output()[-6000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{text!r} not in the log of {self.name}:\n{self.output()}")
            time.sleep(0.1)

    def terminate(self, timeout: float = 90.0) -> int:
        """SIGTERM, and the exit status once it has stopped (``timeout``: a guard against a
        hang; the message in hand, the offsets' commit and leaving the group come first)."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def kill(self) -> None:
        with suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)


def manage_env(db_url: str, **extra: str) -> dict[str, str]:
    """The environment of a ``manage.py`` subprocess of the test project on the test database."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "testproject.settings",
        "DATABASE_URL": db_url,
        "PYTHONUNBUFFERED": "1",
        **extra,
    }
    env.pop("COV_CORE_SOURCE", None)  # no coverage tracing in subprocesses: it is only slower
    return env


def run_manage(env: Mapping[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``manage.py *args`` to its end; CalledProcessError if it fails."""
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=REPO,
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def consumer_env(cluster: Cluster, *, topic: str, group: str, db_url: str) -> dict[str, str]:
    """:func:`manage_env` for the ``shop.kafka`` consumer of ``topic`` in ``group``."""
    return manage_env(
        db_url,
        SHOP_KAFKA_BOOTSTRAP=cluster.bootstrap,
        SHOP_KAFKA_TOPICS=topic,
        SHOP_KAFKA_GROUP=group,
    )


def start_consumer(
    cluster: Cluster,
    *,
    topic: str,
    group: str,
    db_url: str,
    log_dir: Path,
    name: str,
    extra_env: Mapping[str, str] | None = None,
) -> ConsumerProcess:
    env = {**consumer_env(cluster, topic=topic, group=group, db_url=db_url), **(extra_env or {})}
    log = log_dir / f"{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "manage.py", "idempotency_consume", "shop.kafka"],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return ConsumerProcess(name, process, log)
