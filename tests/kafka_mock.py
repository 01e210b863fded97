"""librdkafka's mock cluster, driven through librdkafka's own C API, for the quick Kafka tests.

:class:`tests.kafka_cluster.Cluster` starts the mock cluster with ``test.mock.num.brokers``, the
one switch confluent-kafka exposes: its brokers take about three seconds to form a consumer
group (the ``group.initial.rebalance.delay.ms`` of a real broker), and nothing can make them
fail. librdkafka exports the whole mock API (``rdkafka_mock.h``) from the library confluent-kafka
ships with, so :class:`MockCluster` calls it with :mod:`ctypes`: its groups form at once, and a
test can make a broker refuse requests (:meth:`MockCluster.refuse`), as an ACL or a full disk
would. Its brokers listen on local TCP ports and speak the Kafka protocol, like the others.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import json
import os
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import confluent_kafka
from confluent_kafka import Consumer, Message, Producer, TopicPartition

PRODUCE = 0
"""The Kafka protocol's ApiKey of a Produce request."""
TOPIC_AUTHORIZATION_FAILED = 29
"""The broker's answer to a client the topic's ACLs do not allow: a permanent refusal."""
NOT_ENOUGH_REPLICAS = 19
"""Too few in-sync replicas for ``acks=all``: a refusal the producer retries until the message
times out."""
PARTITIONS = 4


def _library() -> ctypes.CDLL:
    """The librdkafka that confluent-kafka loaded: the wheel's own copy, or the system's."""
    package = os.path.dirname(confluent_kafka.__file__)
    candidates = [
        *glob.glob(os.path.join(os.path.dirname(package), "confluent_kafka.libs", "librdkafka*")),
        *glob.glob(os.path.join(package, ".dylibs", "librdkafka*")),
    ]
    found = ctypes.util.find_library("rdkafka")
    if found:
        candidates.append(found)
    if not candidates:
        raise RuntimeError("librdkafka not found next to confluent_kafka nor on the system")
    lib = ctypes.CDLL(candidates[0])
    pointer = ctypes.c_void_p
    signatures: dict[str, tuple[list[Any], Any]] = {
        "rd_kafka_conf_new": ([], pointer),
        "rd_kafka_conf_set": (
            [pointer, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t],
            ctypes.c_int,
        ),
        "rd_kafka_new": ([ctypes.c_int, pointer, ctypes.c_char_p, ctypes.c_size_t], pointer),
        "rd_kafka_destroy": ([pointer], None),
        "rd_kafka_mock_cluster_new": ([pointer, ctypes.c_int], pointer),
        "rd_kafka_mock_cluster_destroy": ([pointer], None),
        "rd_kafka_mock_cluster_bootstraps": ([pointer], ctypes.c_char_p),
        "rd_kafka_mock_group_initial_rebalance_delay_ms": ([pointer, ctypes.c_int32], None),
        "rd_kafka_mock_topic_create": (
            [pointer, ctypes.c_char_p, ctypes.c_int, ctypes.c_int],
            ctypes.c_int,
        ),
        "rd_kafka_mock_push_request_errors_array": (
            [pointer, ctypes.c_int16, ctypes.c_size_t, ctypes.POINTER(ctypes.c_int)],
            None,
        ),
        "rd_kafka_mock_clear_request_errors": ([pointer, ctypes.c_int16], None),
        "rd_kafka_mock_broker_set_down": ([pointer, ctypes.c_int32], ctypes.c_int),
        "rd_kafka_mock_broker_set_up": ([pointer, ctypes.c_int32], ctypes.c_int),
    }  # fmt: skip
    for name, (arguments, result) in signatures.items():
        if name in OPTIONAL and not hasattr(lib, name):
            continue
        function = getattr(lib, name)
        function.argtypes, function.restype = arguments, result
    return lib


#: Functions an older librdkafka lacks (2.3, the lowest confluent-kafka, has no
#: ``rd_kafka_mock_group_initial_rebalance_delay_ms``): the mock's groups then form after its
#: fixed 3 s delay, and a test that sets the delay skips (``MockCluster.sets_rebalance_delay``).
OPTIONAL = {"rd_kafka_mock_group_initial_rebalance_delay_ms"}


