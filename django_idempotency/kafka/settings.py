"""The ``IDEMPOTENCY["KAFKA_CONSUMERS"]`` setting: parsed and validated, without confluent-kafka.

Each entry names one consumer of :mod:`django_idempotency.kafka.runner`, run by
``manage.py idempotency_consume <name>``::

    IDEMPOTENCY = {
        "KAFKA_CONSUMERS": {
            "billing.ledger": {
                "HANDLER": "shop.handlers.apply_order_confirmed",
                "TOPICS": ["orders"],
                "GROUP": "billing",
                "CONFIG": {"bootstrap.servers": "kafka-1:9092,kafka-2:9092"},
                "EVENT_ID": "header:event_id",
            },
        },
    }

The name (``"billing.ledger"``) is the consumer's stable name in the processed-event table:
renaming it makes every event new again. This module has no import of confluent-kafka, so the
system checks can validate the setting, and say to install the extra, on any installation.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from django.core.checks import CheckMessage, Error
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

__all__ = ["PARTITIONER", "ConsumerSettings", "check_consumers", "parse_consumers"]

PARTITIONER = "murmur2_random"
"""The partitioner of every producer of this app (the outbox's ``KafkaTransport``, the runner's
dead-letter and replay producers): the Java client's key hash, so one key lands on one partition
whichever of them (or a Java producer) wrote it."""

SETTING = "KAFKA_CONSUMERS"
REQUIRED = ("HANDLER", "TOPICS", "GROUP", "CONFIG")
OPTIONAL = (
    "EVENT_ID",
    "DEAD_LETTER_TOPIC",
    "MAX_DELIVERIES",
    "RETRY_DELAY",
    "POLL_TIMEOUT",
    "COMMIT_INTERVAL",
    "BATCH_SIZE",
    "HANDLER_TIMEOUT",
)
MAX_BATCH_SIZE = 10_000
MAX_POLL_INTERVAL_MS = 300_000
"""librdkafka's default ``max.poll.interval.ms``: a consumer that does not poll for this long
leaves its group, and its partitions go to another member."""
EVENT_ID_SOURCES = ("header", "json")
RUNNER_OWNED = {
    "group.id": "set GROUP instead",
    "enable.auto.commit": "the runner commits each offset itself, after the transaction",
    "enable.auto.offset.store": "the runner stores offsets itself",
}
TOPIC_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,249}")
"""The characters and length Kafka accepts in a topic name
(``org.apache.kafka.common.internals.Topic``); :func:`is_topic_name` adds the two names it
refuses whatever their characters."""


def is_topic_name(value: object) -> bool:
    """Whether Kafka accepts ``value`` as a topic name: 1 to 249 of ``a-z A-Z 0-9 . _ -``, and
    not ``.`` or ``..``. The one test for a topic name, for the runner's settings, the Kafka
    transport and the change-capture transport alike."""
    return (
        isinstance(value, str)
        and bool(TOPIC_PATTERN.fullmatch(value))
        and value not in (".", "..")
    )


CONNECTION_PREFIXES = ("bootstrap.", "security.", "sasl.", "ssl.", "socket.", "broker.", "test.")
"""Keys of ``CONFIG`` the dead-letter producer shares with the consumer (where and how to
connect). Everything else in ``CONFIG`` is consumer-only."""


@dataclass(frozen=True)
class ConsumerSettings:
    """One validated entry of ``KAFKA_CONSUMERS``."""

    name: str
    """The consumer's stable name: the ``consumer`` of its processed-event rows."""
    handler: str
    """Dotted path to ``handler(message) -> None``."""
    topics: tuple[str, ...]
    group: str
    config: dict[str, Any]
    """librdkafka consumer properties (``bootstrap.servers`` and the like)."""
    event_id_source: str = "header"
    """``"header"`` or ``"json"``: where a message carries its event id."""
    event_id_name: str = "event_id"
    """The header's name, or the dotted path of the field in the JSON value."""
    dead_letter_topic: str = "{topic}.dlq"
    """Where poison messages go; ``{topic}`` is the topic the message came from."""
    max_deliveries: int | None = None
    """Deliveries of one event before it is dead-lettered; default ``MAX_DELIVERIES``."""
    retry_delay: float = 1.0
    """Seconds before a message whose handler failed is delivered again."""
    poll_timeout: float = 1.0
    """Seconds one poll waits: also how soon a stop request is noticed when idle."""
    commit_interval: float = 0.0
    """Seconds between offset commits; 0 commits after every message."""
    batch_size: int = 1
    """Messages of one partition applied in one database transaction (batch mode, when above
    1). One at a time (1, the default), each message has a transaction of its own, as its
    handler may assume. In batch mode up to ``BATCH_SIZE`` messages of a partition share one
    transaction, each with its own reservation (a batch's reservations are made together,
    before its first handler runs), and one offset commit follows it: far fewer commits, for
    handlers that assume no transaction of their own (their ``on_commit`` callbacks run when
    the whole batch commits, and a rollback of the batch undoes them all). A failure rolls the
    batch back and the runner applies those messages one at a time, so a poison message is
    isolated, counted and dead-lettered as with ``BATCH_SIZE=1``. A partition is batched only
    once it has applied a message since it was assigned here, so a message that kills its
    consumer is always met one at a time, counted, and parked."""
    handler_timeout: float = MAX_POLL_INTERVAL_MS / 1000
    """Seconds one message's handler (one batch's, in batch mode) may run, with its
    transaction, before the runner ends its process (``os._exit``) so that its supervisor
    restarts it; 0: no limit. Default ``max.poll.interval.ms`` of ``config``, past which Kafka
    takes the partitions away anyway. See :mod:`django_idempotency.kafka.watchdog`."""
    producer_config: dict[str, Any] = field(default_factory=dict)
    """The dead-letter producer's connection properties, taken from ``config``."""

    def dead_letter_topic_for(self, topic: str) -> str:
        return self.dead_letter_topic.format(topic=topic)


