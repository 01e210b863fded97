"""The outbox's Kafka transport: :class:`KafkaTransport` sends the relay's messages to Kafka.

The relay (:mod:`django_idempotency.outbox.relay`) hands it a batch; it answers, for each
message, whether the broker acknowledged it. The consumer side is :mod:`.runner`.
"""

from __future__ import annotations

import functools
import json
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from django.core.exceptions import ImproperlyConfigured

from django_idempotency import telemetry
from django_idempotency.events.ids import EVENT_ID_KEY
from django_idempotency.exceptions import log_text
from django_idempotency.extras import missing_extra
from django_idempotency.kafka.settings import is_topic_name

try:
    from confluent_kafka import KafkaError, KafkaException, Message, Producer
except ImportError as error:  # confluent-kafka is the "kafka" extra
    raise missing_extra("kafka", __name__) from error

if TYPE_CHECKING:
    from django_idempotency.outbox.transports import OutboxMessage

__all__ = ["KafkaTransport"]

MESSAGE_TIMEOUT_KEYS = ("message.timeout.ms", "delivery.timeout.ms")
"""librdkafka's names of how long it tries a message (``delivery.timeout.ms`` is an alias)."""
REPORT_MARGIN = 5.0
"""Seconds a flush waits beyond ``message.timeout.ms``: librdkafka looks for messages that timed
out about once a second, and reports each then. Under :meth:`KafkaTransport.limit_to_lease`,
at most half the flush's wait."""


