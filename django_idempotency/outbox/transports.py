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
* Optionally, ``validate_message(destination, payload, headers)`` raises ``TypeError`` or
  ``ValueError`` for a message the transport could never send (a Celery payload that is not an
  ``args``/``kwargs`` envelope the task takes, a topic name Kafka refuses), so that it is refused
  when it is written instead of being retried until parked.
* A send never blocks for good: a broker that stops answering fails the batch after the
  transport's timeout, well inside the relay's lease, so SIGTERM and lease expiry work.

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

Why this module is long: the Celery transport builds the task messages ``send_task`` would, and
publishes a batch at once in three broker modes (a Redis pipeline, RabbitMQ confirms waited for
per batch, AMQP transactions) that share the same per-key failure rule and timeouts.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.utils.module_loading import import_string

from django_idempotency import telemetry
from django_idempotency.conf import SETTING_NAME, conf
from django_idempotency.events.core import EVENT_ID_KEY
from django_idempotency.exceptions import log_text
from django_idempotency.extras import missing_extra
from django_idempotency.outbox import celery_calls, celery_canvas, celery_copies, celery_redis
from django_idempotency.outbox.saferepr import task_repr

if TYPE_CHECKING:
    from celery import Celery

    from django_idempotency.models import OutboxEntry
    from django_idempotency.outbox.store import Claimed

__all__ = [
    "CeleryTransport",
    "OutboxMessage",
    "Transport",
    "close_transports",
    "get_transport",
]

logger = logging.getLogger(__name__)

_UNTRACED = contextlib.nullcontext()
"""The context of a message's publish when no span is recorded (reusable, it does nothing)."""

CELERY_OPTIONS = frozenset(
    {*celery_calls.OPTIONS, *celery_canvas.CANVAS_OPTIONS, "eta", "expires", "headers"}
)
"""The ``apply_async`` options a Celery message may carry in its payload's ``"options"``
(:mod:`~django_idempotency.outbox.celery_calls`)."""

#: The options ``send_task`` takes as its own arguments and passes to ``create_task_message``,
#: not to the broker's publish.
MESSAGE_FIELDS = (
    "retries",
    "shadow",
    "root_id",
    "parent_id",
    "reply_to",
    "argsrepr",
    "kwargsrepr",
)


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
    due_at: datetime | None = None
    """When it is due (a countdown counted from its commit, or an eta); None: at once. The
    relay sends it at once to a transport whose ``delayed_delivery`` is true (Celery passes it
    on as the task's eta), and holds it until then for the others."""

    @classmethod
    def from_entry(cls, row: OutboxEntry | Claimed) -> OutboxMessage:
        """The message of an :class:`~django_idempotency.models.OutboxEntry` row, or of a row
        the relay claimed."""
        return cls(
            id=row.pk,
            event_id=row.event_id,
            destination=row.destination,
            payload=row.payload,
            headers=dict(row.headers or {}),
            ordering_key=row.ordering_key,
            created_at=row.created_at,
            attempts=row.attempts,
            due_at=row.due_at,
        )


@runtime_checkable
class Transport(Protocol):
    """What the relay needs from a broker client. See the module docstring for the contract."""

    def send(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]: ...

    def close(self) -> None: ...


# --- Broker timeouts (the Celery and Dramatiq transports) ------------------------------------


class _BrokerClient(Protocol):
    connect_timeout: float
    timeout: float

    def close(self) -> None: ...