class MockCluster:
    """A mock cluster of ``brokers`` brokers whose consumer groups form at once.

    It lives until :meth:`close`, inside this process (librdkafka's threads serve it).
    """

    def __init__(self, brokers: int = 3) -> None:
        self._lib = lib = _library()
        error = ctypes.create_string_buffer(512)
        conf = lib.rd_kafka_conf_new()
        lib.rd_kafka_conf_set(conf, b"log_level", b"0", error, len(error))
        self._client = lib.rd_kafka_new(0, conf, error, len(error))  # 0: a producer handle
        if not self._client:
            raise RuntimeError(f"rd_kafka_new: {error.value.decode()}")
        self._cluster = lib.rd_kafka_mock_cluster_new(self._client, brokers)
        if not self._cluster:
            lib.rd_kafka_destroy(self._client)
            raise RuntimeError("rd_kafka_mock_cluster_new failed")
        self.bootstrap: str = lib.rd_kafka_mock_cluster_bootstraps(self._cluster).decode()
        self.brokers = brokers
        self.sets_rebalance_delay = hasattr(lib, "rd_kafka_mock_group_initial_rebalance_delay_ms")
        if self.sets_rebalance_delay:
            self.rebalance_delay(0)

    def rebalance_delay(self, millis: int) -> None:
        """How long a new consumer group waits for more members before its first assignment
        (a real broker's ``group.initial.rebalance.delay.ms``; librdkafka's mock: 3000)."""
        self._lib.rd_kafka_mock_group_initial_rebalance_delay_ms(self._cluster, millis)

    def new_topic(self, label: str, partitions: int = PARTITIONS) -> str:
        topic = f"idem-{label}-{uuid.uuid4().hex[:8]}"
        self.create_topic(topic, partitions)
        return topic

    def create_topic(self, topic: str, partitions: int = PARTITIONS) -> None:
        code = self._lib.rd_kafka_mock_topic_create(self._cluster, topic.encode(), partitions, 1)
        if code:
            raise RuntimeError(f"rd_kafka_mock_topic_create({topic!r}): error {code}")

    def refuse(self, api_key: int, *errors: int) -> None:
        """The next ``len(errors)`` requests of ``api_key``, to any broker, are answered with
        these error codes, in order."""
        codes = (ctypes.c_int * len(errors))(*errors)
        self._lib.rd_kafka_mock_push_request_errors_array(
            self._cluster, api_key, len(errors), codes
        )

    def down(self) -> None:
        """Every broker drops its connections and takes no new ones, as hosts that cannot be
        reached; :meth:`up` brings them back."""
        for broker in range(1, self.brokers + 1):
            code = self._lib.rd_kafka_mock_broker_set_down(self._cluster, broker)
            if code:
                raise RuntimeError(f"rd_kafka_mock_broker_set_down({broker}): error {code}")

    def up(self) -> None:
        for broker in range(1, self.brokers + 1):
            code = self._lib.rd_kafka_mock_broker_set_up(self._cluster, broker)
            if code:
                raise RuntimeError(f"rd_kafka_mock_broker_set_up({broker}): error {code}")

    def clear(self, api_key: int) -> None:
        """Forget the refusals of ``api_key`` not yet answered."""
        self._lib.rd_kafka_mock_clear_request_errors(self._cluster, api_key)

    def produce(self, topic: str, values: Sequence[bytes], key: bytes | None = b"one") -> None:
        """Produce ``values`` in order, all with ``key`` (one partition), each with its JSON
        ``event_id`` (if it has one) in an ``event_id`` header too; wait until all are
        acknowledged."""
        producer = Producer({"bootstrap.servers": self.bootstrap, "log_level": 0})
        reports: list[Any] = []
        for value in values:
            try:
                event_id = json.loads(value).get("event_id")
            except (ValueError, AttributeError):
                event_id = None
            producer.produce(
                topic,
                value=value,
                key=key,
                headers={"event_id": event_id} if event_id else {},
                on_delivery=lambda error, message: reports.append(error),
            )
        assert producer.flush(30) == 0
        # Each `is None`: comparing a KafkaError with None (`== [None]`) leaves a stray
        # TypeError behind in confluent-kafka 2.16.
        assert len(reports) == len(values) and all(r is None for r in reports), reports

    def read(self, topic: str, timeout: float = 10.0) -> list[Message]:
        """Every message ``topic`` holds, read without a consumer group (assigned partitions)."""
        reader = Consumer(
            {"bootstrap.servers": self.bootstrap, "group.id": "unused", "log_level": 0}
        )
        try:
            metadata = reader.list_topics(topic, timeout=timeout).topics[topic]
            ends = {
                p: reader.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout)[1]
                for p in metadata.partitions
            }
            wanted = sum(ends.values())
            reader.assign([TopicPartition(topic, p, 0) for p in metadata.partitions])
            messages: list[Message] = []
            deadline = time.monotonic() + timeout
            while len(messages) < wanted and time.monotonic() < deadline:
                message = reader.poll(0.2)
                if message is not None and message.error() is None:
                    messages.append(message)
            return messages
        finally:
            reader.close()

    def committed(self, group: str, topic: str) -> dict[int, int]:
        """``group``'s committed offsets of ``topic``, by partition (those it committed)."""
        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": group})
        try:
            partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
            wanted = [TopicPartition(topic, p) for p in partitions]
            return {p.partition: p.offset for p in consumer.committed(wanted, 10) if p.offset >= 0}
        finally:
            consumer.close()

    def close(self) -> None:
        if self._cluster:
            self._lib.rd_kafka_mock_cluster_destroy(self._cluster)
            self._lib.rd_kafka_destroy(self._client)
            self._cluster = self._client = None


@contextmanager
def mock_cluster(brokers: int = 3) -> Iterator[MockCluster]:
    cluster = MockCluster(brokers)
    try:
        yield cluster
    finally:
        cluster.close()
