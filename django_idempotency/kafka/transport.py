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
    :param timeout: seconds to wait for the acknowledgements of one batch; librdkafka gives up on
        a message after this long too (``message.timeout.ms``), so none is sent later. A
        ``config`` whose ``message.timeout.ms`` (or its alias ``delivery.timeout.ms``) is longer,
        or 0 (no limit), is refused: librdkafka would go on trying a message after the transport
        reported it failed, deliver it later, and the relay's next attempt would write it twice.
    """

    def __init__(self, config: Mapping[str, Any], timeout: float = 30.0) -> None:
        self.check_options(config, timeout)
        self.timeout = float(timeout)
        self.config = {
            "partitioner": "murmur2_random",
            # librdkafka's bounds: 0 would be no limit at all; 2**31 - 1 is its largest.
            "message.timeout.ms": max(1, min(int(self.timeout * 1000), 2**31 - 1)),
            **config,
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
            producer.flush(self.timeout + 5)
            for index in sent:
                if index not in reports:
                    results[index] = TimeoutError(
                        f"no acknowledgement from Kafka within {self.timeout}s"
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
            producer.flush(self.timeout)


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
