"""A handler's ``on_commit`` callback that raises, in the Kafka runner, one message at a time
and in batch mode: the transaction committed, so the message is applied, its offset is
committed and it is not delivered again; the error is logged with the message and kept in the
event's ``last_error`` (``OnCommitFailed``). In a batch, the other messages' callbacks still
run, as they would with a transaction each. The real runner, in process, on the mock cluster
(or the broker named by ``KAFKA_BOOTSTRAP_SERVERS``), on the test database."""

from __future__ import annotations

import json
import logging
from collections import Counter
from typing import Any

import pytest

pytest.importorskip("confluent_kafka")

from confluent_kafka import Message
from django.db import transaction

from django_idempotency.kafka.runner import ConsumerRunner, Outcome
from django_idempotency.models import EventDelivery, ProcessedEvent
from testproject.shop.models import Effect
from tests.kafka_batch_helpers import RecordingRunner, topic_fixture
from tests.kafka_cluster import Cluster
from tests.test_kafka_runner_fast import (
    REGRESSION,
    committed,
    effect_ids,
    event,
    produce,
    settings_for,
)

pytestmark = [pytest.mark.timeout(120), pytest.mark.django_db(transaction=True)]


topic = topic_fixture("on-commit")


class CallbackFailed(RuntimeError):
    pass


def hooking_handler(ran: list[str]) -> Any:
    """A handler that writes its effect and registers an ``on_commit`` callback that records
    its event id; a message with ``"hook": "fail"`` registers one that raises before it."""

    def handler(message: Message) -> None:
        body = json.loads(message.value() or b"{}")
        event_id = body["event_id"]
        Effect.objects.create(name="fast", payload=event_id)
        if body.get("hook") == "fail":

            def fail() -> None:
                raise CallbackFailed(f"callback of {event_id} failed")

            transaction.on_commit(fail)
        transaction.on_commit(lambda: ran.append(event_id))

    return handler


def ids_of(values: list[bytes]) -> list[str]:
    return [json.loads(v)["event_id"] for v in values]


def failure_logs(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@REGRESSION
def test_a_failing_callback_in_a_batch_leaves_the_committed_batch_applied(
    kafka_cluster: Cluster, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: a callback that raised after the batch's COMMIT made Django skip every later
    callback of the batch (the other messages' too) and raise out of ``atomic``; the runner
    logged "batch of 4 messages rolled back, applying them one at a time" for a batch that had
    committed, met each of its messages again as a duplicate (so their handlers, and the
    skipped callbacks, never ran again), and recorded the failure nowhere. The batch is applied
    now, its offsets committed, each other message's callback run, and the failure logged and
    kept as with BATCH_SIZE=1."""
    # BATCH_SIZE=5: six messages one at a time (five, and one more to settle), then batches;
    # the failing one is the second of its batch, two messages behind it.
    values = [event() for _ in range(7)] + [event(hook="fail")] + [event() for _ in range(4)]
    produce(kafka_cluster, topic, values)
    ids = ids_of(values)
    failing = ids[7]
    ran: list[str] = []
    settings = settings_for(kafka_cluster, topic, batch_size=5, event_id_source="json")
    runner = RecordingRunner(settings, hooking_handler(ran))
    with caplog.at_level(logging.INFO, "django_idempotency"):
        runner.run(max_messages=len(values))

    logs = failure_logs(caplog)
    assert not [line for line in logs if "rolled back" in line], logs
    assert runner.counts == {Outcome.APPLIED: 12}
    assert runner.fallbacks == 0
    stamp = ProcessedEvent.objects.get(consumer=settings.name, event_id=failing).processed_at
    mates = ProcessedEvent.objects.filter(consumer=settings.name, processed_at=stamp)
    assert {ids[8], ids[9]} <= set(mates.values_list("event_id", flat=True))  # one batch
    # Every other message's callback ran, once; the failing message's later one was skipped,
    # as Django skips a transaction's later callbacks after one that raises.
    assert Counter(ran) == Counter(i for i in ids if i != failing)
    assert Counter(effect_ids()) == Counter(ids)
    [(partition, offset)] = committed(kafka_cluster, settings).items()
    assert offset == len(values)
    last_error = EventDelivery.objects.get(consumer=settings.name, event_id=failing).last_error
    assert last_error.startswith("OnCommitFailed: "), last_error
    assert f"CallbackFailed: callback of {failing} failed" in last_error
    where = f"{topic}[{partition}]@7"
    [line] = [line for line in logs if where in line]
    assert f"event {failing}" in line and "applied" in line and "offset" in line


@REGRESSION
def test_a_failing_callback_one_at_a_time_is_applied_and_not_delivered_again(
    kafka_cluster: Cluster, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: with BATCH_SIZE=1 the runner took ``OnCommitFailed`` for a failed delivery:
    it logged "delivery failed", sought back, paused the partition for RETRY_DELAY and met the
    message again as a duplicate. The message is applied: its offset is committed at once, as
    the Celery consumer acks it."""
    values = [event(), event(hook="fail"), event()]
    produce(kafka_cluster, topic, values)
    ids = ids_of(values)
    ran: list[str] = []
    settings = settings_for(kafka_cluster, topic, event_id_source="json")
    runner = ConsumerRunner(settings, hooking_handler(ran))
    with caplog.at_level(logging.INFO, "django_idempotency"):
        runner.run(max_messages=len(values))

    logs = failure_logs(caplog)
    assert runner.counts == {Outcome.APPLIED: 3}, logs
    assert not [line for line in logs if "delivery failed" in line], logs
    assert ran == [ids[0], ids[2]]
    assert Counter(effect_ids()) == Counter(ids)
    [(partition, offset)] = committed(kafka_cluster, settings).items()
    assert offset == 3
    last_error = EventDelivery.objects.get(consumer=settings.name, event_id=ids[1]).last_error
    assert last_error.startswith("OnCommitFailed: "), last_error
    where = f"{topic}[{partition}]@1"
    [line] = [line for line in logs if where in line]
    assert f"event {ids[1]}" in line and "applied" in line and "offset" in line
