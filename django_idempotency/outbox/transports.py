"""How the outbox relay hands messages to a broker: the transport interface and the Celery one.

The relay (:mod:`django_idempotency.outbox.relay`) claims rows of the outbox table, turns each
into an
:class:`OutboxMessage` and calls :meth:`Transport.send` with a batch of them. A transport is any
object with ``send`` and ``close``:

* ``send(messages)`` returns one result per message, in order: ``None`` when the broker has
  acknowledged the message durably (a publisher confirm, a Kafka ``acks=all`` delivery report),
  or the exception that explains why it was not sent. The relay marks the first ones sent and
  retries the others with backoff.
* Messages that share an ``ordering_key`` arrive in their order. After a failure for a key, the
  transport must not send the later messages with that key in the same call and reports them
  failed too (the relay puts them back without counting an attempt).
* ``close()`` releases connections; the relay calls it when it stops.

Transports are configured by name in ``IDEMPOTENCY["OUTBOX_TRANSPORTS"]``::

    IDEMPOTENCY = {
        "OUTBOX_TRANSPORTS": {
            "default": {"BACKEND": "django_idempotency.outbox.transports.CeleryTransport"},
            "kafka": {
                "BACKEND": "django_idempotency.kafka.transport.KafkaTransport",
                "OPTIONS": {"config": {"bootstrap.servers": "127.0.0.1:9092"}},
            },
        },
    }

Each is built once per process as ``BACKEND(**OPTIONS)`` (:func:`get_transport`). A message names
its transport when it is written (``outbox.send(..., transport="kafka")``; default ``"default"``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from django_idempotency import telemetry
from django_idempotency.conf import conf
from django_idempotency.events.core import EVENT_ID_KEY

if TYPE_CHECKING:
    from celery import Celery

    from django_idempotency.models import OutboxEntry

__all__ = [
    "CeleryTransport",
    "OutboxMessage",
    "Transport",
    "close_transports",
    "get_transport",
]

logger = logging.getLogger(__name__)

CELERY_OPTIONS = frozenset({"queue", "routing_key", "exchange", "priority", "expires"})
"""The ``apply_async`` options a Celery message may carry in its payload's ``"options"``."""


@dataclass(frozen=True)
class OutboxMessage:
    """One message as a transport sees it: a row of the outbox, claimed by the relay."""

    id: int
    """The row's primary key: messages of one ordering key are sent in this order."""
    event_id: str
    """The event id (a UUIDv7 string unless the producer chose one); consumers dedup on it."""
    destination: str
    """A Celery task name, or a topic."""
    payload: Any
    """The JSON value written by the producer. For Celery: ``{"args", "kwargs", "options"}``."""
    headers: dict[str, str]
    """Message headers; the transport adds ``event_id``."""
    ordering_key: str | None
    """Messages with the same key are delivered in order (a Kafka message key)."""
    created_at: datetime
    attempts: int
    """Attempts so far, this one included."""

    @classmethod
    def from_entry(cls, row: OutboxEntry) -> OutboxMessage:
        """The message of an :class:`~django_idempotency.models.OutboxEntry` row."""
        return cls(
            id=row.pk,
            event_id=row.event_id,
            destination=row.destination,
            payload=row.payload,
            headers=dict(row.headers or {}),
            ordering_key=row.ordering_key,
            created_at=row.created_at,
            attempts=row.attempts,
        )


@runtime_checkable
class Transport(Protocol):
    """What the relay needs from a broker client. See the module docstring for the contract."""

    def send(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]: ...

    def close(self) -> None: ...


# --- The registry -----------------------------------------------------------------------------

_transports: dict[str, Transport] = {}
_lock = threading.Lock()


def get_transport(name: str) -> Transport:
    """The transport configured under ``name``, built on first use and kept for the process.

    :raises ImproperlyConfigured: no such name, a backend that cannot be imported, or options
        it does not accept.
    """
    with _lock:
        transport = _transports.get(name)
        if transport is None:
            transport = _transports[name] = build_transport(name)
        return transport


