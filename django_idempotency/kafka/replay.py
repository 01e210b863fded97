"""Replaying a Kafka consumer's dead letters: ``manage.py idempotency_consume NAME
--replay-dead-letters``.

:func:`replay_dead_letters` reads the consumer's dead-letter topics in the consumer group
``<GROUP>.replay`` and puts each message back on the topic it came from. Two things can keep it
waiting, and neither may go unbounded or unsaid:

* **A dead-letter topic that does not exist** (nothing was ever dead-lettered): librdkafka never
  joins a group for topics that do not exist, so the replay used to wait for an assignment that
  never came, for two minutes. It reads the brokers' topics first, and with none of its
  dead-letter topics there, it says so and returns at once.
* **The group**: a replay that was killed stays a member of ``<GROUP>.replay`` until its session
  times out (``session.timeout.ms`` of ``CONFIG``), or, killed while the group was forming,
  until its rebalance timeout (this group's ``max.poll.interval.ms``); the next replay's
  assignment waits for it. The replay says it waits for the group, every
  :data:`WAIT_NOTICE_EVERY` seconds again, and gives up after :func:`group_wait` seconds (60
  with the defaults) with an error that says why.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from django_idempotency.conf import conf, consumer_settings
from django_idempotency.exceptions import MissingEventId
from django_idempotency.extras import missing_extra
from django_idempotency.kafka.runner import (
    DeadLetterFailed,
    _describe,
    _headers,
    _produce_durably,
    _producer_config,
    _text,
    event_id_of,
)
from django_idempotency.kafka.settings import ConsumerSettings
from django_idempotency.models import EventDelivery

try:
    from confluent_kafka import (
        Consumer,
        KafkaError,
        KafkaException,
        Message,
        Producer,
        TopicPartition,
    )
except ImportError as error:  # confluent-kafka is the "kafka" extra
    raise missing_extra("kafka", __name__) from error

__all__ = ["group_wait", "replay_dead_letters"]

logger = logging.getLogger(__name__)

SESSION_TIMEOUT_MS = 45_000
"""librdkafka's default ``session.timeout.ms``."""
REPLAY_POLL_INTERVAL_MS = 45_000
"""The replay group's ``max.poll.interval.ms`` (at least ``session.timeout.ms``, as librdkafka
requires): a replay polls again after each message, whose acknowledgement it waits for at most
``DEAD_LETTER_TIMEOUT`` + ``DEAD_LETTER_GRACE`` (35 s). It is also how long the brokers wait,
while the group forms, for a member that was killed before it joined: librdkafka's default,
five minutes, kept the next replay waiting that long."""
JOIN_MARGIN = 15.0
"""Seconds :func:`group_wait` allows the group to form once the member that held it is gone."""
METADATA_TIMEOUT = 10.0
"""Seconds to wait for the brokers' list of topics."""
WAIT_NOTICE_EVERY = 10.0
"""Seconds between two lines saying that the replay still waits for its group."""


def _millis(config: dict[str, Any], key: str, default: int) -> int:
    try:
        value = float(config.get(key, default))
    except (TypeError, ValueError):
        return default  # librdkafka refuses it when the consumer is built, and says why
    return int(value) if math.isfinite(value) and value > 0 else default


def _poll_interval_ms(settings: ConsumerSettings) -> int:
    return max(
        REPLAY_POLL_INTERVAL_MS,
        _millis(settings.config, "session.timeout.ms", SESSION_TIMEOUT_MS),
    )


def group_wait(settings: ConsumerSettings) -> float:
    """The longest a replay waits for its group to assign the dead-letter partitions, in
    seconds: the replay group's ``max.poll.interval.ms`` (45 s, or ``session.timeout.ms`` of
    ``CONFIG`` if longer), the longest an earlier replay that was killed holds the group, plus
    :data:`JOIN_MARGIN`. 60 seconds with librdkafka's defaults."""
    return _poll_interval_ms(settings) / 1000 + JOIN_MARGIN