class KafkaTransport:
    """Send outbox messages to Kafka: the relay's transport (``OUTBOX_TRANSPORTS``).

    Each message goes to the topic named by its destination, its payload as compact JSON, its
    ordering key as the Kafka key, its headers plus ``event_id``. The producer is idempotent
    with ``acks=all`` (a message counts as sent once every in-sync replica has it) and
    partitions by a hash of the key (``murmur2_random``, the Java client's partitioner), so one
    key's messages share a partition and keep their order.

    Within one :meth:`send`, the messages go out in rounds: round ``n`` holds the ``n``-th
    message of each ordering key (and round 0 every message without a key). A round is produced
    at once and flushed once, in librdkafka's batches, so a batch whose keys do not repeat
    costs one flush. A message is produced only after the earlier ones of its key were
    acknowledged; after a failure the later ones of that key are not sent and are reported
    failed. A message with no delivery report when the flush returns counts as failed.

    :param config: librdkafka producer properties; ``bootstrap.servers`` at least. The
        idempotence and ``acks`` cannot be weakened.
    :param timeout: seconds librdkafka tries a message (``message.timeout.ms``) before it
        gives up on it and reports it failed; a flush waits for the acknowledgements of a batch
        this long plus :data:`REPORT_MARGIN` (:attr:`wait`), so every message has its report,
        and none is sent after the transport reported it failed. A ``config`` whose
        ``message.timeout.ms`` (or its alias ``delivery.timeout.ms``) is longer, or 0 (no limit),
        is refused: librdkafka would go on trying a message after the transport reported it
        failed, deliver it later, and the relay's next attempt would write it twice.

    A relay calls :meth:`limit_to_lease` with its lease, which may lower both waits.
    """

    def __init__(self, config: Mapping[str, Any], timeout: float = 30.0) -> None:
        self.check_options(config, timeout)
        self.timeout = float(timeout)
        """Seconds librdkafka tries a message at most (``message.timeout.ms``, which ``config``
        may set shorter)."""
        self.wait = self.timeout + REPORT_MARGIN
        """Seconds one flush waits for the acknowledgements of a batch; never less than
        :attr:`timeout`."""
        given = [_millis(config[key]) for key in MESSAGE_TIMEOUT_KEYS if key in config]
        self.config = {
            "partitioner": "murmur2_random",
            **{key: value for key, value in config.items() if key not in MESSAGE_TIMEOUT_KEYS},
            # One name for it (the shortest of the two the config gave): librdkafka's alias
            # would otherwise make the last one in the dict win. 0 would be no limit at all;
            # 2**31 - 1 is librdkafka's largest.
            "message.timeout.ms": min(given or [max(1, min(int(self.timeout * 1000), 2**31 - 1))]),
            "enable.idempotence": True,
            "acks": "all",
        }
        self._producer: Producer | None = None

    @staticmethod
    def check_options(config: Mapping[str, Any], timeout: float = 30.0) -> None:
        """Refuse options the transport cannot keep its promises with (the system checks call
        it on ``OPTIONS``, as error ``E032``, without building the transport).

        :raises ImproperlyConfigured: no ``bootstrap.servers``; idempotence or ``acks=all``
            switched off; a ``timeout`` that is not a positive number of seconds; or a
            ``message.timeout.ms`` longer than ``timeout``, or 0 (no limit).
        """
        if not isinstance(config, Mapping) or not config.get("bootstrap.servers"):
            raise ImproperlyConfigured("KafkaTransport needs config={'bootstrap.servers': ...}.")
        if str(config.get("enable.idempotence", True)).lower() in ("false", "0"):
            raise ImproperlyConfigured("KafkaTransport always uses enable.idempotence=true.")
        if str(config.get("acks", "all")) not in ("all", "-1"):
            raise ImproperlyConfigured("KafkaTransport always uses acks=all.")
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            raise ImproperlyConfigured(
                f"KafkaTransport timeout must be a positive number of seconds, not {timeout!r}."
            )
        for key in MESSAGE_TIMEOUT_KEYS:
            if key in config:
                _check_message_timeout(key, config[key], float(timeout))

    producer_factory: ClassVar[Callable[[dict[str, Any]], Producer]] = Producer
    """Builds the producer from the configuration (a test may give one of its own)."""

    def limit_to_lease(self, lease: float) -> None:
        """Keep the wait of one flush, and librdkafka's ``message.timeout.ms``, within a
        quarter of the relay's ``lease`` (seconds).

        Without it a silent or unreachable broker held a batch for ``timeout`` plus
        :data:`REPORT_MARGIN` seconds (35 by default): with a shorter lease another relay took
        the batch over and sent it too. With it, the flush waits at most ``lease / 4``
        (:attr:`wait`), and librdkafka gives up on a message earlier still (:attr:`timeout`),
        leaving the flush a margin (:data:`REPORT_MARGIN`, at most half its wait) to hear
        librdkafka's own report. A ``config`` with a longer ``message.timeout.ms`` (or
        ``delivery.timeout.ms``) is lowered to that, not kept: a message librdkafka still
        tried after the flush gave up on it would be delivered after the transport reported it
        failed, and the relay would send it a second time. A producer already built with a
        longer timeout is flushed and closed; the next send builds a new one.

        A broker that cannot be reached, or stops answering, fails the keys of the round that
        meets it, and no later message of a failed key is produced: the batch fails within one
        :attr:`wait`, or two if the broker stopped in the middle of a round. A broker that
        answers, slowly, may take one :attr:`wait` per round (per message of the batch's most
        frequent key).
        An optional transport method: the relay calls it before each batch; the same lease
        again changes nothing, and a longer one never loosens the bound.
        """
        if isinstance(lease, bool) or not (isinstance(lease, (int, float)) and lease > 0):
            raise ValueError(f"lease must be a positive number of seconds, not {lease!r}.")
        limit = float(lease) / 4
        if self.wait <= limit:
            return
        self.wait = limit
        self.timeout = min(self.timeout, limit - min(REPORT_MARGIN, limit / 2))
        millis = max(1, int(self.timeout * 1000))
        if millis < self.config["message.timeout.ms"]:
            self.config["message.timeout.ms"] = millis
            self.close()  # the next send builds a producer with the new message.timeout.ms
        # librdkafka's timeout is whole milliseconds, at least 1: a lease of a few milliseconds
        # still never lets the flush give up before librdkafka does.
        self.wait = max(self.wait, self.config["message.timeout.ms"] / 1000)

    def validate_message(self, destination: str, payload: Any, headers: dict[str, str]) -> None:
        """Refuse a message Kafka can never take (called when it is written).

        :raises ValueError: a topic name Kafka refuses (1 to 249 of ``a-z A-Z 0-9 . _ -``, not
            ``.`` or ``..``), or a payload that is not strict JSON (NaN, infinity).
        :raises TypeError: a payload that is not JSON-serialisable, or headers that are not
            strings.
        """
        if not is_topic_name(destination):
            raise ValueError(
                f"{log_text(repr(destination)[:300])} is not a Kafka topic name: 1 to 249 of "
                "a-z, A-Z, 0-9, '.', '_' and '-' (and not '.' or '..')."
            )
        if not isinstance(headers, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
        ):
            raise TypeError("Kafka message headers must map strings to strings.")
        _value(payload)

    def send(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        results: list[BaseException | None] = [None] * len(messages)
        failed: dict[str, BaseException] = {}
        for batch in _rounds(messages):
            reports: dict[int, KafkaError | None] = {}
            sent: list[int] = []
            producer = self._open()
            for index in batch:
                message = messages[index]
                key = message.ordering_key
                if key is not None and key in failed:
                    results[index] = failed[key]
                    continue
                try:
                    with telemetry.sending(message.headers, {"messaging.system": "kafka"}):
                        producer.produce(
                            message.destination,
                            value=_value(message.payload),
                            key=key,
                            headers={**message.headers, EVENT_ID_KEY: message.event_id},
                            on_delivery=functools.partial(_report, reports, index),
                        )
                except (KafkaException, BufferError, TypeError, ValueError) as exc:
                    results[index] = exc
                else:
                    sent.append(index)
            producer.flush(self.wait)
            for index in sent:
                if index not in reports:
                    results[index] = TimeoutError(
                        f"no acknowledgement from Kafka within {self.wait:g}s"
                    )
                elif reports[index] is not None:
                    error = reports[index]
                    results[index] = KafkaException(error)
                    if error is not None and error.fatal():
                        self.close()  # a fatal idempotence error: the next send starts afresh
            for index in batch:
                key = messages[index].ordering_key
                if results[index] is not None and key is not None:
                    failed.setdefault(key, results[index])  # type: ignore[arg-type]
        return results

    def _open(self) -> Producer:
        if self._producer is None:
            self._producer = type(self).producer_factory(dict(self.config))
        return self._producer

    def close(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            producer.flush(self.wait)


def _check_message_timeout(key: str, raw: Any, timeout: float) -> None:
    """Refuse a ``message.timeout.ms`` that would outlive the transport's wait for it."""
    try:
        millis = math.nan if isinstance(raw, bool) else float(raw)
    except (TypeError, ValueError):
        millis = math.nan
    if math.isfinite(millis) and 0 < millis <= timeout * 1000:
        return
    if math.isfinite(millis) and millis > timeout * 1000:
        problem = f"longer than the transport's timeout ({timeout:g} s)"
    else:
        problem = "not a positive number of milliseconds (0 is no limit at all)"
    raise ImproperlyConfigured(
        f"KafkaTransport config sets {key!r} to {raw!r}, {problem}: librdkafka would go on "
        f"trying a message after send() reported it failed, and deliver it after the relay "
        f"had sent it again (a duplicate on the topic). Remove {key!r} (it defaults to the "
        f"timeout), or raise the transport's OPTIONS['timeout'] (seconds) instead."
    )


def _millis(raw: Any) -> int:
    """A ``message.timeout.ms`` that :func:`_check_message_timeout` let through, as librdkafka's
    whole milliseconds (at least 1: 0 is no limit)."""
    return max(1, int(float(raw)))


def _value(payload: Any) -> bytes:
    """The payload as compact, strict JSON (no NaN or infinity), UTF-8."""
    return json.dumps(payload, separators=(",", ":"), allow_nan=False).encode()


def _report(
    reports: dict[int, KafkaError | None], index: int, error: KafkaError | None, message: Message
) -> None:
    reports[index] = error


def _rounds(messages: Sequence[OutboxMessage]) -> list[list[int]]:
    """Indexes in sending rounds: round ``n`` holds the ``n``-th message of each key."""
    rounds: defaultdict[int, list[int]] = defaultdict(list)
    seen: Counter[str] = Counter()
    for index, message in enumerate(messages):
        key = message.ordering_key
        if key is None:
            rounds[0].append(index)
        else:
            rounds[seen[key]].append(index)
            seen[key] += 1
    return [rounds[n] for n in sorted(rounds)]