def build_transport(name: str) -> Transport:
    """A new instance of the transport configured under ``name``."""
    configured = conf.OUTBOX_TRANSPORTS
    if name not in configured:
        raise ImproperlyConfigured(
            f"No outbox transport named {name!r}: IDEMPOTENCY['OUTBOX_TRANSPORTS'] has "
            f"{', '.join(map(repr, configured)) or 'none'}."
        )
    backend, options = configured[name]["BACKEND"], configured[name].get("OPTIONS", {})
    try:
        cls = import_string(backend)
    except ImportError as exc:
        raise ImproperlyConfigured(
            f"Outbox transport {name!r}: cannot import BACKEND {backend!r}: {exc}."
        ) from exc
    try:
        transport = cls(**options)
    except TypeError as exc:
        raise ImproperlyConfigured(
            f"Outbox transport {name!r}: {backend}(**OPTIONS) failed: {exc}."
        ) from exc
    if not isinstance(transport, Transport):
        raise ImproperlyConfigured(
            f"Outbox transport {name!r}: {backend} has no send(messages) and close() methods."
        )
    return transport


def close_transports() -> None:
    """Close and forget every transport this process built (the relay calls it on exit)."""
    with _lock:
        built = list(_transports.values())
        _transports.clear()
    for transport in built:
        transport.close()


# --- Celery -----------------------------------------------------------------------------------


def celery_envelope(
    args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None, options: Mapping[str, Any]
) -> dict[str, Any]:
    """The payload of a Celery message: ``{"args": [...], "kwargs": {...}, "options": {...}}``."""
    unknown = set(options) - CELERY_OPTIONS
    if unknown:
        raise TypeError(
            f"Unsupported Celery option(s) for the outbox: {', '.join(sorted(unknown))}. "
            f"Supported: {', '.join(sorted(CELERY_OPTIONS))}."
        )
    return {"args": list(args or ()), "kwargs": dict(kwargs or {}), "options": dict(options)}


