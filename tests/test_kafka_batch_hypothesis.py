"""Hypothesis at the Kafka runner's batch boundary, on PostgreSQL and MariaDB.

A batch (:meth:`~django_idempotency.kafka.runner.ConsumerRunner._apply_batch`) reserves its
messages together (:func:`~django_idempotency.events.core.process_first_deliveries`). For any
ids, repeated within the batch, differing only by case or a trailing space, some processed
before, it must do what one message at a time would: apply each id once, in order, skip the
rest as duplicates, store every id byte for byte, and never need its one-at-a-time fallback.
"""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("confluent_kafka")

from confluent_kafka import Message
from django.utils import timezone

from django_idempotency.exceptions import MissingEventId
from django_idempotency.kafka.runner import ConsumerRunner, Outcome, event_id_of
from django_idempotency.models import ProcessedEvent
from tests.test_kafka_ids_hypothesis import BASE

pytestmark = [pytest.mark.postgres, pytest.mark.mysql, pytest.mark.django_db(transaction=True)]

ID_TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=40)


def message(event_id: str, offset: int) -> Any:
    header = event_id.encode("utf-8")
    try:
        return Message(topic="t", partition=0, offset=offset, headers=[("event_id", header)])
    except TypeError:  # confluent-kafka before 2.4 ("cannot create 'cimpl.Message' instances")
        pytest.skip("this confluent-kafka release cannot build a Message in Python")


def usable(event_id: str) -> str | None:
    try:
        return event_id_of(message(event_id, 0), BASE)
    except MissingEventId:
        return None


class NoFallback(ConsumerRunner):
    """A batch that fell back to one message at a time fails the example."""

    def handle(self, message: Message) -> Outcome:
        raise AssertionError("the batch fell back to one message at a time")


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_a_batch_applies_each_id_once_as_one_message_at_a_time_would(data: Any) -> None:
    base = data.draw(st.lists(ID_TEXT, min_size=1, max_size=6, unique=True))
    variants = (v for b in base for v in (b, b.upper(), b.lower(), b + " "))
    pool = sorted({found for v in variants if (found := usable(v)) is not None})
    if not pool:
        return
    sequence = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=30))
    before = data.draw(st.sets(st.sampled_from(pool)))
    name = f"hyp-batch-{uuid.uuid4().hex[:12]}"
    for event_id in before:
        ProcessedEvent.objects.create(consumer=name, event_id=event_id, expires_at=timezone.now())
    ran: list[str] = []

    def handler(msg: Message) -> None:
        ran.append(event_id_of(msg, BASE))

    runner = NoFallback(replace(BASE, name=name, batch_size=100), handler=handler)
    messages = [message(event_id, offset) for offset, event_id in enumerate(sequence)]
    assert runner._apply_batch(messages) == len(sequence)

    expected = [e for e in dict.fromkeys(sequence) if e not in before]
    assert ran == expected
    assert runner.counts == Counter(  # a zero count equals a missing one
        {Outcome.APPLIED: len(expected), Outcome.DUPLICATE: len(sequence) - len(expected)}
    )
    stored = ProcessedEvent.objects.filter(consumer=name).values_list("event_id", flat=True)
    assert sorted(e.encode("utf-8") for e in stored) == sorted(
        e.encode("utf-8") for e in {*before, *sequence}
    )