def _error(path: str, message: str) -> ImproperlyConfigured:
    return ImproperlyConfigured(f"IDEMPOTENCY[{SETTING!r}]{path} {message}")


def _non_empty_string(path: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _error(path, f"must be a non-empty string, not {value!r}.")
    return value


def _topics(path: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
        raise _error(path, f"must be a non-empty list of topic names, not {value!r}.")
    for topic in value:
        if not is_topic_name(topic):
            raise _error(path, f"holds {topic!r}, which is not a Kafka topic name.")
    return tuple(value)


def _config(path: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise _error(path, f"must be a dict of librdkafka properties, not {value!r}.")
    for key, item in value.items():
        if not isinstance(key, str) or not isinstance(item, (str, int, float, bool)):
            raise _error(path, f"holds {key!r}: {item!r}; use string keys and scalar values.")
        if key in RUNNER_OWNED:
            raise _error(path, f"sets {key!r}: remove it, {RUNNER_OWNED[key]}.")
    if not value.get("bootstrap.servers"):
        raise _error(path, "has no 'bootstrap.servers': name the brokers to connect to.")
    return dict(value)


def _event_id(path: str, value: Any) -> tuple[str, str]:
    source, _, name = value.partition(":") if isinstance(value, str) else ("", "", "")
    if source not in EVENT_ID_SOURCES or not name:
        raise _error(
            path,
            f"must be 'header:<header name>' or 'json:<field>' (a dotted path into the JSON "
            f"value), not {value!r}.",
        )
    return source, name


def _seconds(path: str, value: Any) -> float:
    """A duration in seconds: a finite number, zero or more. NaN compares false with every
    number, so it passed a plain ``value < 0`` test, and a NaN ``RETRY_DELAY`` then paused its
    partition for good (its resume time was never due); infinity did the same."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise _error(path, f"must be zero or a positive, finite number of seconds, not {value!r}.")
    return float(value)


def _max_poll_interval(path: str, config: Mapping[str, Any]) -> float:
    """``max.poll.interval.ms`` of ``config`` (librdkafka's default if unset), in seconds."""
    raw = config.get("max.poll.interval.ms", MAX_POLL_INTERVAL_MS)
    try:
        millis = float(raw) if not isinstance(raw, bool) else math.nan
    except ValueError:
        millis = math.nan
    if not math.isfinite(millis) or millis <= 0:
        raise _error(
            path, f"sets 'max.poll.interval.ms' to {raw!r}: use a positive number of milliseconds."
        )
    return millis / 1000


def _handler_timeout(path: str, value: Any, max_poll_interval: float) -> float:
    if value is None:
        return max_poll_interval
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise _error(
            path,
            f"must be a positive number of seconds a handler may run before its process is "
            f"ended, or 0 for no limit (default: CONFIG's max.poll.interval.ms, "
            f"{max_poll_interval:g}s here), not {value!r}.",
        )
    return float(value)


def _parse_one(name: Any, entry: Any) -> ConsumerSettings:
    where = f"[{name!r}]"
    if not isinstance(name, str) or not name.strip() or len(name) > 255:
        raise _error(where, "is not a consumer name: use a string of 1 to 255 characters.")
    if not isinstance(entry, Mapping):
        raise _error(where, f"must be a dict with {', '.join(REQUIRED)}, not {entry!r}.")
    unknown = set(entry) - set(REQUIRED) - set(OPTIONAL)
    if unknown:
        raise _error(
            where,
            f"has unknown key(s) {', '.join(sorted(map(str, unknown)))}; "
            f"known: {', '.join(REQUIRED + OPTIONAL)}.",
        )
    missing = [key for key in REQUIRED if key not in entry]
    if missing:
        raise _error(where, f"lacks {', '.join(missing)}.")
    config = _config(f"{where}['CONFIG']", entry["CONFIG"])
    source, id_name = _event_id(f"{where}['EVENT_ID']", entry.get("EVENT_ID", "header:event_id"))
    dead_letter = _non_empty_string(
        f"{where}['DEAD_LETTER_TOPIC']", entry.get("DEAD_LETTER_TOPIC", "{topic}.dlq")
    )
    try:
        dead_letter.format(topic="t")
    except (KeyError, IndexError, ValueError) as exc:
        raise _error(
            f"{where}['DEAD_LETTER_TOPIC']", f"may only use the {{topic}} placeholder: {exc!r}."
        ) from exc
    max_deliveries = entry.get("MAX_DELIVERIES")
    if max_deliveries is not None and (
        isinstance(max_deliveries, bool)
        or not isinstance(max_deliveries, int)
        or max_deliveries < 1
    ):
        raise _error(
            f"{where}['MAX_DELIVERIES']", f"must be a positive integer, not {max_deliveries!r}."
        )
    batch_size = entry.get("BATCH_SIZE", 1)
    if (
        isinstance(batch_size, bool)
        or not isinstance(batch_size, int)
        or not 1 <= batch_size <= MAX_BATCH_SIZE
    ):
        raise _error(
            f"{where}['BATCH_SIZE']",
            f"must be an integer from 1 (one message per transaction, the default) to "
            f"{MAX_BATCH_SIZE}, not {batch_size!r}.",
        )
    poll_timeout = _seconds(f"{where}['POLL_TIMEOUT']", entry.get("POLL_TIMEOUT", 1.0))
    if poll_timeout == 0:
        raise _error(f"{where}['POLL_TIMEOUT']", "must be longer than zero.")
    return ConsumerSettings(
        name=name,
        handler=_non_empty_string(f"{where}['HANDLER']", entry["HANDLER"]),
        topics=_topics(f"{where}['TOPICS']", entry["TOPICS"]),
        group=_non_empty_string(f"{where}['GROUP']", entry["GROUP"]),
        config=config,
        event_id_source=source,
        event_id_name=id_name,
        dead_letter_topic=dead_letter,
        max_deliveries=max_deliveries,
        retry_delay=_seconds(f"{where}['RETRY_DELAY']", entry.get("RETRY_DELAY", 1.0)),
        poll_timeout=poll_timeout,
        commit_interval=_seconds(f"{where}['COMMIT_INTERVAL']", entry.get("COMMIT_INTERVAL", 0.0)),
        batch_size=batch_size,
        handler_timeout=_handler_timeout(
            f"{where}['HANDLER_TIMEOUT']",
            entry.get("HANDLER_TIMEOUT"),
            _max_poll_interval(f"{where}['CONFIG']", config),
        ),
        producer_config={k: v for k, v in config.items() if k.startswith(CONNECTION_PREFIXES)},
    )


def parse_consumers(name: str, value: Any) -> dict[str, ConsumerSettings]:
    """Parse the whole setting (``name`` is ``"KAFKA_CONSUMERS"``); ImproperlyConfigured if bad."""
    if not isinstance(value, Mapping):
        raise _error("", f"must be a dict of consumer names to consumers, not {value!r}.")
    return {consumer: _parse_one(consumer, entry) for consumer, entry in value.items()}


def check_consumers(consumers: Mapping[str, ConsumerSettings]) -> list[CheckMessage]:
    """What the system checks add once the setting parses: the extra and the handlers."""
    if not consumers:
        return []
    messages: list[CheckMessage] = []
    try:
        import confluent_kafka  # noqa: F401
    except ImportError:
        messages.append(
            Error(
                f"IDEMPOTENCY[{SETTING!r}] is set, but confluent-kafka is not installed.",
                hint="pip install 'django-idempotency[kafka]'.",
                id="django_idempotency.E040",
            )
        )
    for settings in consumers.values():
        try:
            handler = import_string(settings.handler)
        except ImportError as exc:
            problem = f"cannot be imported: {exc}"
        else:
            problem = "" if callable(handler) else "is not callable"
        if problem:
            messages.append(
                Error(
                    f"IDEMPOTENCY[{SETTING!r}][{settings.name!r}]['HANDLER'] = "
                    f"{settings.handler!r} {problem}.",
                    hint="Point it at a function that takes one confluent_kafka.Message.",
                    id="django_idempotency.E041",
                )
            )
    return messages
