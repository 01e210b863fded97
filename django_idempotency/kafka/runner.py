"""Kafka, on confluent-kafka: an idempotent consumer runner and an outbox transport.

Install the extra: ``pip install 'django-idempotency[kafka]'``. See ``docs/kafka.md``.

:class:`ConsumerRunner` is the consumer loop Django teams write by hand, as a thin adapter over
:func:`django_idempotency.events.core.process_event`. For each message it

1. finds the event id (a header by default, or a field of the JSON value);
2. runs the handler in ``transaction.atomic`` together with the processed-event reservation,
   after counting the delivery (the core does both, and skips a duplicate). Once a partition
   has applied a message, its later messages are first deliveries, which skip the count (see
   :meth:`ConsumerRunner.process`);
3. commits the message's offset synchronously, only once that transaction has committed (at
   once by default; every ``COMMIT_INTERVAL`` seconds if set, and always before its partitions
   are revoked and before it stops).

A crash between 2 and 3 redelivers the message, and its reservation skips it. A handler that
raises rolls back, and the message is delivered again after ``RETRY_DELAY``; once the event has
been delivered more than ``MAX_DELIVERIES`` times the core parks it, and the runner produces the
message to the dead-letter topic, with its headers, the error and the delivery count, then moves
the offset on. A message without a usable event id goes to the dead-letter topic at once. A
handler (or a batch) that runs past ``HANDLER_TIMEOUT`` ends the process, as a crash would (see
:mod:`~django_idempotency.kafka.watchdog`): a message that hangs every time is counted on each
consumer it hangs, and dead-lettered like one that kills them.

:class:`KafkaTransport` sends outbox messages with an idempotent producer (``acks=all``), keyed
by the ordering key (a key-hash partitioner), with the event id in an ``event_id`` header.

Why this module is long: the poll loop, its rebalance callbacks and the offset bookkeeping
share one consumer's state, and each guarantee (offset after the commit, the dead letter before
the offset) spans them.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError, close_old_connections, transaction
from django.utils.module_loading import import_string

from django_idempotency import telemetry
from django_idempotency.conf import conf, consumer_settings
from django_idempotency.events.core import (
    normalize_event_id,
    process_event,
    process_first_deliveries,
)
from django_idempotency.exceptions import EventParked, MissingEventId, OnCommitFailed, log_text
from django_idempotency.extras import missing_extra
from django_idempotency.kafka.settings import PARTITIONER, ConsumerSettings
from django_idempotency.kafka.watchdog import Watchdog
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

__all__ = [
    "DEAD_LETTER_HEADERS",
    "ConsumerRunner",
    "DeadLetterFailed",
    "Outcome",
    "event_id_of",
]

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)

Handler = Callable[[Message], object]

DEAD_LETTER_HEADERS = (
    "dlq.error",
    "dlq.deliveries",
    "dlq.consumer",
    "dlq.group",
    "dlq.topic",
    "dlq.partition",
    "dlq.offset",
)
"""Headers a dead-lettered message carries besides its own: what failed, how often, and where
the message came from."""


class Outcome(Enum):
    """What the runner did with one message."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"
    DEAD_LETTERED = "dead-lettered"
    RETRY = "retry"
    """Nothing was applied and the offset stays: the message is delivered again."""


class DeadLetterFailed(Exception):
    """The dead-letter topic did not acknowledge a message; its offset is not committed."""


DEAD_LETTER_TIMEOUT = 30.0
"""Seconds librdkafka may try a dead-lettered (or replayed) message (``message.timeout.ms`` of
the dead-letter producer)."""
DEAD_LETTER_GRACE = 5.0
"""Seconds more the runner waits for that message's delivery report (librdkafka times messages
out about once a second) before it counts the dead letter as failed."""


# --- Event ids ----------------------------------------------------------------------------------


