"""A transport read from the database's log: Debezium's outbox event router in place of the relay.

Name it in ``IDEMPOTENCY["OUTBOX_TRANSPORTS"]`` like any transport::

    IDEMPOTENCY = {
        "OUTBOX_TRANSPORTS": {
            "default": {"BACKEND": "django_idempotency.outbox.transports.CeleryTransport"},
            "cdc": {"BACKEND": "django_idempotency.outbox.capture.ChangeCaptureTransport"},
        },
    }

and write the messages the connector routes with ``outbox.send(..., transport="cdc")``. Such a
message is written in the ``external`` state with ``expires_at`` set to its creation time plus
``OUTBOX_TTL``: the relay never claims it (the connector has it from the write-ahead log once the
transaction commits), and ``idempotency_purge`` deletes it after the TTL as it deletes a sent
message. No ``NOTIFY`` is queued for it: no relay needs waking. docs/scale.md configures the
connector, and filters its publication to this transport's rows.

The relay calls :meth:`ChangeCaptureTransport.send` only for a row that was written ``pending``,
before its transport was switched to this class. Nothing says the connector read that row (it may
have started later), so each such message fails with an error that says so, and is parked after
``OUTBOX_MAX_ATTEMPTS``: let the relay drain a transport's pending rows before switching it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django_idempotency.exceptions import log_text
from django_idempotency.kafka.settings import is_topic_name
from django_idempotency.outbox.transports import OutboxMessage, backend_class

__all__ = ["ChangeCaptureTransport", "is_change_capture"]


class ChangeCaptureTransport:
    """Messages for a change-capture reader: written ``external``, never sent by the relay."""

    #: Read by :func:`is_change_capture` (and so by ``outbox.send``); a subclass keeps it.
    change_capture = True

    # No OPTIONS (check E032 says so): the connector's own configuration says where they go.

    def validate_message(self, destination: str, payload: Any, headers: dict[str, str]) -> None:
        """Refuse, when it is written, a message the connector could never route.

        The router sends a message to the Kafka topic its destination names (docs/scale.md).
        Kafka refuses a name outside ``a-z A-Z 0-9 . _ -`` (or longer than 249, or ``.`` and
        ``..``), and the connector's task then fails on that message, and again on it after
        each restart: no later message leaves either, where the relay would park one message.

        :raises ValueError: a destination that is no Kafka topic name.
        """
        # From kafka.settings: kafka.transport imports confluent-kafka, an extra.
        if not is_topic_name(destination):
            raise ValueError(
                f"{log_text(repr(destination)[:300])} is not a Kafka topic name (1 to 249 of "
                "a-z, A-Z, 0-9, '.', '_' and '-', not '.' or '..'): the change-capture "
                "connector routes a message to the topic its destination names, and would "
                "stop on this one."
            )

    def send(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        return [
            RuntimeError(
                f"event {message.event_id} was written pending, before its transport was a "
                "ChangeCaptureTransport, and no relay sends through one: nothing shows that the "
                "change-capture connector read it. Send it again by hand, then delete the row."
            )
            for message in messages
        ]

    def close(self) -> None:
        pass


def is_change_capture(backend: str) -> bool:
    """Whether the transport class at dotted path ``backend`` is read from the log.

    A path that does not import is not (check E030 reports it, and the relay fails its messages
    with the reason).
    """
    try:
        cls = backend_class(backend)
    except ImportError:
        return False
    return getattr(cls, "change_capture", False) is True