def _checked_timeouts(
    transport: str, connect_timeout: float, timeout: float
) -> tuple[float, float]:
    """A broker transport's ``connect_timeout`` and ``timeout``, as floats; ``transport`` names
    its class in the error.

    :raises ImproperlyConfigured: one is not a positive number of seconds.
    """
    for name, value in (("connect_timeout", connect_timeout), ("timeout", timeout)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ImproperlyConfigured(
                f"{transport} {name} must be a positive number of seconds, not {value!r}."
            )
    return float(connect_timeout), float(timeout)


def _limit_to_lease(transport: _BrokerClient, lease: float) -> None:
    """A broker transport's ``limit_to_lease``: both its timeouts cut to a quarter of ``lease``
    (seconds) where they are longer, and its connection closed so that the next send connects
    with them."""
    limit = float(lease) / 4
    if limit <= 0:
        raise ValueError(f"lease must be a positive number of seconds, not {lease!r}.")
    if transport.timeout > limit or transport.connect_timeout > limit:
        transport.timeout = min(transport.timeout, limit)
        transport.connect_timeout = min(transport.connect_timeout, limit)
        transport.close()  # the next send connects with the new timeouts


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
        cls = backend_class(backend)
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


@functools.lru_cache(maxsize=64)
def backend_class(backend: str) -> Any:
    """The class at the dotted path ``backend``, imported once per path.

    ``outbox.send()`` reads the class of its message's transport for every message (does it
    validate messages? is it read from the log?). A path that does not import raises
    ``ImportError`` each time, and is not remembered. The classes are forgotten with the built
    transports (:func:`close_transports`, a change of the setting), so a class patched in at
    the same path (``mock.patch``) is the one built next.
    """
    return import_string(backend)


def close_transports() -> None:
    """Close and forget every transport this process built, and the classes imported for them
    (:func:`backend_class`); the relay calls it on exit."""
    with _lock:
        built = list(_transports.values())
        _transports.clear()
        backend_class.cache_clear()
    for transport in built:
        transport.close()


def _settings_changed(*, setting: str, **kwargs: Any) -> None:
    # A transport is built from OUTBOX_TRANSPORTS once per process; when the setting changes
    # (override_settings in tests), the next message must not go through the old one.
    if setting == SETTING_NAME:
        close_transports()


setting_changed.connect(_settings_changed)


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

    Each message is the one ``send_task(destination, args, kwargs, task_id=event_id,
    headers={"event_id": event_id, ...}, **options)`` would publish, built with the same calls
    (the app's router, ``app.amqp.create_task_message`` and ``app.amqp.send_task_message``), so
    a worker consumes it exactly as before. The ``event_id`` header is where
    :class:`~django_idempotency.events.celery.IdempotentConsumer` looks when the arguments carry
    no id, so a consumer deduplicates resends with no code of its own. What ``send_task`` does
    around the message for a caller that waits for it (an ``AsyncResult``, the result backend's
    subscription) is left out: the relay never waits for a result.

    A whole call goes to the broker at once, and counts as sent only once the broker has it:

    * **RabbitMQ** (default): publisher confirms for the whole batch. Every message is
      published, then the transport waits for all the confirms (at most ``timeout`` seconds). A
      message is reported sent only after its confirm; a nack, or no confirm in time, reports it
      failed. Messages of one ordering key go in rounds (round ``n`` holds the ``n``-th message
      of each key), each round waiting for its confirms, so a message is never published before
      the earlier ones of its key were confirmed: a batch costs as many round trips as its most
      frequent key has messages (one when no key repeats). ``transactions=True`` publishes the
      batch in one AMQP transaction instead and counts it sent when ``tx.commit`` returns.
    * **Redis**: one pipeline per batch, one ``LPUSH`` per list, counted sent once Redis has
      answered it; a failed pipeline reports every message of the call failed. The messages
      are the ones kombu writes (:mod:`~django_idempotency.outbox.celery_redis`; a batch it does
      not cover goes through kombu's ``Producer.batch``). A message survives a Redis restart
      only with ``appendonly yes``.

    No broker call waits longer than ``timeout`` seconds (socket reads and writes, the
    connection handshake, the wait for a round's confirms), so a broker that stops answering
    without closing the connection fails the batch instead of holding the relay past its lease,
    and SIGTERM stops the relay after that batch. Keep the relay's lease above a few times
    ``timeout``; a relay may call :meth:`limit_to_lease` to make sure.
    Publishing never retries inside the transport (``retry=False``): the relay retries with
    backoff.

    With ``task_always_eager`` (tests, a demo without a broker) and no ``broker_url``, the task
    runs in the relay's process instead, and its exception counts as a failed send.

    :param app: the Celery app or its dotted path; default the current app. Task routes and
        serializer come from it.
    :param broker_url: publish to this broker instead of the app's.
    :param confirm_publish: wait for RabbitMQ publisher confirms (ignored by other brokers).
        Without confirms (and without ``transactions``) a RabbitMQ message counts as sent once
        it is written to the socket, and may be lost.
    :param transactions: RabbitMQ only: publish each batch in one AMQP transaction instead of
        with confirms.
    :param connect_timeout: seconds to wait for the broker's connection.
    :param timeout: the most seconds any one broker call may wait (default 10).
    :param fast_redis: on Redis, write each batch in a pipeline of its own with the messages
        kombu would write (:mod:`~django_idempotency.outbox.celery_redis`), about a third of
        the time per message; ``False`` publishes through kombu's ``Producer.batch`` instead.
    :param hold_until_due: a delayed message (a countdown, an eta) is held by the relay until
        it is due, then sent with its eta (past by then, so a worker runs it at once), instead
        of going to the broker at once for a worker to hold. For long delays on Redis, whose
        ``visibility_timeout`` (an hour by default) redelivers a message a worker holds longer
        than that; and so that workers do not keep thousands of future tasks in memory.

    A delayed message (:attr:`OutboxMessage.due_at`) carries the task's eta as ``apply_async``
    would set it: the due time (a countdown counted from the commit), in the app's time zone;
    ``expires`` in seconds counts from that due time (``publish()`` stores it so).
    """

    @property
    def delayed_delivery(self) -> bool:
        """Whether the relay sends a delayed message at once, with its eta (the worker holds
        it): not with ``hold_until_due``, nor eagerly (no broker, no worker to hold it)."""
        return not self.hold_until_due and not self._eager

    def __init__(
        self,
        app: Celery | str | None = None,
        broker_url: str | None = None,
        confirm_publish: bool = True,
        transactions: bool = False,
        connect_timeout: float = 5.0,
        timeout: float = 10.0,
        fast_redis: bool = True,
        hold_until_due: bool = False,
    ) -> None:
        self.connect_timeout, self.timeout = _checked_timeouts(
            "CeleryTransport", connect_timeout, timeout
        )
        self._app_spec = app
        self.broker_url = broker_url
        self.confirm_publish = confirm_publish
        self.transactions = transactions
        self.fast_redis = bool(fast_redis)
        self.hold_until_due = bool(hold_until_due)
        self._connection: Any = None
        self._producer: Any = None
        self._confirms: _Confirms | None = None
        self._task_serializers: dict[str, str | None] = {}
        """The serializer of each task registered here, by name, as first looked up."""

    @property
    def app(self) -> Celery:
        if self._app_spec is None:
            try:
                from celery import current_app
            except ImportError as error:
                raise missing_extra("celery", "CeleryTransport") from error

            return current_app._get_current_object()  # type: ignore[attr-defined,no-any-return]
        if isinstance(self._app_spec, str):
            self._app_spec = import_string(self._app_spec)
        return self._app_spec  # type: ignore[return-value]

    def limit_to_lease(self, lease: float) -> None:
        """Keep every broker call within a quarter of the relay's ``lease`` (seconds).

        A batch makes at most a few calls that may each wait ``timeout`` (connect, publish, the
        confirms), so with this the relay records a silent broker's batch as failed before its
        lease runs out and another relay sends it again. An optional transport method: a relay
        that knows its lease may call it once, before the first send.
        """
        _limit_to_lease(self, lease)

    # --- Validation -------------------------------------------------------------------------

    def validate_message(self, destination: str, payload: Any, headers: dict[str, str]) -> None:
        """Refuse a message that no worker could ever run (called when it is written).

        :raises TypeError: the payload is not the ``{"args", "kwargs", "options"}`` envelope of
            :func:`celery_envelope`, or the task, registered in this process, does not take
            these arguments (Celery's own check in ``apply_async``).
        :raises ValueError: an empty destination, or headers that are not strings.
        """
        if not isinstance(destination, str) or not destination:
            raise ValueError(f"A Celery destination is a task name, not {destination!r}.")
        if not isinstance(headers, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
        ):
            raise ValueError("Celery message headers must map strings to strings.")
        args, kwargs, options = _envelope_parts(destination, payload)
        celery_envelope(args, kwargs, options)  # unknown options raise TypeError
        try:
            task = self.app.tasks.get(destination)
        except RuntimeError:  # an app with autofinalize=False, not finalized: no registry yet
            task = None
        if task is not None and getattr(task, "typing", False):
            check = getattr(task, "__header__", None)
            if check is not None:
                try:
                    check(*args, **kwargs)
                except TypeError as exc:
                    raise TypeError(
                        f"Celery task {destination!r} cannot take args={args!r:.200}, "
                        f"kwargs={kwargs!r:.200}: {exc}"
                    ) from exc

    # --- Sending ----------------------------------------------------------------------------

    def _open(self) -> Any:
        if self._producer is None:
            app = self.app
            connection = app.connection_for_write(
                self.broker_url, connect_timeout=self.connect_timeout
            )
            driver = connection.transport.driver_type
            if driver == "amqp":
                # py-amqp's socket timeouts: a broker that stops answering raises instead of
                # blocking (the handshake waits connect_timeout). Confirms are selected on the
                # channel below, so that a batch waits for them once, not once per message.
                connection.transport_options = {
                    **(connection.transport_options or {}),
                    "read_timeout": self.timeout,
                    "write_timeout": self.timeout,
                    "confirm_publish": False,
                }
            elif driver == "redis":
                connection.transport_options = {
                    **(connection.transport_options or {}),
                    "socket_timeout": self.timeout,
                    "socket_connect_timeout": self.connect_timeout,
                }
            self._connection = connection
            self._connection.ensure_connection(max_retries=1, timeout=self.connect_timeout)
            producer = app.amqp.Producer(self._connection)
            channel: Any = producer.channel
            if driver == "amqp" and self.transactions:
                channel.tx_select()
            elif driver == "amqp" and self.confirm_publish:
                self._confirms = _Confirms(channel)
            self._producer = producer
        return self._producer

    @property
    def _eager(self) -> bool:
        return self.broker_url is None and bool(self.app.conf.task_always_eager)

    def send(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        if self._eager:
            return self._send_eager(messages)
        try:
            producer = self._open()
        except Exception as exc:  # noqa: BLE001 - the broker is unreachable: nothing is sent
            self.close(broken=True)
            return [exc] * len(messages)
        call = _Call(messages)
        try:
            if self._confirms is not None:
                self._send_confirmed(producer, call, self._confirms)
            elif self.transactions:
                self._send_transaction(producer, call)
            elif not self._send_redis(producer, call):  # it declined before any message
                self._send_batch(producer, call)
        except Exception as exc:  # noqa: BLE001 - the batch's flush, commit or wait failed
            # Only messages the broker confirmed in an earlier round are known to be there: the
            # rest of the batch is retried.
            self.close(broken=True)
            return [
                call.results[index] if index in call.confirmed else exc
                for index in range(len(messages))
            ]
        return call.results

    def _send_redis(self, producer: Any, call: _Call) -> bool:
        """Redis: the call in one pipeline of its own (:mod:`.celery_redis`), the same messages
        kombu would write, in a third of the time. False (nothing sent) with task protocol 1,
        with task-sent events, or when the transport was built with ``fast_redis=False``."""
        if not self.fast_redis or self._connection.transport.driver_type != "redis":
            return False
        app = self.app
        if producer.exchange.name or not celery_redis.covered(app, producer.channel):
            return False
        settings = _AppSettings.read(app)
        if settings.sent_event:
            # Celery publishes each task-sent event through the producer it was given, to its
            # fanout event exchange: the batch would hand every one of them to kombu, one round
            # trip each, after writing what it holds. Through kombu's own batch instead.
            return False
        batch = celery_redis.RedisBatch(producer, celery_copies.copiable(app, settings.sent_event))
        try:
            self._publish_all(batch, call, range(len(call.messages)), redis=batch)
            with producer.channel.conn_or_acquire() as client:
                batch.execute(client)
            batch.written.extend(batch.held)
        finally:
            # Written by a flush before a message kombu published itself: sent, whatever
            # happens to the rest of the call.
            call.confirmed.update(batch.written)
        return True

    def _send_batch(self, producer: Any, call: _Call) -> None:
        """Redis (one pipeline), or RabbitMQ without confirms: publish all, flush once."""
        everything = range(len(call.messages))
        batch = getattr(producer, "batch", None)
        if batch is None:
            self._publish_all(producer, call, everything)
            return
        with batch(max_size=8 * len(call.messages) + 16):  # never flushed half-way
            self._publish_all(producer, call, everything)

    def _send_transaction(self, producer: Any, call: _Call) -> None:
        """RabbitMQ: the whole call in one AMQP transaction; sent when ``tx.commit`` returns."""
        channel = producer.channel
        try:
            self._publish_all(producer, call, range(len(call.messages)))
        except BaseException:
            channel.tx_rollback()
            raise
        channel.tx_commit()

    def _send_confirmed(self, producer: Any, call: _Call, confirms: _Confirms) -> None:
        """RabbitMQ with confirms: publish a round, wait for all its confirms, then the next.

        A round holds at most one message per ordering key, so a message is published only
        after the earlier ones of its key were confirmed (a batch of keys that do not repeat is
        one round). When a round's confirms do not all come within ``timeout`` (or the
        connection fails while waiting), its unconfirmed messages and every later one fail, and
        the connection is dropped; confirmed ones stay sent.
        """
        for indexes in send_rounds(call.messages):
            tags = self._publish_all(producer, call, indexes, confirms)
            if not tags:
                continue
            deadline = time.monotonic() + self.timeout
            outcomes, error = confirms.wait(tags, self._connection, deadline)
            for index, outcome in outcomes.items():
                call.fail(index, outcome)
            if error is not None:
                self.close(broken=True)
                for index, result in enumerate(call.results):
                    if result is None and index not in call.confirmed:
                        call.fail(index, error)
                return
            call.confirmed.update(outcomes)

    def _publish_all(
        self,
        producer: Any,
        call: _Call,
        indexes: Iterable[int],
        confirms: _Confirms | None = None,
        redis: celery_redis.RedisBatch | None = None,
    ) -> dict[int, int]:
        """Publish the messages at ``indexes``; returns their indexes by delivery tag.

        A message that cannot be published gets its error and holds back the later messages of
        its key; a lost connection raises (the whole call fails). With ``redis`` (the producer
        too), a message of a kind already built in this call is a copy of that one.
        """
        tags: dict[int, int] = {}
        declared: set[str] = set()
        app = self.app
        settings = _AppSettings.read(app)
        if call.copies is None:  # once per call: a call's rounds share their templates
            call.copies = celery_copies.Copies(
                redis is None and celery_copies.copiable(app, settings.sent_event)
            )
        copies = call.copies
        traced = telemetry.tracing()
        for index in indexes:
            if call.held_back(index):
                continue
            before = confirms.last_tag if confirms is not None else 0
            queue_name = None
            try:
                message = call.messages[index]
                with (
                    telemetry.sending(message.headers, {"messaging.system": "celery"})
                    if traced
                    else _UNTRACED
                ):
                    if redis is not None:
                        redis.index = index
                    kind, copied = self._copy(redis, copies, producer, settings, message)
                    if copied and redis is not None:
                        continue  # written into the batch: no delivery tag to follow
                    if not copied:
                        name, task_message, options = self._task_message(app, settings, message)
                        queue = options.get("queue")
                        queue_name = getattr(queue, "name", queue)
                        if queue_name is not None and queue_name in declared:
                            options["declare"] = []  # declared once per call, not per message
                        recorder = celery_copies.Recorder(producer) if copies.on else None
                        app.amqp.send_task_message(
                            recorder or producer, name, task_message, retry=False, **options
                        )
                        if redis is not None:
                            redis.remember(kind)
                        elif recorder is not None:
                            copies.remember(kind, recorder)
            except Exception as exc:
                if self._is_connection_error(exc):
                    raise
                call.fail(index, exc)
                if confirms is not None:
                    confirms.ignore(confirms.published_since(before))
                continue
            if queue_name is not None:
                declared.add(queue_name)
            if confirms is not None:
                # The task message is the first publish; any later one (the task-sent event
                # of task_send_sent_event) took a tag of its own, whose answer is not ours.
                published = confirms.published_since(before)
                if published:
                    tags[published[0]] = index
                    confirms.ignore(published[1:])
        return tags

    def _copy(
        self,
        redis: celery_redis.RedisBatch | None,
        copies: celery_copies.Copies,
        producer: Any,
        settings: _AppSettings,
        message: OutboxMessage,
    ) -> tuple[tuple[Any, ...], bool]:
        """``(kind, copied)``: the message published (or, with ``redis``, written into the
        batch) as a copy of the first of its kind in this call, if there is one
        (:mod:`.celery_copies`); ``kind`` is what remembering it as that first one needs."""
        if redis is None and not copies.on:
            return (), False
        args, kwargs, given, serializer = self._arguments(self.app, message, settings.serializer)
        # What argsrepr shows: the values, not kombu's tags (computed only for a copy).
        show = celery_calls.shown if serializer == "json" else _same
        if message.due_at is not None or given.get("expires") is not None or "eta" in given:
            return (), False  # its eta and expiry are its own: built by Celery
        if given.get("headers"):
            return (), False  # headers of its own that the template's would not have
        if any(given.get(option) for option in celery_canvas.CANVAS_OPTIONS):
            return (), False  # callbacks or a chain in its body: built by Celery
        headers = {**message.headers, EVENT_ID_KEY: message.event_id}
        kind = celery_copies.kind(message.destination, given, headers)
        copy = (
            redis.copy
            if redis is not None
            else functools.partial(copies.publish, producer=producer)
        )
        copied = copy(
            kind=kind,
            task_id=message.event_id,
            args=args,
            kwargs=kwargs,
            argsrepr=lambda: task_repr(
                show(args) or (), settings.argsrepr_size, settings.repr_levels
            ),
            kwargsrepr=lambda: task_repr(
                show(kwargs) or {}, settings.kwargsrepr_size, settings.repr_levels
            ),
            headers=headers,
        )
        return kind, copied

    def _arguments(
        self, app: Celery, message: OutboxMessage, default: str | None = None
    ) -> tuple[list[Any], dict[str, Any], dict[str, Any], str]:
        """``(args, kwargs, options, serializer)`` of a message: its arguments as the task's
        serializer gets them (the stored JSON for kombu's JSON, decoded for another), its own
        options, and that serializer (the message's, the task's, or the app's: ``default``,
        when the caller has read it)."""
        args, kwargs, given = _envelope_parts(message.destination, message.payload)
        serializer = given.get("serializer")
        if serializer is None:
            destination = message.destination
            if destination in self._task_serializers:  # a dict lookup, not the registry's
                serializer = self._task_serializers[destination]
            else:
                registry: Any = getattr(app, "_tasks", None)
                task = registry.get(destination) if registry is not None else None
                serializer = getattr(task, "serializer", None)
                if task is not None:
                    self._task_serializers[destination] = serializer
            serializer = serializer or default or app.conf.task_serializer
        if serializer != "json":
            args, kwargs = celery_calls.arguments(args, kwargs, serializer)
        return args, kwargs, given, serializer

    def _task_message(
        self, app: Celery, settings: _AppSettings, message: OutboxMessage
    ) -> tuple[str, Any, dict[str, Any]]:
        """The task message ``send_task`` would build, and its publish options.

        The same steps as ``Celery.send_task``, for the options an outbox message may carry:
        the task's own options when it is registered here, the router, the eta (the due time)
        and ``expires``, which is also the broker's ``expiration``, ``create_task_message``. The
        app settings it reads are read once per call (:class:`_AppSettings`): each read costs
        more than the rest of a message.
        """
        args, kwargs, given, serializer = self._arguments(app, message, settings.serializer)
        name = message.destination
        own_headers = given.pop("headers", None) or {}
        # link, link_error and chain: the body's callbacks, errbacks and chain, as send_task
        # writes them (stored as kombu's JSON: decoded for another serializer).
        canvas = {option: given.pop(option, None) for option in celery_canvas.CANVAS_OPTIONS}
        if serializer != "json":
            canvas = {k: celery_calls.decode(v) if v else v for k, v in canvas.items()}
        options: dict[str, Any] = {
            "headers": {**own_headers, **message.headers, EVENT_ID_KEY: message.event_id},
            **given,
        }
        # The registry as send_task reads it: without finalizing the app.
        registry: Any = getattr(app, "_tasks", None)
        task = registry.get(name) if registry is not None else None
        exec_options = getattr(task, "_get_exec_options", None) if task is not None else None
        if exec_options is not None:
            # As apply_async: the task's options, None ones included (a priority of None
            # leaves the message without one, where kombu's default would write 0).
            options = {**exec_options(), **options}
        time_limit = options.pop("time_limit", None)
        soft_time_limit = options.pop("soft_time_limit", None)
        expires = options.pop("expires", None)
        ignore_result = options.pop("ignore_result", None)
        if ignore_result is None and task is not None:
            ignore_result = bool(getattr(task, "ignore_result", False))  # as apply_async
        fields = {k: options.pop(k) for k in MESSAGE_FIELDS if k in options}
        eta, expires = _times(app, message, options, expires)
        task_type: Any = task  # send_task passes the registered task instance too
        options = app.amqp.router.route(options, name, tuple(args), kwargs, task_type)
        if eta is not None:
            _native_delayed_delivery(app, self._connection, options, eta)
        if expires is not None:
            # As send_task: a moment (an ISO 8601 string is the one JSON can store) or seconds.
            if isinstance(expires, (datetime, str)):
                moment = datetime.fromisoformat(expires) if isinstance(expires, str) else expires
                if moment.tzinfo is None:  # send_task takes a naive moment for UTC
                    moment = moment.replace(tzinfo=UTC)
                seconds = (moment - app.now()).total_seconds()
            else:
                seconds = float(expires)
            options["expiration"] = max(0.0, seconds)
        fields.setdefault("reply_to", settings.reply_to)
        # What create_task_message computes itself, with the same settings, read once.
        if "argsrepr" not in fields:
            # Of the values, as apply_async writes it: UUID('...'), not the stored kombu tag.
            shown = celery_calls.shown(args) if serializer == "json" else args
            fields["argsrepr"] = task_repr(
                shown or (), settings.argsrepr_size, settings.repr_levels
            )
        if "kwargsrepr" not in fields:
            shown = celery_calls.shown(kwargs) if serializer == "json" else kwargs
            fields["kwargsrepr"] = task_repr(
                shown or {}, settings.kwargsrepr_size, settings.repr_levels
            )
        task_message = app.amqp.create_task_message(
            message.event_id,
            name,
            args,
            kwargs,
            eta=eta,
            expires=expires,
            time_limit=time_limit,
            soft_time_limit=soft_time_limit,
            create_sent_event=settings.sent_event,
            ignore_result=ignore_result,
            callbacks=canvas["link"] or None,
            errbacks=canvas["link_error"] or None,
            chain=canvas["chain"] or None,
            **fields,
            **options,
        )
        options.pop("stamped_headers", None)
        return name, task_message, options

    def _send_eager(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        """No broker (tests, a demo): run each task here and now, as ``delay()`` would; its
        exception counts as a failed send, and holds back the later messages of its key. The
        arguments go through the task's serializer and back, as ``apply_async`` does eagerly."""
        from celery.canvas import signature
        from kombu import serialization

        call = _Call(messages)
        app = self.app
        for index, message in enumerate(messages):
            if call.held_back(index):
                continue
            try:
                args, kwargs, given, serializer = self._arguments(app, message)
                if serializer == "json":
                    args, kwargs = celery_calls.decode(args), celery_calls.decode(kwargs)
                else:
                    content_type, encoding, data = serialization.dumps((args, kwargs), serializer)
                    args, kwargs = serialization.loads(
                        data, content_type, encoding, accept=[content_type]
                    )
                own_headers = given.get("headers") or {}
                link, link_error = given.get("link"), given.get("link_error")
                result = app.tasks[message.destination].apply(
                    args=tuple(args),
                    kwargs=dict(kwargs),
                    task_id=message.event_id,
                    headers={**own_headers, **message.headers, EVENT_ID_KEY: message.event_id},
                    link=celery_calls.decode(link) if link else None,
                    link_error=celery_calls.decode(link_error) if link_error else None,
                    throw=True,
                )
                # Task.apply runs no chain: its steps, one after the other, as _chain.apply.
                for step in reversed(celery_calls.decode(given.get("chain") or [])):
                    result = signature(step, app=app).apply((result.result,), throw=True)
            except Exception as exc:  # noqa: BLE001 - reported to the relay, which retries
                call.fail(index, exc)
        return call.results

    def _is_connection_error(self, exc: BaseException) -> bool:
        connection = self._connection
        if connection is None:
            return True  # it failed while connecting
        from kombu.exceptions import OperationalError as KombuOperationalError

        errors = tuple(connection.connection_errors) + tuple(connection.channel_errors)
        return isinstance(exc, (*errors, KombuOperationalError, OSError))

    def close(self, broken: bool = False) -> None:
        """Release the connection; a ``broken`` one is dropped without a goodbye to the broker
        (which may not answer it)."""
        connection, self._connection, self._producer = self._connection, None, None
        self._confirms = None
        if connection is None:
            return
        try:
            if broken:
                connection.collect(socket_timeout=self.timeout)
            else:
                connection.release()
        except Exception:
            logger.debug("closing the Celery transport's connection failed", exc_info=True)


def _same(value: Any) -> Any:
    return value


def _envelope_parts(
    destination: str,
    payload: Any,
    receiver: str = "Celery task",
    writer: str = "outbox.publish()",
) -> tuple[list[Any], dict[str, Any], dict[str, Any]]:
    """``(args, kwargs, options)`` of an ``{"args", "kwargs", "options"}`` payload (Celery's, and
    Dramatiq's), or TypeError naming the ``receiver`` kind and the ``writer`` of such payloads."""
    if (
        not isinstance(payload, Mapping)
        or not {"args", "kwargs"} <= set(payload)
        or not set(payload) <= {"args", "kwargs", "options"}
        or not isinstance(payload["args"], (list, tuple))
        or not isinstance(payload["kwargs"], Mapping)
        or not all(isinstance(key, str) for key in payload["kwargs"])
        or not isinstance(payload.get("options") or {}, Mapping)
    ):
        raise TypeError(
            f"A message to {receiver} {log_text(destination)} needs an "
            "{'args': [...], 'kwargs': {...}, 'options': {...}} payload, not "
            f"{log_text(repr(payload)[:200])}; write it with {writer}."
        )
    return list(payload["args"]), dict(payload["kwargs"]), dict(payload.get("options") or {})


def _times(
    app: Celery, message: OutboxMessage, options: dict[str, Any], expires: Any
) -> tuple[Any, Any]:
    """``(eta, expires)`` as ``apply_async`` would have set them. An eta given as a moment goes
    as it was given. A message due later without one (a countdown, counted from its commit) has
    its due time as its eta, in the app's time zone, and an ``expires`` in seconds counts from
    that due time; without a due time, from now (as ``send_task`` counts it)."""
    eta = options.pop("eta", None)
    if eta is not None or message.due_at is None:
        return eta, expires
    eta = message.due_at.astimezone(app.timezone)
    if expires is not None and not isinstance(expires, (str, datetime)):
        expires = (message.due_at + timedelta(seconds=float(expires))).astimezone(app.timezone)
    return eta, expires


def _native_delayed_delivery(
    app: Celery, connection: Any, options: dict[str, Any], eta: Any
) -> None:
    """What ``send_task`` does to a delayed message for quorum queues (Celery 5.5's native
    delayed delivery on RabbitMQ): route it through the ``celery_delayed_27`` exchange, with
    the delay in its routing key; a direct exchange cannot, and Celery only warns."""
    from celery.utils.quorum_queues import detect_quorum_queues

    if connection is None or not detect_quorum_queues(app, connection.transport.driver_type)[0]:
        return
    queue = options.get("queue")
    exchange_type = queue.exchange.type if queue else options.get("exchange_type")
    if exchange_type == "direct":
        logger.warning(
            "outbox: a delayed message for a direct exchange on quorum queues: Celery's native "
            "delayed delivery needs a topic or fanout exchange (the worker may hold the message "
            "until its eta)"
        )
        return
    from kombu import Exchange
    from kombu.transport.native_delayed_delivery import calculate_routing_key

    moment = datetime.fromisoformat(eta) if isinstance(eta, str) else eta
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    countdown = (moment - app.now()).total_seconds()
    if countdown > 0:
        routing_key = str(queue.routing_key if queue else options.get("routing_key"))
        options.pop("queue", None)
        options["routing_key"] = calculate_routing_key(int(countdown), routing_key)
        options["exchange"] = Exchange("celery_delayed_27", type="topic")


@dataclass(frozen=True)
class _AppSettings:
    """The Celery settings a task message needs, read once per :meth:`CeleryTransport.send`."""

    sent_event: bool
    repr_levels: int
    argsrepr_size: int
    kwargsrepr_size: int
    reply_to: str
    serializer: str

    @classmethod
    def read(cls, app: Celery) -> _AppSettings:
        return cls(
            serializer=app.conf.task_serializer,
            sent_event=bool(app.conf.task_send_sent_event),
            repr_levels=app.conf.task_repr_maxlevels,
            argsrepr_size=app.amqp.argsrepr_maxsize,
            kwargsrepr_size=app.amqp.kwargsrepr_maxsize,
            reply_to=app.thread_oid,
        )


class _Call:
    """The results of one :meth:`CeleryTransport.send`, and the ordering keys that failed."""

    def __init__(self, messages: Sequence[OutboxMessage]) -> None:
        self.messages = messages
        self.results: list[BaseException | None] = [None] * len(messages)
        self.failed: dict[str, BaseException] = {}
        self.confirmed: set[int] = set()
        self.copies: celery_copies.Copies | None = None
        """The call's templates (:mod:`.celery_copies`), made by its first publish."""

    def fail(self, index: int, error: BaseException | None) -> None:
        if error is None:
            return
        self.results[index] = error
        key = self.messages[index].ordering_key
        if key is not None:
            self.failed.setdefault(key, error)

    def held_back(self, index: int) -> bool:
        """Whether an earlier message of this one's key failed; its error becomes this one's."""
        key = self.messages[index].ordering_key
        if key is not None and key in self.failed:
            self.results[index] = self.failed[key]
            return True
        return False


class _Confirms:
    """RabbitMQ publisher confirms on one channel, waited for a batch at a time.

    ``confirm_select`` puts the channel in confirm mode; from then on the broker numbers the
    messages published on it 1, 2, 3... and acks (or nacks) them by that number, possibly
    several at once (``multiple``). py-amqp calls the ``basic_ack``/``basic_nack`` event
    callbacks as it reads those frames, which :meth:`wait` does until every tag it waits for
    has an answer, or the deadline.
    """

    def __init__(self, channel: Any) -> None:
        channel.confirm_select()
        self.last_tag = 0
        self.pending: set[int] = set()
        self.ignored: set[int] = set()
        self.answers: dict[int, BaseException | None] = {}
        channel.events["basic_ack"].add(self._ack)
        channel.events["basic_nack"].add(self._nack)
        # The broker numbers every publish on the channel, not only the outbox's task messages
        # (send_task_message also publishes the task-sent event): count them all.
        publish = channel.basic_publish

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.last_tag += 1
            self.pending.add(self.last_tag)
            return publish(*args, **kwargs)

        channel.basic_publish = counted

    def published_since(self, before: int) -> list[int]:
        """The delivery tags of the publishes after tag ``before``."""
        return list(range(before + 1, self.last_tag + 1))

    def ignore(self, tags: Iterable[int]) -> None:
        """Tags whose answers nobody waits for (dropped when they come)."""
        for tag in tags:
            if tag in self.pending:
                self.ignored.add(tag)

    def _ack(self, tag: int, multiple: bool) -> None:
        self._answer(tag, multiple, None)

    def _nack(self, tag: int, multiple: bool) -> None:
        from amqp.exceptions import MessageNacked

        self._answer(tag, multiple, MessageNacked(f"RabbitMQ refused the message (nack {tag})"))

    def _answer(self, tag: int, multiple: bool, error: BaseException | None) -> None:
        answered = [t for t in self.pending if t <= tag] if multiple else [tag]
        for t in answered:
            self.pending.discard(t)
            if t in self.ignored:
                self.ignored.discard(t)
            else:
                self.answers[t] = error

    def wait(
        self, tags: Mapping[int, int], connection: Any, deadline: float
    ) -> tuple[dict[int, BaseException | None], BaseException | None]:
        """The outcome of each message (by index) of ``tags``, and the error that stopped the
        wait (None when every message was answered)."""
        stopped: BaseException | None = None
        while any(tag in self.pending for tag in tags):
            left = deadline - time.monotonic()
            if left <= 0:
                stopped = TimeoutError("no publisher confirm from RabbitMQ in time")
                break
            try:
                connection.drain_events(timeout=left)
            except TimeoutError:
                continue  # the deadline is checked above
            except Exception as exc:  # noqa: BLE001 - the connection failed: no confirm comes
                stopped = exc
                break
        outcomes: dict[int, BaseException | None] = {}
        for tag, index in tags.items():
            if tag in self.answers:
                outcomes[index] = self.answers.pop(tag)
            else:
                assert stopped is not None
                self.pending.discard(tag)
                outcomes[index] = stopped
        return outcomes, stopped


def send_rounds(messages: Sequence[OutboxMessage]) -> list[list[int]]:
    """Indexes in sending rounds: round ``n`` holds the ``n``-th message of each ordering key
    (and round 0 every message without one)."""
    rounds: list[list[int]] = []
    seen: dict[str, int] = {}
    for index, message in enumerate(messages):
        key = message.ordering_key
        n = 0
        if key is not None:
            n = seen.get(key, 0)
            seen[key] = n + 1
        if n == len(rounds):
            rounds.append([])
        rounds[n].append(index)
    return rounds