def event_id_of(message: Message, settings: ConsumerSettings) -> str:
    """The message's event id, where ``settings`` say it is; MissingEventId if absent or bad."""
    where = f"{settings.event_id_source}:{settings.event_id_name}"
    if settings.event_id_source == "header":
        raw: Any = None
        for name, value in _headers(message):
            if name == settings.event_id_name:
                raw = value
        if isinstance(raw, bytes):
            try:
                raw = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise MissingEventId(f"The {where} header is not UTF-8: {raw[:40]!r}.") from exc
    else:
        try:
            raw = json.loads(message.value() or b"")
        except ValueError as exc:
            raise MissingEventId(f"The value is not JSON, so it has no {where}: {exc}.") from exc
        except RecursionError as exc:
            # json.loads recurses once per nesting level: 200,000 "[" end in RecursionError,
            # which is a value the runner refuses like any other unreadable one.
            raise MissingEventId(f"The value is nested too deeply to read its {where}.") from exc
        for part in settings.event_id_name.split("."):
            raw = raw.get(part) if isinstance(raw, Mapping) else None
        if isinstance(raw, int) and not isinstance(raw, bool):
            raw = str(raw)
    if raw is None:
        raise MissingEventId(f"The message has no event id ({where}).")
    try:
        event_id = normalize_event_id(raw)
        _storable(event_id)
    except (TypeError, ValueError) as exc:
        raise MissingEventId(f"The event id ({where}) is not valid: {exc}") from exc
    return event_id


def _storable(event_id: str) -> None:
    """ValueError unless ``event_id`` can be written to the database as it is.

    A JSON string may hold a lone surrogate (``"\\ud800"``), which no UTF-8 database column can
    store: the driver raises ``UnicodeEncodeError`` when the delivery is counted, every time, so
    the message would be retried for ever and its partition would stall behind it. Such an id is
    refused here, like a missing one, and the message is dead-lettered.
    """
    try:
        event_id.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"The event id holds a lone surrogate ({event_id[exc.start : exc.end]!r} at "
            f"{exc.start}), which cannot be stored: {event_id[:40]!r}."
        ) from exc


def killed_error(deliveries: int) -> str:
    """The ``dlq.error`` of a message parked with no error recorded: no delivery of it ever
    ended, so each one died with its consumer (SIGKILL, out of memory, a crash, os._exit, the
    watchdog of a hung handler)."""
    return (
        f"EventParked: no delivery of {deliveries} ended; the consumer died while handling "
        f"it (killed, out of memory, crashed, or hung past HANDLER_TIMEOUT)"
    )


# --- The consumer runner ------------------------------------------------------------------------


