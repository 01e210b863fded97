"""What the in-process tests of the Kafka runner's batch mode share (``tests/test_kafka_batch.py``
and ``tests/test_kafka_on_commit.py``): a topic of their own per test, and a runner that records
the SQL each batch runs and how many messages went one at a time after a batch.

Import it after ``pytest.importorskip("confluent_kafka")``: it imports the runner.
"""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import Message
from django.db import connection

from django_idempotency.kafka.runner import ConsumerRunner, Outcome
from tests.kafka_cluster import Cluster


def topic_fixture(label: str) -> Any:
    """A ``topic`` fixture: a new topic for each test, named after ``label``. A test module
    binds it at its top level: ``topic = topic_fixture("batch")``."""

    @pytest.fixture
    def topic(kafka_cluster: Cluster) -> str:
        return kafka_cluster.new_topic(label)

    return topic


class RecordingRunner(ConsumerRunner):
    """Records the SQL each batch runs (the one-at-a-time messages are not recorded)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[list[str]] = []
        self.fallbacks = 0

    def _apply_batch(self, messages: list[Message]) -> int:
        statements: list[str] = []
        self.batches.append(statements)

        def record(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
            if sql != "BEGIN":  # SQLite's, sent as a statement (psycopg and mysqlclient's not)
                statements.append(sql)
            return execute(sql, params, many, context)

        with connection.execute_wrapper(record):
            return super()._apply_batch(messages)

    def handle(self, message: Message) -> Outcome:
        if self.batches:
            self.fallbacks += 1
        return super().handle(message)