class CeleryTransport:
    """Publish outbox messages as Celery task messages, and wait until the broker has them.

    Each message becomes ``send_task(destination, args, kwargs, task_id=event_id,
    headers={"event_id": event_id, ...})``: the ``event_id`` header is where
    :class:`~django_idempotency.events.celery.IdempotentConsumer` looks when the arguments carry
    no id,
    so a consumer deduplicates resends with no code of its own.

    Durability: on RabbitMQ, ``confirm_publish`` (on by default) turns on publisher confirms, so
    a message counts as sent only once the broker has taken responsibility for it (persistent
    messages on a durable queue are on disk by then); ``transactions=True`` gives the same
    guarantee per batch. On Redis, a batch goes in one pipeline and counts as sent once Redis has
    answered every ``LPUSH``; the message survives a Redis restart only with ``appendonly yes``.
    Publishing never retries inside the transport (``retry=False``): the relay retries with
    backoff.

    With ``task_always_eager`` (tests, a demo without a broker) and no ``broker_url``, the task
    runs in the relay's process instead, and its exception counts as a failed send.

    :param app: the Celery app or its dotted path; default the current app. Task routes and
        serializer come from it.
    :param broker_url: publish to this broker instead of the app's.
    :param confirm_publish: wait for RabbitMQ publisher confirms (ignored by other brokers).
    :param transactions: RabbitMQ only: publish each batch in one AMQP transaction instead, and
        count it sent when ``tx.commit`` returns: one round trip per batch rather than one per
        message.
    :param connect_timeout: seconds to wait for the broker's connection.
    """

    def __init__(
        self,
        app: Celery | str | None = None,
        broker_url: str | None = None,
        confirm_publish: bool = True,
        transactions: bool = False,
        connect_timeout: float = 5.0,
    ) -> None:
        self._app_spec = app
        self.broker_url = broker_url
        self.confirm_publish = confirm_publish
        self.transactions = transactions
        self.connect_timeout = connect_timeout
        self._connection: Any = None
        self._producer: Any = None

    @property
    def app(self) -> Celery:
        if self._app_spec is None:
            from celery import current_app

            return current_app._get_current_object()  # type: ignore[attr-defined,no-any-return]
        if isinstance(self._app_spec, str):
            self._app_spec = import_string(self._app_spec)
        return self._app_spec  # type: ignore[return-value]

    def _open(self) -> Any:
        if self._producer is None:
            app = self.app
            confirm = self.confirm_publish and not self.transactions
            self._connection = app.connection_for_write(
                self.broker_url,
                connect_timeout=self.connect_timeout,
                transport_options={"confirm_publish": confirm},
            )
            self._connection.ensure_connection(max_retries=1)
            self._producer = app.amqp.Producer(self._connection)
        return self._producer

    @property
    def _eager(self) -> bool:
        return self.broker_url is None and bool(self.app.conf.task_always_eager)

    def send(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        if self._eager:
            return self._send_each(messages)
        try:
            producer = self._open()
        except Exception as exc:  # noqa: BLE001 - the broker is unreachable: nothing is sent
            self.close()
            return [exc] * len(messages)
        results: list[BaseException | None] = []
        try:
            with self._batch(producer, len(messages)):
                results = self._send_each(messages)
        except Exception as exc:  # noqa: BLE001 - the batch's flush or commit failed
            # None of the batch is known to have reached the broker: all of it is retried.
            self.close()
            return [exc] * len(messages)
        return results

    @contextmanager
    def _batch(self, producer: Any, size: int) -> Iterator[None]:
        """Publish a whole call in one round trip where the broker allows it.

        RabbitMQ with ``transactions``: one AMQP transaction, committed at the end (the commit
        returns once the broker has the messages). Redis: one pipeline (kombu 5.7's
        ``Producer.batch``). Otherwise one publish (and one confirm) per message.
        """
        if self.transactions:
            channel = producer.channel
            if not getattr(channel, "_idempotency_tx", False):
                channel.tx_select()
                channel._idempotency_tx = True
            try:
                yield
            except BaseException:
                channel.tx_rollback()
                raise
            channel.tx_commit()
            return
        batch = getattr(producer, "batch", None)
        if batch is None:
            yield
            return
        with batch(max_size=4 * size + 16):  # never flushed half-way
            yield

    def _send_each(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        results: list[BaseException | None] = []
        failed_keys: dict[str, BaseException] = {}
        broken: BaseException | None = None
        for message in messages:
            key = message.ordering_key
            if broken is not None:
                results.append(broken)
                continue
            if key is not None and key in failed_keys:
                results.append(failed_keys[key])
                continue
            try:
                with telemetry.sending(message.headers, {"messaging.system": "celery"}):
                    self._publish(message)
            except Exception as exc:  # noqa: BLE001 - reported to the relay, which retries
                results.append(exc)
                if key is not None:
                    failed_keys[key] = exc
                if self._is_connection_error(exc):
                    # The broker is gone: the rest of the batch would fail the same way.
                    broken = exc
                    self.close()
            else:
                results.append(None)
        return results

    def _publish(self, message: OutboxMessage) -> None:
        payload = message.payload
        if not isinstance(payload, Mapping) or not {"args", "kwargs"} <= set(payload):
            raise TypeError(
                f"Outbox message {message.event_id} to Celery task {message.destination!r} "
                "has no {'args', 'kwargs'} payload; write it with outbox.publish()."
            )
        options = dict(payload.get("options") or {})
        app = self.app
        if self._eager:
            # No broker (tests, a demo): run the task here and now, as delay() would; its
            # exception counts as a failed send.
            app.tasks[message.destination].apply(
                args=tuple(payload["args"]),
                kwargs=dict(payload["kwargs"]),
                task_id=message.event_id,
                headers={**message.headers, EVENT_ID_KEY: message.event_id},
                throw=True,
            )
            return
        producer = self._open()
        app.send_task(
            message.destination,
            args=list(payload["args"]),
            kwargs=dict(payload["kwargs"]),
            task_id=message.event_id,
            headers={**message.headers, EVENT_ID_KEY: message.event_id},
            producer=producer,
            retry=False,
            **options,
        )

    def _is_connection_error(self, exc: BaseException) -> bool:
        if self._eager:
            return False  # no broker: the task ran here, and the exception is its own
        connection = self._connection
        if connection is None:
            return True  # it failed while connecting
        from kombu.exceptions import OperationalError as KombuOperationalError

        errors = tuple(connection.connection_errors) + tuple(connection.channel_errors)
        return isinstance(exc, (*errors, KombuOperationalError, OSError))

    def close(self) -> None:
        connection, self._connection, self._producer = self._connection, None, None
        if connection is not None:
            try:
                connection.release()
            except Exception:
                logger.debug("closing the Celery transport's connection failed", exc_info=True)