def replay_dead_letters(
    settings: ConsumerSettings | str,
    idle: float = 5.0,
    join_timeout: float | None = None,
    echo: Callable[[str], object] | None = None,
) -> Counter[str]:
    """Put this consumer's dead-lettered messages back on their topics, once the cause is fixed.

    Reads the consumer's dead-letter topics in the group ``<GROUP>.replay`` (so each message is
    replayed once however often this runs), and for each message the consumer dead-lettered:

    1. un-parks its event (deletes its parked delivery counter), so it gets ``MAX_DELIVERIES``
       fresh deliveries;
    2. produces it, with its own key, value and headers (the ``dlq.*`` ones removed), back to the
       topic it came from, and waits for the acknowledgement;
    3. commits the dead-letter offset.

    Replayed messages are deduplicated like any other delivery: an event that was applied in the
    meantime is skipped. A message without an event id is not replayed (it would only come back):
    fix its producer and publish it again. Returns counts: ``replayed``, ``skipped`` (other
    consumers' messages) and ``no event id``; none when no dead-letter topic exists (read from
    the brokers' metadata, before joining any group). Stops after ``idle`` seconds without a
    message, timed from the assignment of the dead-letter partitions (joining the group can take
    longer than ``idle``, and would otherwise end the replay before it read anything).

    :param join_timeout: seconds to wait for the group's assignment; default
        :func:`group_wait`.
    :param echo: called with a line of progress for the operator: the wait for the group (at
        once, then every :data:`WAIT_NOTICE_EVERY` seconds), the assignment. Default: logged.
    :raises DeadLetterFailed: the brokers' topics could not be read; no partition was assigned
        within ``join_timeout``; or a message could not be put back (it stays on the
        dead-letter topic, its offset there is not committed, and the next run tries it again).
    """
    settings = consumer_settings(settings) if isinstance(settings, str) else settings
    say: Callable[[str], object] = echo or (lambda line: logger.info("%s", line))
    wanted = sorted({settings.dead_letter_topic_for(t) for t in settings.topics})
    group = f"{settings.group}.replay"
    poll_interval = _poll_interval_ms(settings)
    wait = group_wait(settings) if join_timeout is None else join_timeout
    consumer = Consumer(
        {
            "auto.offset.reset": "earliest",
            **settings.config,
            "group.id": group,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "max.poll.interval.ms": poll_interval,
        }
    )
    producer: Producer | None = None
    counts: Counter[str] = Counter()
    try:
        topics = _existing_topics(consumer, wanted)
        if not topics:
            say(f"no dead-letter topic exists ({', '.join(wanted)}): nothing was dead-lettered")
            return counts
        producer = Producer(_producer_config(settings))
        # When the group hands this consumer its partitions (an empty list, if the other
        # members hold them all); until then, no idle time counts.
        assigned: list[float] = []
        started = time.monotonic()

        def on_assign(consumer: Consumer, partitions: list[TopicPartition]) -> None:
            assigned.append(time.monotonic())
            say(
                f"group {group} assigned {_partitions(partitions)} after "
                f"{assigned[-1] - started:.1f}s"
            )

        consumer.subscribe(topics, on_assign=on_assign)
        say(f"waiting for group {group} to assign {', '.join(topics)} (at most {wait:g}s)")
        noticed = last = started
        while True:
            message = consumer.poll(min(idle, 0.5))
            now = time.monotonic()
            if message is None:
                if assigned:
                    if now - max(last, assigned[-1]) >= idle:
                        break
                    continue
                if now - started > wait:
                    raise DeadLetterFailed(
                        f"group {group} assigned no partition of {', '.join(topics)} within "
                        f"{wait:g}s: an earlier replay may still hold it (one killed holds it "
                        f"until its session times out, or up to {poll_interval / 1000:g}s if "
                        f"killed while the group formed), or the brokers are unreachable"
                    )
                if now - noticed >= WAIT_NOTICE_EVERY:
                    noticed = now
                    say(
                        f"still waiting for group {group} ({now - started:.0f}s of at most "
                        f"{wait:g}s): an earlier replay that was killed holds it until its "
                        f"session times out"
                    )
                continue
            last = now
            if message.error() is not None:
                continue
            _replay_one(settings, producer, message, counts)
            consumer.commit(message=message, asynchronous=False)
    finally:
        consumer.close()
        if producer is not None:
            producer.flush(30)
    return counts


def _existing_topics(consumer: Consumer, wanted: Sequence[str]) -> list[str]:
    """Those of ``wanted`` that exist, from the brokers' list of every topic (asking for the
    topics by name could create them, where the brokers create topics on demand)."""
    try:
        metadata = consumer.list_topics(timeout=METADATA_TIMEOUT)
    except KafkaException as exc:
        raise DeadLetterFailed(
            f"could not read the brokers' topics within {METADATA_TIMEOUT:g}s ({exc}): are "
            f"the brokers reachable?"
        ) from exc
    found = []
    for name in wanted:
        topic = metadata.topics.get(name)
        error = None if topic is None else topic.error
        if topic is not None and (
            error is None or error.code() != KafkaError.UNKNOWN_TOPIC_OR_PART
        ):
            found.append(name)
    return found


def _replay_one(
    settings: ConsumerSettings, producer: Producer, message: Message, counts: Counter[str]
) -> None:
    """Put one dead letter back (or count why not)."""
    headers = _headers(message)
    origin = {name: value for name, value in headers if name.startswith("dlq.")}
    if _text(origin.get("dlq.consumer")) != settings.name or not origin.get("dlq.topic"):
        counts["skipped"] += 1
        return
    try:
        event_id = event_id_of(message, settings)
    except MissingEventId as exc:
        logger.error("not replayed, %s: %s", _describe(message), exc)
        counts["no event id"] += 1
        return
    EventDelivery.objects.using(conf.DATABASE).filter(
        consumer=settings.name, event_id=event_id, parked_at__isnull=False
    ).delete()
    _produce_durably(
        producer,
        _text(origin.get("dlq.topic")),
        key=message.key(),
        value=message.value(),
        headers=[(n, v) for n, v in headers if not n.startswith("dlq.")],
    )
    counts["replayed"] += 1


def _partitions(partitions: Sequence[TopicPartition]) -> str:
    return ", ".join(f"{p.topic}[{p.partition}]" for p in partitions) or "no partition"