class ConsumerRunner:
    """Consume the topics of one configured consumer, one effect per event.

    ``manage.py idempotency_consume <name>`` builds one from ``IDEMPOTENCY["KAFKA_CONSUMERS"]``
    and calls :meth:`run`; :meth:`stop` (SIGTERM, SIGINT) ends the loop after the current
    message, whose offset is committed.

    :param settings: the consumer's settings, or its name in ``KAFKA_CONSUMERS``.
    :param handler: the handler; default the one ``HANDLER`` names.
    """

    def __init__(self, settings: ConsumerSettings | str, handler: Handler | None = None) -> None:
        self.settings = consumer_settings(settings) if isinstance(settings, str) else settings
        self.handler: Handler = handler or import_string(self.settings.handler)
        self.counts: Counter[Outcome] = Counter()
        self._stopping = threading.Event()
        self._consumer: Consumer | None = None
        self._producer: Producer | None = None
        self._done: dict[tuple[str, int], int] = {}
        """Offsets to commit: processed, not committed yet, by (topic, partition)."""
        self._settled: set[tuple[str, int]] = set()
        """Partitions that have applied a message since they were assigned here: no earlier
        owner ever saw their later messages, so those are first deliveries (see process())."""
        self._committed_at = time.monotonic()
        self._warmup: dict[tuple[str, int], int] = {}
        """Batch mode: how many messages each partition must still apply one at a time, each
        counted, since it was assigned here, before it settles (see handle_batch())."""
        self._retrying: dict[tuple[str, int], int] = {}
        """Batch mode: the offset of each partition's message that failed alone and comes back;
        it is taken alone again, not in a batch, until it is applied or dead-lettered."""
        self._paused: dict[tuple[str, int], float] = {}
        """Partitions paused after a failed message, with when to resume them."""
        self._assigned: set[tuple[str, int]] = set()
        self._refused = False
        """An offset commit was refused and not accepted since (logged once)."""
        self._unreachable = False
        """The brokers were reported unreachable, and nothing has answered since (logged once)."""
        self._library_log = _LibraryLog(logger)
        self._watchdog = Watchdog(self.settings.handler_timeout, logger, self.settings.name)
        """Ends the process when a handler runs past ``HANDLER_TIMEOUT`` (see watchdog.py)."""

    # The loop

    def stop(self) -> None:
        """Ask :meth:`run` to return after the message in hand; safe from a signal handler."""
        self._stopping.set()

    def run(self, max_messages: int | None = None) -> None:
        """Poll and process until :meth:`stop` (or ``max_messages`` messages, for benches)."""
        settings = self.settings
        config = {
            "auto.offset.reset": "earliest",
            # Incremental rebalances: partitions that stay keep being consumed, and a revoked
            # partition's offsets are committed before it moves (an eager rebalance can refuse
            # that commit with REBALANCE_IN_PROGRESS, as librdkafka's mock cluster does).
            "partition.assignment.strategy": "cooperative-sticky",
            **settings.config,
            "group.id": settings.group,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "error_cb": self._on_error,
            "logger": self._library_log,
        }
        consumer = self._consumer = Consumer(config)
        consumer.subscribe(
            list(settings.topics),
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_lost,
        )
        logger.info(
            "Kafka consumer %s started: topics %s, group %s",
            settings.name,
            ", ".join(settings.topics),
            settings.group,
        )
        self._log_waiting()
        self._watchdog.start()
        seen = 0
        try:
            while not self._stopping.is_set():
                timeout = self._resume_due()
                if settings.batch_size > 1:
                    polled = consumer.consume(settings.batch_size, timeout)
                else:
                    one = consumer.poll(timeout)
                    polled = [] if one is None else [one]
                if not polled:
                    self._commit_if_due()
                    close_old_connections()  # when idle, as CONN_MAX_AGE says
                    continue
                messages = []
                for message in polled:
                    error = message.error()
                    if error is None:
                        messages.append(message)
                    else:
                        self._on_error(error)
                if not messages:
                    continue
                self._reachable()
                if settings.batch_size > 1:
                    seen += self.handle_batch(messages)
                else:
                    self.handle(messages[0])
                    seen += 1
                if max_messages is not None and seen >= max_messages:
                    break
        finally:
            self._watchdog.stop()
            self._commit()
            consumer.close()  # leaves the group: its partitions move on at once
            self._consumer = None
            if self._producer is not None:
                self._producer.flush(30)
            logger.info(
                "Kafka consumer %s stopped: %s",
                settings.name,
                ", ".join(f"{n} {o.value}" for o, n in self.counts.items()) or "no messages",
            )

    def handle(self, message: Message) -> Outcome:
        """Process one message, then commit its offset or set it up for redelivery."""
        with telemetry.consuming(self.settings.name, telemetry.carrier(_headers(message))):
            outcome = self.process(message)
        self.counts[outcome] += 1
        telemetry.count(
            telemetry.KAFKA_MESSAGES,
            {"idempotency.consumer": self.settings.name, "idempotency.outcome": outcome.value},
        )
        topic, partition, offset = _position(message)
        key = (topic, partition)
        if outcome is Outcome.RETRY:
            self._retry_at(topic, partition, offset)
            if self.settings.batch_size > 1:
                self._retrying[key] = offset
        else:
            if offset >= self._retrying.get(key, offset + 1):
                del self._retrying[key]  # the message that failed is done: batches again
            # Only an applied message counts: a duplicate (an earlier owner applied it) or a
            # dead letter leaves the warm-up as it is (see handle_batch()).
            if outcome is Outcome.APPLIED:
                warming = self._warmup.get(key, 0)
                if warming:
                    self._warmup[key] = warming - 1
                else:
                    self._settled.add(key)
            self._done[topic, partition] = offset + 1
            self._commit_if_due()
        return outcome

    def handle_batch(self, messages: Sequence[Message]) -> int:
        """Batch mode: apply each partition's messages in one transaction; how many were
        handled (the rest come again: their partition was sought back after a failure).

        A partition newly assigned here takes its messages one at a time, each counted, until
        it has applied ``BATCH_SIZE`` of them and one more (see :meth:`process`). An earlier
        owner that died inside a batch died within the ``BATCH_SIZE`` messages after the last
        one it applied; those are the first messages this owner does not find applied
        already, so a message that kills every owner is always among the counted ones, and
        is parked after ``MAX_DELIVERIES`` deaths, never hidden in a batch. Duplicates (the
        earlier owner's batches that committed before their offsets, with
        ``COMMIT_INTERVAL``) do not count towards the ``BATCH_SIZE``.

        A message that failed alone (after its batch rolled back) comes back alone, not at the
        head of a batch, until it is applied or dead-lettered: in a batch it would run, fail
        and roll its batch back once more on every retry, uncounted, and its handler would run
        up to twice ``MAX_DELIVERIES`` times.
        """
        by_partition: dict[tuple[str, int], list[Message]] = {}
        for message in messages:
            by_partition.setdefault(_position(message)[:2], []).append(message)
        handled = 0
        for key, run in by_partition.items():
            if self._stopping.is_set():
                break
            while run and (key not in self._settled or key in self._retrying):
                handled += 1
                if self.handle(run.pop(0)) is Outcome.RETRY:
                    run = []
            if run:
                handled += self._apply_batch(run)
        return handled

    def _apply_batch(self, messages: list[Message]) -> int:
        """One transaction for ``messages`` (one partition, in order), one reservation each,
        then their offsets; on any failure, the same messages one at a time.

        The event ids are read first, outside any transaction: a message whose id cannot be
        read stops the batch before it starts (nothing to roll back), and one at a time that
        message is dead-lettered. A failure inside the transaction rolls the batch back."""
        settings = self.settings
        ids: list[str] = []
        for message in messages:
            try:
                ids.append(event_id_of(message, settings))
            except Exception as exc:  # logged; the messages are then applied one at a time
                logger.warning(
                    "could not start a batch of %d messages: the event id of %s could not be "
                    "read (%s: %s); no transaction was opened, applying them one at a time: "
                    "consumer %s, %s to %s",
                    len(messages),
                    _describe(message),
                    type(exc).__name__,
                    log_text(exc),
                    settings.name,
                    _describe(messages[0]),
                    _describe(messages[-1]),
                    exc_info=not isinstance(exc, MissingEventId),
                )
                return self._one_at_a_time(messages)

        def batch() -> str:
            first, last = _describe(messages[0]), _describe(messages[-1])
            return f"a batch of {len(messages)}, {first} to {last}"

        # Callbacks that raised after the batch's COMMIT: the batch is applied all the same
        # (process_first_deliveries keeps each message's callbacks to itself).
        hooks_failed: list[tuple[int, OnCommitFailed]] = []
        try:
            with self._watchdog.arm(batch), transaction.atomic(using=conf.DATABASE):
                # A settled partition: first deliveries, reserved together up front.
                processed = process_first_deliveries(
                    settings.name,
                    [
                        (event_id, functools.partial(self.handler, message))
                        for message, event_id in zip(messages, ids, strict=True)
                    ],
                    topic=messages[0].topic(),
                    using=conf.DATABASE,
                    on_commit_failed=lambda index, failure: hooks_failed.append((index, failure)),
                )
            outcomes = [Outcome.APPLIED if p.applied else Outcome.DUPLICATE for p in processed]
        except Exception:  # logged; the messages are then applied one at a time
            logger.warning(
                "batch of %d messages rolled back, applying them one at a time: consumer %s, "
                "%s to %s",
                len(messages),
                settings.name,
                _describe(messages[0]),
                _describe(messages[-1]),
                exc_info=True,
            )
            close_old_connections()  # a broken connection is replaced first
            return self._one_at_a_time(messages)
        for index, failure in hooks_failed:
            self._commit_hook_failed(messages[index], ids[index], failure)
        self.counts.update(outcomes)
        for outcome, amount in Counter(outcomes).items():
            telemetry.count(
                telemetry.KAFKA_MESSAGES,
                {"idempotency.consumer": settings.name, "idempotency.outcome": outcome.value},
                amount,
            )
        topic, partition, offset = _position(messages[-1])
        self._done[topic, partition] = offset + 1
        self._commit_if_due()
        return len(messages)

    def _one_at_a_time(self, messages: list[Message]) -> int:
        """A batch's messages, each with :meth:`handle`, up to the first that comes again;
        how many were handled."""
        handled = 0
        for message in messages:
            handled += 1
            if self.handle(message) is Outcome.RETRY:
                break
        return handled

    def process(self, message: Message) -> Outcome:
        """Run the handler once per event id, or dead-letter the message; never commits.

        A message of a partition that has applied a message since it was assigned here is a
        first delivery (``redelivered=False``), which skips its delivery count. An owner of a
        partition takes its messages one at a time, in order, and moves past one only once it
        is applied, skipped as a duplicate or dead-lettered. So when this owner applies a
        message (it was neither applied nor dead-lettered before), no earlier owner got past
        it, and none ever saw a later message. Until then every message is counted: the one an
        earlier owner died in is among them, and a message that kills every owner is always
        the first one its next owner meets, so it is counted on each of them and parked.
        """
        settings = self.settings
        try:
            event_id = event_id_of(message, settings)
        except Exception as exc:
            # MissingEventId as a rule; anything else is a message event_id_of could not read
            # either, and must not end the loop (the partition would stall on it for good).
            logger.error(
                "message without a usable event id, sent to the dead-letter topic: consumer "
                "%s, %s: %s",
                settings.name,
                _describe(message),
                log_text(exc),
                exc_info=not isinstance(exc, MissingEventId),
            )
            return self._dead_letter(message, f"{type(exc).__name__}: {exc}", deliveries=1)

        def what() -> str:
            return f"event {log_text(event_id)}, {_describe(message)}"

        try:
            with self._watchdog.arm(what):  # the count, the handler, its transaction
                processed = process_event(
                    settings.name,
                    event_id,
                    lambda: self.handler(message),
                    topic=message.topic(),
                    max_deliveries=settings.max_deliveries,
                    redelivered=False if _position(message)[:2] in self._settled else None,
                )
        except EventParked:
            try:
                deliveries, error = self._delivery_record(event_id)
            except DatabaseError:
                return self._retry_later(message, event_id)
            return self._dead_letter(message, error, deliveries)
        except OnCommitFailed as failure:  # committed: applied, and a redelivery is a duplicate
            self._commit_hook_failed(message, event_id, failure)
            return Outcome.APPLIED
        except Exception:  # noqa: BLE001 - logged with its traceback, recorded, redelivered
            return self._retry_later(message, event_id)
        return Outcome.APPLIED if processed.applied else Outcome.DUPLICATE

    def _retry_at(self, topic: str, partition: int, offset: int) -> None:
        """Seek the partition back to ``offset`` and pause it for ``RETRY_DELAY``.

        The loop keeps polling meanwhile, so the other partitions go on and the consumer stays
        within ``max.poll.interval.ms`` however long the delay (a sleep in the loop would stall
        every partition, and a delay past that interval would cost the consumer its group).
        """
        assert self._consumer is not None
        where = TopicPartition(topic, partition, offset)
        self._consumer.pause([where])
        self._consumer.seek(where)
        self._paused[topic, partition] = time.monotonic() + self.settings.retry_delay

    def _resume_due(self) -> float:
        """Resume the paused partitions whose delay is over; seconds until the next one is."""
        if not self._paused:
            return self.settings.poll_timeout
        now = time.monotonic()
        due = [key for key, at in self._paused.items() if at <= now]
        if due and self._consumer is not None:
            self._consumer.resume([TopicPartition(t, p) for t, p in due])
        for key in due:
            del self._paused[key]
        waits = [at - now for at in self._paused.values()]
        return max(0.0, min([self.settings.poll_timeout, *waits]))

    def _commit_hook_failed(
        self, message: Message, event_id: str, failure: OnCommitFailed
    ) -> None:
        """An ``on_commit`` callback of the handler raised after the commit (the core logged it
        and kept it in the counter): the message is applied, and its offset is committed."""
        logger.warning(
            "on_commit callback failed after the commit; the message is applied, its offset "
            "committed, and it is not delivered again: event %s, consumer %s, %s",
            log_text(event_id),
            self.settings.name,
            _describe(message),
            exc_info=failure,
        )

    def _retry_later(self, message: Message, event_id: str) -> Outcome:
        logger.warning(
            "delivery failed, the message comes back in %ss (if it did commit, it is then "
            "skipped as a duplicate): event %s, consumer %s, %s",
            self.settings.retry_delay,
            log_text(event_id),
            self.settings.name,
            _describe(message),
            exc_info=True,
        )
        close_old_connections()  # a broken connection is replaced before the next try
        return Outcome.RETRY

    # Offsets and rebalances

    def _commit_if_due(self) -> None:
        if time.monotonic() - self._committed_at >= self.settings.commit_interval:
            self._commit()

    def _commit(self, partitions: Sequence[TopicPartition] | None = None) -> None:
        """Commit the processed offsets (of ``partitions`` only, if given), synchronously."""
        if partitions is None:
            self._committed_at = time.monotonic()
        wanted = None if partitions is None else {(p.topic, p.partition) for p in partitions}
        keys = [key for key in self._done if wanted is None or key in wanted]
        if not keys or self._consumer is None:
            return
        offsets = [TopicPartition(t, p, self._done.pop((t, p))) for t, p in keys]
        try:
            self._consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:
            telemetry.count(
                telemetry.KAFKA_COMMIT_FAILURES, {"idempotency.consumer": self.settings.name}
            )
            self._commit_refused(offsets, exc, revoking=partitions is not None)
        else:
            if self._refused:
                logger.info(
                    "offset commit accepted again, covering the refused ones: consumer %s, %s",
                    self.settings.name,
                    _offsets(offsets),
                )
                self._refused = False

    def _commit_refused(
        self, offsets: list[TopicPartition], exc: KafkaException, *, revoking: bool
    ) -> None:
        """A refused commit is retried with the next one, unless its partitions are leaving.

        While the partitions stay here, the refused offsets go back to the pending ones, and
        the next commit (the next message's, the next idle poll's, or the revoke's) carries
        them, or a later offset of the same partition that supersedes them. One warning is
        logged per run of refusals, not one per commit. A commit refused as the partitions are
        revoked cannot be retried: their new owner gets these messages again and its
        reservations skip them.
        """
        text = _offsets(offsets)
        if revoking:
            logger.warning(
                "offset commit refused as the partitions were revoked, not retried: their new "
                "owner redelivers these messages and skips them as duplicates: consumer %s, "
                "%s: %s",
                self.settings.name,
                text,
                exc,
            )
            return
        for offset in offsets:
            key = (offset.topic, offset.partition)
            # A later offset of the partition, if one is pending, supersedes this one.
            self._done[key] = max(self._done.get(key, offset.offset), offset.offset)
        if not self._refused:
            logger.warning(
                "offset commit refused, retried with the next commit (a later offset of the "
                "same partition supersedes it): consumer %s, %s: %s",
                self.settings.name,
                text,
                exc,
            )
            self._refused = True

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._unsettle(partitions)
        if self.settings.batch_size > 1:
            for p in partitions:
                self._warmup[p.topic, p.partition] = self.settings.batch_size
        self._assigned.update((p.topic, p.partition) for p in partitions)
        self._reachable()
        logger.info("consumer %s assigned %s", self.settings.name, _partitions(partitions))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._commit(partitions)
        self._leave(consumer, partitions)
        logger.info("consumer %s revoked %s", self.settings.name, _partitions(partitions))
        self._log_waiting()

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._leave(consumer, partitions)
        for partition in partitions:
            self._done.pop((partition.topic, partition.partition), None)
        logger.warning(
            "consumer %s lost %s without a chance to commit; their last messages will be "
            "redelivered and skipped as duplicates",
            self.settings.name,
            _partitions(partitions),
        )

    def _unsettle(self, partitions: list[TopicPartition]) -> None:
        for partition in partitions:
            self._settled.discard((partition.topic, partition.partition))

    def _leave(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Forget what this owner kept about partitions that move away."""
        self._unsettle(partitions)
        keys = {(p.topic, p.partition) for p in partitions}
        paused = [TopicPartition(t, p) for t, p in keys if self._paused.pop((t, p), None)]
        if paused:
            consumer.resume(paused)  # a later owner here starts it unpaused
        self._assigned -= keys
        for key in keys:
            self._warmup.pop(key, None)
            self._retrying.pop(key, None)

    def _log_waiting(self) -> None:
        if not self._assigned:
            logger.info(
                "consumer %s waiting for partitions of %s (group %s)",
                self.settings.name,
                ", ".join(self.settings.topics),
                self.settings.group,
            )

    def _on_error(self, error: KafkaError) -> None:
        """librdkafka's error callback (and errors polled as messages): one line per change.

        Unreachable brokers are reported every few milliseconds while librdkafka reconnects; the
        runner logs the first report, then nothing until a broker answers again (an
        assignment, a message, a commit).
        """
        if error.code() == KafkaError._PARTITION_EOF:
            return
        if error.fatal():
            raise KafkaException(error)
        if error.code() in (KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN):
            if not self._unreachable:
                self._unreachable = True
                logger.warning(
                    "Kafka consumer %s: broker unreachable, retrying quietly: %s",
                    self.settings.name,
                    error,
                )
            return
        logger.warning("Kafka consumer %s: %s", self.settings.name, error)

    def _reachable(self) -> None:
        if self._unreachable:
            self._unreachable = False
            self._library_log.forget()
            logger.info("Kafka consumer %s: broker reachable again", self.settings.name)

    # The dead-letter topic

    def _delivery_record(self, event_id: str) -> tuple[int, str]:
        row = (
            EventDelivery.objects.using(conf.DATABASE)
            .filter(consumer=self.settings.name, event_id=event_id)
            .values_list("deliveries", "last_error")
            .first()
        )
        deliveries, error = row if row is not None else (0, "")
        return deliveries, error or killed_error(deliveries)

    def _dead_letter(self, message: Message, error: str, deliveries: int) -> Outcome:
        """Produce ``message`` to its dead-letter topic and wait for the acknowledgement."""
        settings = self.settings
        topic, partition, offset = _position(message)
        target = settings.dead_letter_topic_for(topic)
        headers = _headers(message)
        extra = (error[:4000], deliveries, settings.name, settings.group, topic, partition, offset)
        # As bytes: an error text may hold a lone surrogate, which a str header cannot carry.
        headers.extend(
            (n, str(v).encode("utf-8", "backslashreplace"))
            for n, v in zip(DEAD_LETTER_HEADERS, extra, strict=True)
        )
        try:
            _produce_durably(
                self._dead_letter_producer(),
                target,
                key=message.key(),
                value=message.value(),
                headers=headers,
            )
        except (DeadLetterFailed, KafkaException, BufferError, ValueError, TypeError) as exc:
            logger.error(
                "could not dead-letter %s to %s, the message stays and comes back: %s",
                _describe(message),
                log_text(target),
                log_text(exc),
            )
            return Outcome.RETRY
        telemetry.count(telemetry.KAFKA_DEAD_LETTERED, {"idempotency.consumer": settings.name})
        logger.error(
            "MESSAGE DEAD-LETTERED to %s: consumer %s, %s, %d deliveries: %s",
            target,
            settings.name,
            _describe(message),
            deliveries,
            log_text(error),
        )
        return Outcome.DEAD_LETTERED

    def _dead_letter_producer(self) -> Producer:
        if self._producer is None:
            self._producer = Producer(_producer_config(self.settings))
        return self._producer


# --- The dead-letter and replay producers ---------------------------------------------------


def _producer_config(settings: ConsumerSettings) -> dict[str, Any]:
    """The dead-letter and replay producers' config: durable, and the outbox's partitioner.

    ``murmur2_random`` is the partitioner the outbox's ``KafkaTransport`` (and the Java client)
    use: a replayed message lands on the partition its key first went to,
    behind the same key's other messages, and a dead-letter topic with the source topic's
    partition count keeps each key's dead letters on one partition in order.
    """
    return {
        **settings.producer_config,
        "enable.idempotence": True,
        "acks": "all",
        "partitioner": PARTITIONER,
        # librdkafka gives up on a message within the runner's wait for it, so none is written
        # after the wait reported it failed (its default, 300 s, wrote a second dead letter
        # when the message came back and was dead-lettered again).
        "message.timeout.ms": int(DEAD_LETTER_TIMEOUT * 1000),
        # The consumer takes messages up to the topic's own limit; librdkafka's producer would
        # refuse one over 1 MB before the broker saw it, and the poison message would come
        # back for ever. The broker (the dead-letter topic's max.message.bytes) decides.
        "message.max.bytes": 1_000_000_000,
        "logger": _LibraryLog(logger),
    }


class _LibraryLog:
    """librdkafka's log lines, through Python's logging, each text once until :meth:`forget`.

    librdkafka logs each failed reconnection (every few milliseconds while a broker is down)
    straight to stderr; through this object, a line that was logged already is dropped, so an
    outage reads as one line per broker, until a broker answers again.
    """

    def __init__(self, target: logging.Logger) -> None:
        self._target = target
        self._seen: set[str] = set()

    def log(self, level: int, fmt: str, *args: object) -> None:
        text = fmt % args if args else fmt
        # The parts that change from one repetition to the next (timings, counts) do not count.
        shape = re.sub(r"\d+", "#", text)
        if shape in self._seen:
            return
        if len(self._seen) >= 1000:
            self._seen.clear()
        self._seen.add(shape)
        self._target.log(level, "librdkafka: %s", log_text(text))

    def forget(self) -> None:
        """A new state (a broker answered): its lines may be logged again once."""
        self._seen.clear()


def _offsets(offsets: Sequence[TopicPartition]) -> str:
    return ", ".join(f"{p.topic}[{p.partition}]@{p.offset}" for p in offsets)


def _text(value: str | bytes | None) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value or ""


def _produce_durably(
    producer: Producer,
    topic: str,
    *,
    key: bytes | None,
    value: bytes | None,
    headers: list[tuple[str, str | bytes | None]],
) -> None:
    """Produce one message and wait for its acknowledgement (``acks=all``): DeadLetterFailed
    if it was refused, timed out, or had no delivery report within the wait."""
    wait = DEAD_LETTER_TIMEOUT + DEAD_LETTER_GRACE
    reports: list[KafkaError | None] = []
    producer.produce(
        topic,
        value=value,
        key=key,
        headers=headers,
        on_delivery=lambda err, msg: reports.append(err),
    )
    producer.flush(wait)
    if not reports:
        raise DeadLetterFailed(f"no acknowledgement from {topic} within {wait:g}s")
    if reports[0] is not None:
        raise DeadLetterFailed(f"{topic} refused the message: {reports[0]}")


def _headers(message: Message) -> list[tuple[str, str | bytes | None]]:
    headers = message.headers() or []
    return list(headers.items() if isinstance(headers, dict) else headers)


def _position(message: Message) -> tuple[str, int, int]:
    topic, partition, offset = message.topic(), message.partition(), message.offset()
    assert topic is not None and partition is not None and offset is not None
    return topic, partition, offset


def _describe(message: Message) -> str:
    return f"{message.topic()}[{message.partition()}]@{message.offset()}"


def _partitions(partitions: Sequence[TopicPartition]) -> str:
    return ", ".join(f"{p.topic}[{p.partition}]" for p in partitions) or "nothing"
