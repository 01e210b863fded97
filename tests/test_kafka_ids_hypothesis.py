"""Hypothesis at the Kafka runner's id boundary: any value, key or header, on PostgreSQL and
MariaDB.

:func:`~django_idempotency.kafka.runner.event_id_of` either refuses a message with
``MissingEventId`` (the runner dead-letters it and goes on: ``tests/test_kafka_runner_fast.py``),
or returns an id that the runner's :meth:`~ConsumerRunner.process` stores and finds again byte
for byte, applied once and skipped the second time. No other exception may leave either step:
one would be retried for ever, and stall the partition.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("confluent_kafka")

from confluent_kafka import Message

from django_idempotency.exceptions import MissingEventId
from django_idempotency.kafka.runner import ConsumerRunner, Outcome, event_id_of
from django_idempotency.kafka.settings import ConsumerSettings
from django_idempotency.models import ProcessedEvent

pytestmark = [pytest.mark.postgres, pytest.mark.mysql, pytest.mark.django_db(transaction=True)]

# Every code point, lone surrogates and NUL included.
ANY_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=300)
# Text with a lone surrogate or a NUL somewhere: rare in ANY_TEXT, so drawn on purpose too.
ODD_TEXT = st.builds(
    lambda before, odd, after: before + odd + after,
    ANY_TEXT,
    st.characters(categories=["Cs"]) | st.just("\x00"),
    ANY_TEXT,
)
JSON_IDS = st.one_of(
    ANY_TEXT,
    ODD_TEXT,
    st.integers(),
    st.none(),
    st.booleans(),
    st.floats(allow_nan=False),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(ANY_TEXT, st.integers(), max_size=2),
)
BASE = ConsumerSettings(
    name="hypothesis.kafka",
    handler="builtins.print",
    topics=("t",),
    group="g",
    config={"bootstrap.servers": "unused:9092"},
)


def message(
    value: bytes | None, headers: list[tuple[str, bytes | None]], key: bytes | None
) -> Any:
    try:
        return Message(topic="t", partition=0, offset=7, key=key, value=value, headers=headers)
    except TypeError:  # confluent-kafka before 2.4 ("cannot create 'cimpl.Message' instances")
        pytest.skip("this confluent-kafka release cannot build a Message in Python")


def check(msg: Message, consumer_settings: ConsumerSettings) -> None:
    try:
        event_id = event_id_of(msg, consumer_settings)
    except MissingEventId:
        return  # dead-lettered by the runner
    name = f"hyp-{uuid.uuid4().hex[:12]}"
    runner = ConsumerRunner(replace(consumer_settings, name=name), handler=lambda m: None)
    assert runner.process(msg) is Outcome.APPLIED
    assert runner.process(msg) is Outcome.DUPLICATE
    stored = ProcessedEvent.objects.filter(consumer=name).values_list("event_id", flat=True)
    assert list(stored) == [event_id]
    [found] = stored
    assert found.encode("utf-8") == event_id.encode("utf-8")


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(event_id=JSON_IDS, key=st.none() | st.binary(max_size=50), extra=ANY_TEXT)
def test_a_json_id_is_stored_byte_for_byte_or_refused(
    event_id: Any, key: bytes | None, extra: str
) -> None:
    value = json.dumps({"event_id": event_id, "extra": extra}).encode()
    check(message(value, [], key), replace(BASE, event_id_source="json"))


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    header=st.none()
    | st.binary(max_size=300)
    | ANY_TEXT.map(lambda t: t.encode("utf-8", "surrogatepass")),
    value=st.none() | st.binary(max_size=100),
    others=st.lists(
        st.tuples(st.text(max_size=10), st.none() | st.binary(max_size=20)), max_size=3
    ),
)
def test_a_header_id_is_stored_byte_for_byte_or_refused(
    header: bytes | None, value: bytes | None, others: list[tuple[str, bytes | None]]
) -> None:
    headers = [*others, ("event_id", header)]
    check(message(value, headers, None), BASE)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(value=st.binary(max_size=500) | st.sampled_from([b"[" * 200_000, b"{" * 100_000]))
def test_any_value_is_read_or_refused(value: bytes) -> None:
    check(message(value, [], None), replace(BASE, event_id_source="json"))
