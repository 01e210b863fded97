"""The KAFKA_CONSUMERS setting, its system checks, and where a message's event id is found."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
from django.core.checks import CheckMessage
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.test import override_settings

from django_idempotency.checks import check_settings
from django_idempotency.conf import consumer_settings
from django_idempotency.exceptions import MissingEventId
from django_idempotency.kafka.settings import ConsumerSettings

pytest.importorskip("confluent_kafka")
from confluent_kafka import Message

from django_idempotency.kafka.runner import event_id_of

HANDLER = "testproject.shop.kafka_handlers.apply"


def consumer(**overrides: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "HANDLER": HANDLER,
        "TOPICS": ["orders"],
        "GROUP": "billing",
        "CONFIG": {"bootstrap.servers": "127.0.0.1:9092"},
    }
    entry.update(overrides)
    return {"KAFKA_CONSUMERS": {"billing.ledger": entry}}


def ids(messages: list[CheckMessage]) -> list[str | None]:
    return [message.id for message in messages]


def test_a_valid_consumer_parses_with_its_defaults() -> None:
    with override_settings(IDEMPOTENCY=consumer()):
        assert check_settings() == []
        settings = consumer_settings("billing.ledger")
    assert settings.topics == ("orders",)
    assert (settings.event_id_source, settings.event_id_name) == ("header", "event_id")
    assert settings.dead_letter_topic_for("orders") == "orders.dlq"
    assert settings.producer_config == {"bootstrap.servers": "127.0.0.1:9092"}


@pytest.mark.parametrize(
    ("overrides", "text"),
    [
        ({"TOPICS": "orders"}, "non-empty list of topic names"),
        ({"TOPICS": ["bad topic"]}, "not a Kafka topic name"),
        # Kafka's characters, but two names it refuses: they passed before is_topic_name().
        ({"TOPICS": [".."]}, "not a Kafka topic name"),
        ({"TOPICS": ["orders", "."]}, "not a Kafka topic name"),
        ({"GROUP": ""}, "non-empty string"),
        ({"CONFIG": {}}, "bootstrap.servers"),
        ({"CONFIG": {"bootstrap.servers": "b:9092", "group.id": "x"}}, "set GROUP instead"),
        ({"CONFIG": {"bootstrap.servers": "b:9092", "enable.auto.commit": True}}, "commits"),
        ({"EVENT_ID": "payload:event_id"}, "'header:<header name>' or 'json:<field>'"),
        ({"EVENT_ID": "header:"}, "'header:<header name>'"),
        ({"DEAD_LETTER_TOPIC": "{partition}.dlq"}, "{topic} placeholder"),
        ({"MAX_DELIVERIES": 0}, "positive integer"),
        ({"POLL_TIMEOUT": 0}, "longer than zero"),
        ({"RETRY_DELAY": -1}, "zero or a positive, finite number"),
        ({"COMMIT_INTERVAL": "5"}, "zero or a positive, finite number"),
        # NaN and infinity passed a plain `value < 0`: a NaN RETRY_DELAY paused its partition
        # for good (regression of issue 35, item 6).
        ({"RETRY_DELAY": float("nan")}, "['RETRY_DELAY'] must be zero or a positive, finite"),
        ({"RETRY_DELAY": float("inf")}, "['RETRY_DELAY'] must be zero or a positive, finite"),
        ({"POLL_TIMEOUT": float("nan")}, "['POLL_TIMEOUT'] must be zero or a positive, finite"),
        ({"POLL_TIMEOUT": float("inf")}, "['POLL_TIMEOUT'] must be zero or a positive, finite"),
        ({"COMMIT_INTERVAL": float("nan")}, "['COMMIT_INTERVAL'] must be zero or a positive"),
        ({"COMMIT_INTERVAL": float("-inf")}, "['COMMIT_INTERVAL'] must be zero or a positive"),
        ({"COMMIT_INTERVAL": float("inf")}, "['COMMIT_INTERVAL'] must be zero or a positive"),
        ({"TOPIC": ["orders"]}, "unknown key(s) TOPIC"),
        ({"HANDLER_TIMEOUT": -1}, "positive number of seconds a handler may run"),
        ({"HANDLER_TIMEOUT": "30"}, "or 0 for no limit (default: CONFIG's max.poll.interval"),
        ({"HANDLER_TIMEOUT": True}, "or 0 for no limit"),
        ({"HANDLER_TIMEOUT": float("inf")}, "or 0 for no limit"),
        ({"HANDLER_TIMEOUT": float("nan")}, "or 0 for no limit"),
        (
            {"CONFIG": {"bootstrap.servers": "b:9092", "max.poll.interval.ms": "soon"}},
            "'max.poll.interval.ms' to 'soon': use a positive number of milliseconds",
        ),
        (
            {"CONFIG": {"bootstrap.servers": "b:9092", "max.poll.interval.ms": 0}},
            "positive number of milliseconds",
        ),
    ],
)
def test_each_mistake_is_e002_and_says_what_to_change(
    overrides: dict[str, Any], text: str
) -> None:
    with override_settings(IDEMPOTENCY=consumer(**overrides)):
        messages = check_settings()
        with pytest.raises(ImproperlyConfigured, match="KAFKA_CONSUMERS"):
            consumer_settings("billing.ledger")
    assert ids(messages) == ["django_idempotency.E002"]
    assert "KAFKA_CONSUMERS" in messages[0].msg
    assert text in messages[0].msg


@pytest.mark.parametrize(
    ("overrides", "seconds"),
    [
        ({}, 300.0),  # librdkafka's default max.poll.interval.ms
        ({"HANDLER_TIMEOUT": None}, 300.0),
        ({"CONFIG": {"bootstrap.servers": "b:9092", "max.poll.interval.ms": 600_000}}, 600.0),
        ({"CONFIG": {"bootstrap.servers": "b:9092", "max.poll.interval.ms": "90000"}}, 90.0),
        ({"HANDLER_TIMEOUT": 30}, 30.0),
        ({"HANDLER_TIMEOUT": 0.5}, 0.5),
        ({"HANDLER_TIMEOUT": 0}, 0.0),  # no watchdog
    ],
)
def test_the_handler_timeout_defaults_to_the_max_poll_interval(
    overrides: dict[str, Any], seconds: float
) -> None:
    with override_settings(IDEMPOTENCY=consumer(**overrides)):
        assert check_settings() == []
        assert consumer_settings("billing.ledger").handler_timeout == seconds


def test_a_missing_required_key_is_named() -> None:
    setting = consumer()
    del setting["KAFKA_CONSUMERS"]["billing.ledger"]["GROUP"]
    with override_settings(IDEMPOTENCY=setting):
        [message] = check_settings()
    assert message.id == "django_idempotency.E002"
    assert "lacks GROUP" in message.msg


def test_a_handler_that_cannot_be_imported_is_e031() -> None:
    with override_settings(IDEMPOTENCY=consumer(HANDLER="testproject.shop.nowhere.apply")):
        [message] = check_settings()
    assert message.id == "django_idempotency.E041"
    assert "testproject.shop.nowhere.apply" in message.msg


def test_without_confluent_kafka_installed_the_check_is_e030(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "confluent_kafka", None)  # import raises ImportError
    with override_settings(IDEMPOTENCY=consumer()):
        messages = check_settings()
    assert ids(messages) == ["django_idempotency.E040"]
    assert "django-idempotency[kafka]" in (messages[0].hint or "")


def test_an_unknown_consumer_name_lists_the_known_ones() -> None:
    with (
        override_settings(IDEMPOTENCY=consumer()),
        pytest.raises(ImproperlyConfigured, match=r"'billing\.ledger'"),
    ):
        consumer_settings("billing")


def settings_for(event_id: str) -> ConsumerSettings:
    return ConsumerSettings(
        name="c",
        handler=HANDLER,
        topics=("t",),
        group="g",
        config={"bootstrap.servers": "b:9092"},
        event_id_source=event_id.split(":")[0],
        event_id_name=event_id.split(":", 1)[1],
    )


def message(value: bytes = b"{}", headers: list[tuple[str, bytes]] | None = None) -> Any:
    """A real Message built in Python; None where the installed confluent-kafka cannot."""
    try:
        return Message(topic="t", partition=0, offset=3, value=value, headers=headers or [])
    except TypeError:
        return None


def built(msg: Message | None) -> Message:
    if msg is None:
        pytest.skip("this confluent-kafka release cannot build a Message in Python")
    return msg


@pytest.mark.parametrize(
    ("source", "msg", "expected"),
    [
        ("header:event_id", message(headers=[("event_id", b"e-1")]), "e-1"),
        ("header:x-id", message(headers=[("x-id", b"a"), ("x-id", b"b")]), "b"),
        ("json:event_id", message(b'{"event_id": "e-2"}'), "e-2"),
        ("json:meta.id", message(b'{"meta": {"id": 42}}'), "42"),
    ],
)
def test_the_event_id_is_found_where_the_settings_say(
    source: str, msg: Message, expected: str
) -> None:
    assert event_id_of(built(msg), settings_for(source)) == expected


@pytest.mark.parametrize(
    ("source", "msg", "text"),
    [
        ("header:event_id", message(), "no event id"),
        ("header:event_id", message(headers=[("event_id", b"\xff")]), "not UTF-8"),
        ("header:event_id", message(headers=[("event_id", b" ")]), "not valid"),
        ("json:event_id", message(b"not json"), "not JSON"),
        ("json:event_id", message(b'{"event_id": null}'), "no event id"),
        ("json:meta.id", message(b'{"meta": "flat"}'), "no event id"),
        ("json:event_id", message(b'{"event_id": true}'), "not valid"),
    ],
)
def test_a_missing_or_bad_event_id_is_missing_event_id(
    source: str, msg: Message, text: str
) -> None:
    with pytest.raises(MissingEventId, match=text):
        event_id_of(built(msg), settings_for(source))


def test_the_guides_consumer_setting_is_valid() -> None:
    guide = (Path(__file__).resolve().parent.parent / "docs" / "kafka.md").read_text()
    [block] = [
        b for b in re.findall(r"```python[^\n]*\n(.*?)```", guide, re.S) if "KAFKA_CONSUMERS" in b
    ]
    namespace: dict[str, Any] = {}
    exec(block, namespace)
    with override_settings(IDEMPOTENCY=namespace["IDEMPOTENCY"]):
        messages = check_settings()
        assert consumer_settings("billing.ledger").group == "billing"
    # Only the guide's own handler module is missing here.
    assert ids(messages) == ["django_idempotency.E041"]


def test_the_command_names_the_known_consumers_when_asked_for_another() -> None:
    with (
        override_settings(IDEMPOTENCY=consumer()),
        pytest.raises(CommandError, match=r"No Kafka consumer named 'billing'.*'billing\.ledger'"),
    ):
        call_command("idempotency_consume", "billing")
