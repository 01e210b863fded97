"""A Celery task base class that makes a task an idempotent consumer.

.. code-block:: python

    from django_idempotency.events.celery import IdempotentConsumer

    @app.task(base=IdempotentConsumer, bind=True, consumer="ledger.apply")
    def apply(self, event: dict) -> None:
        LedgerEntry.objects.create(...)

The behaviour lives in :class:`IdempotentConsumerMixin`, to combine with a project's own Task
base: ``class MyConsumer(IdempotentConsumerMixin, TracingTask)``, the mixin first (the other order
raises ``TypeError``). :class:`IdempotentConsumer` is the ready-made class. The mixin wraps
``__call__`` (``before_start`` cannot hold a transaction open around the body) and hands each call
to :func:`django_idempotency.events.core.process_event`.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any, NoReturn, cast
from weakref import WeakKeyDictionary

from django.db import InterfaceError, OperationalError, connections

from django_idempotency.extras import missing_extra

try:
    from celery.app.task import Task as CeleryTask
    from celery.exceptions import Ignore, Reject, Retry

    from django_idempotency.celery_bases import DjangoTaskBase, TaskBase
except ImportError as error:  # Celery is the "celery" extra; 5.4 brought celery.contrib.django
    raise missing_extra("celery", __name__) from error

from django_idempotency import telemetry
from django_idempotency.events import celery_steps
from django_idempotency.events.core import _alias, note_outage, park_message, process_event
from django_idempotency.events.ids import (
    EVENT_ID_KEY,
    EventId,
    argument_event_id,
    find_event_id,
    normalize_event_id,
)
from django_idempotency.exceptions import EventParked, MissingEventId, OnCommitFailed, log_text

__all__ = ["IdempotentConsumer", "IdempotentConsumerMixin"]

logger = logging.getLogger(__name__)


class IdempotentConsumerMixin(TaskBase):
    """Run a Celery task's body once per event id and consumer, with its reservation.

    Task options (pass them to ``@app.task(...)`` or set them on a subclass):

    * ``consumer``: the consumer's stable name; default the task's name. Two consumers of one
      event each apply it once.
    * ``topic``: informational, shown in the admin.
    * ``event_ttl``: how long the processed-event row is kept; default ``EVENT_TTL``.
    * ``database``: the database alias of the business data; default ``DATABASE``.
    * ``max_deliveries``: deliveries before the event is parked; default ``MAX_DELIVERIES``.
      Every delivery counts, autoretry's retries included, so keep it above ``max_retries + 1``.
    * ``count_deliveries``: set False to skip poison-message counting (one transaction less per
      message, and no parking). On RabbitMQ and Redis a first delivery skips it anyway, and
      nothing is lost by that: see :meth:`broker_redelivered`.
    * ``database_retry_delay`` and ``database_retry_delay_max``: the backoff, in seconds, while
      the database is unavailable (default 1 and 60; see below).
    * ``outbox_transport``: the outbox transport its ``link`` callbacks and chain steps leave
      through (see below); default ``"default"``.

    The task defaults to ``acks_late=True``, ``reject_on_worker_lost=True`` and
    ``acks_on_timeout=False``: the message is acknowledged only after the transaction has
    committed, and a worker that dies mid-task, or a task killed at its hard time limit, gets
    its message redelivered (and parked once it has used up ``max_deliveries``).
    ``autoretry_for`` and ``self.retry()`` keep working: the retry exception rolls the
    reservation back, so the retried message runs the body again. The retry message is
    published only once the failed delivery has rolled back and been counted (see
    :meth:`retry`), so it never runs alongside that delivery, nor once more than
    ``max_deliveries``.

    What happens to a message:

    * the event id is the task's ``event_id`` parameter, passed by position or by keyword
      (``apply_payment.delay(eid, pid)`` works), else an ``event_id`` message header, else the
      ``"event_id"`` key of a first argument that is a mapping (see :meth:`get_event_id`). An
      ``int`` is taken as its decimal string;
    * no event id, or an invalid one: the message is **parked**, never run and never silently
      dropped: a parked :class:`~django_idempotency.models.EventDelivery` row under the event id
      ``no-event-id:<task id>`` keeps the reason and the message's arguments for the admin,
      ERROR is logged, and the message is rejected without requeue
      (:class:`~celery.exceptions.Reject` wrapping
      :class:`~django_idempotency.exceptions.MissingEventId`);
    * first delivery: the body runs in ``transaction.atomic`` with the reservation;
    * duplicate: the body does not run, the task returns None, ``duplicate ignored`` is logged
      and :data:`~django_idempotency.signals.event_duplicate` is sent;
    * the body raises :class:`~celery.exceptions.Ignore` (``self.replace()`` does): Celery acks
      the message and never redelivers it, so the transaction **commits** (the reservation and
      the body's writes) and ``Ignore`` is raised after the commit. A duplicate delivery is then
      skipped. ``replace()`` publishes before the commit (a failed one: twice), not via the outbox;
    * delivered more than ``max_deliveries`` times without completing (a message that kills its
      worker): parked, rejected without requeue, logged at ERROR,
      :data:`~django_idempotency.signals.event_parked` sent;
    * a database ``OperationalError`` or ``InterfaceError`` (the database is down, a deadlock, a
      lock timeout, a serialization failure) before the commit: nothing was applied, so the
      message is retried with a countdown that doubles from ``database_retry_delay`` up to
      ``database_retry_delay_max`` seconds (with jitter), for as long as the database does not
      answer; no hot requeue loop. The retries are not limited by ``max_retries``;
    * an error *after* the commit, from an ``on_commit`` callback of the body: the event is
      applied, so the message is not requeued; the task fails with
      :class:`~django_idempotency.exceptions.OnCommitFailed` and the error is kept in the
      counter's ``last_error``.

    * the delivery carries ``link`` callbacks or a chain (``apply_async(link=...)``, ``a.s() |
      consumer.s() | b.s()``): the consumer takes them over
      (:mod:`~django_idempotency.events.celery_steps`). The delivery that applies the event
      publishes each callback and the chain's next task, with the body's result, through the
      outbox (``outbox_transport``) in the effect's transaction, so they leave if and only if
      the effect commits; a duplicate publishes none. Celery's worker publishes none of them
      itself, but a group or chord, or a callback the outbox refuses for its own arguments or
      options. A result the outbox cannot store (not kombu's JSON) fails the delivery, rolled
      back. ``link_error`` errbacks stay Celery's. Eagerly, a duplicate runs no callback.

    Inside the body, ``self.request.event_id`` holds the event id, wherever the message carried
    it.

    Called eagerly (``CELERY_TASK_ALWAYS_EAGER``, ``task.apply()``) or directly, the errors
    above are raised as they are (:class:`MissingEventId`, :class:`EventParked`, the database
    error) instead of parking, rejecting or retrying: there is no broker to give the message
    back to.
    """

    consumer: str | None = None
    topic: str | None = None
    event_ttl: timedelta | float | None = None
    database: str | None = None
    max_deliveries: int | None = None
    count_deliveries: bool = True
    database_retry_delay: float = 1.0
    database_retry_delay_max: float = 60.0
    outbox_transport: str = "default"

    acks_late = True
    reject_on_worker_lost = True
    # A hard time limit kills the pool child as a crash does: the message goes back to the
    # broker, comes back flagged redelivered and is counted, and one that always hangs is
    # parked after max_deliveries. Acked (Celery's default), it left nothing behind: no row, no
    # error, when the broker vouched for its first delivery.
    acks_on_timeout = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        if CeleryTask in mro and mro.index(CeleryTask) < mro.index(IdempotentConsumerMixin):
            raise TypeError(
                f"{cls.__qualname__} lists its Task base before IdempotentConsumerMixin, so the "
                "mixin's __call__ would never run. Put the mixin first: "
                f"class {cls.__name__}(IdempotentConsumerMixin, YourTaskBase)."
            )

    @property
    def consumer_name(self) -> str:
        """The consumer's name: the ``consumer`` option, else the task's name."""
        return self.consumer or self.name

    def get_event_id(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> EventId | None:
        """Find the message's event id; override it for any other message shape.

        Looked for, in order: the task's ``event_id`` parameter, found by binding the call to
        the task's signature (a positional ``apply_payment.delay(eid, pid)`` as well as
        ``event_id=eid``); the ``event_id`` message header
        (``apply_async(headers={"event_id": ...})``); the ``"event_id"`` key of the first
        positional argument when that is a mapping. None when there is none.
        """
        value = argument_event_id(args, kwargs, self.run)
        if value is None:
            value = self._header_event_id()
        if value is None:
            value = find_event_id(args, {})
        return cast("EventId | None", value)

    def broker_redelivered(self) -> bool | None:
        """What the broker says of this delivery: :func:`process_event`'s ``redelivered``.

        * True when the message carries the ``redelivered`` flag: RabbitMQ sets it on every
          message it delivers again, kombu's Redis transport on every message it restores.
        * False when the flag is not set, on an AMQP broker (RabbitMQ) and on Redis with kombu
          5.2.4 or later: the broker vouches that such a message was never delivered before, so
          its delivery count is skipped (one commit less; the next delivery counts for it if
          this one dies with its worker). AMQP sets the flag on every redelivery. Kombu's Redis
          transport gives a message back only by restoring it (a worker that died or shut
          down, a rejected message, the visibility timeout), and since 5.2.4 (kombu#1484) every
          restore sets ``delivery_info["redelivered"]``; before, only a header Celery does not
          read, so older kombu releases are not believed.
        * None on every other broker, where a missing flag proves nothing (Celery reads a
          missing flag as False), and when the request carries no delivery information: every
          delivery is counted.

        Override it for a broker whose flag you know to be reliable.
        """
        delivery_info = self.request.delivery_info or {}
        if "redelivered" not in delivery_info:
            return None  # no word from the broker at all
        if delivery_info["redelivered"]:
            return True
        driver = _driver_type(self.app)
        if driver == "amqp" or (driver == "redis" and redis_flags_restores()):
            return False
        return None

    def _header_event_id(self) -> Any:
        request = self.request
        # Eagerly, apply_async(headers=...) arrives as request.headers. From a broker, Celery
        # merges custom headers into the message headers: request.headers holds the ones it does
        # not know, and each one also becomes an attribute of the request.
        headers = request.headers or {}
        if headers.get(EVENT_ID_KEY) is not None:
            return headers[EVENT_ID_KEY]
        return getattr(request, EVENT_ID_KEY, None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        from_broker = not (request.is_eager or request.called_directly)
        consumer = self.consumer_name
        try:
            raw = self.get_event_id(args, kwargs)
            if raw is None:
                raise MissingEventId(
                    f"Task {self.name} (consumer {consumer!r}) got a message without an event "
                    f"id. Give the task an {EVENT_ID_KEY!r} parameter, publish an "
                    f"{EVENT_ID_KEY!r} header, or a first argument that is a mapping with an "
                    f"{EVENT_ID_KEY!r} key; or override get_event_id()."
                )
            event_id = normalize_event_id(raw)
        except (ValueError, TypeError) as exc:
            if not from_broker:
                raise
            try:
                self._park_message(exc, args, kwargs)
            except (OperationalError, InterfaceError) as db_error:
                # Parking needs the database too: a message is never lost because it is down.
                self._retry_later(f"(none, task {request.id})", db_error, args, kwargs)

        # The body finds the id here wherever the message carried it.
        request.update({EVENT_ID_KEY: event_id})
        run_body = super().__call__
        ignored: list[Ignore] = []
        held: list[_Publish] = []
        taken: list[celery_steps.Taken] = []

        def body() -> Any:
            # A body that calls its own task directly nests a delivery in this request's copy:
            # once it has returned, the outer body's retries are held again.
            outer = getattr(request, _HELD_RETRIES, None)
            if from_broker:
                # The request the body runs under is a copy of this one: it shares the list.
                request.update({_HELD_RETRIES: held})
            try:
                result = run_body(*args, **kwargs)
                if from_broker:  # its callbacks and chain step leave with the effect
                    took = celery_steps.take_over(self, request, result, event_id)
                    if took is not None:
                        taken.append(took)
                return result
            except Ignore as exc:
                # Celery acks an Ignore and never redelivers: commit what the body did, then
                # raise it. A duplicate delivery is then skipped, and publishes no replacement.
                ignored.append(exc)
                return None
            finally:
                if from_broker:
                    request.update({_HELD_RETRIES: outer})

        try:
            with telemetry.consuming(consumer, telemetry.celery_carrier(request), event_id):
                try:
                    try:
                        outcome = process_event(
                            consumer,
                            event_id,
                            body,
                            topic=self.topic,
                            ttl=self.event_ttl,
                            using=self.database,
                            max_deliveries=self.max_deliveries,
                            count_deliveries=self.count_deliveries,
                            redelivered=self.broker_redelivered() if from_broker else None,
                        )
                    except BaseException as exc:
                        if taken and not isinstance(exc, OnCommitFailed):
                            # Rolled back with the effect: a retry built from the request
                            # (the database's backoff) must carry them again.
                            celery_steps.give_back(request, taken.pop())
                        raise
                except (EventParked, OperationalError, InterfaceError):
                    # Parked: refused, so never retried. A database error: retried below,
                    # once, with the database's backoff instead.
                    raise
                except Exception:
                    # Rolled back and counted: only now may a retry of it run.
                    self._publish_held(held, event_id)
                    raise
                self._publish_held(held, event_id)  # self.retry(throw=False), then committed
                if from_broker or not outcome.applied:  # eagerly: Celery runs the applied's
                    celery_steps.clear(request, self)
        except EventParked as exc:
            if not from_broker:
                raise
            raise Reject(exc, requeue=False) from exc
        except (OperationalError, InterfaceError) as exc:
            if not from_broker:
                raise
            self._retry_later(event_id, exc, args, kwargs)
        if ignored:
            raise ignored[0]
        return outcome.result

    def retry(
        self,
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
        exc: Exception | None = None,
        throw: bool = True,
        eta: datetime | None = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Retry:
        """Celery's :meth:`~celery.app.task.Task.retry`, whose message waits for the delivery.

        From a broker, inside the body, the retry message is held instead of published: it is
        published once the delivery has ended, a failed one rolled back and counted (after
        ``throw=False`` a body may also return, and commit), so the retry can never run before
        that count, in another pool child, nor once more than ``max_deliveries``. A delivery
        refused as parked, or ending in a database error (retried with the database's backoff
        instead), publishes none. Everything else is Celery's: the retry signature,
        ``max_retries`` (exceeded: ``exc`` or
        :class:`~celery.exceptions.MaxRetriesExceededError` is raised, and nothing is
        published), ``throw``, and :class:`~celery.exceptions.Reject` when the retry cannot be
        published. Eagerly, directly and outside the body, it is Celery's own.
        """
        request = self.request
        held = getattr(request, _HELD_RETRIES, None)
        if held is not None:
            request.update({_HOLDING: held})
        try:
            return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
        finally:
            if held is not None:
                request.update({_HOLDING: None})

    def apply_async(self, *args: Any, **options: Any) -> Any:
        # Inside retry() (above), the retry message is held for the end of the delivery.
        held = getattr(self.request, _HOLDING, None)
        if held is None:
            return super().apply_async(*args, **options)
        held.append((args, options))
        return None  # Celery's retry() does not look at it

    def _publish_held(self, held: list[_Publish], event_id: str) -> None:
        """Publish the retries the body asked for, now that its delivery has ended."""
        while held:
            args, options = held.pop(0)
            try:
                super().apply_async(*args, **options)
            except Exception as exc:
                # What Celery's retry() does when it cannot publish: the message is not
                # requeued, so the retry's loss is logged where the event can be found.
                logger.error(
                    "could not publish the retry of event %s, consumer %s; the message is "
                    "rejected: %s",
                    log_text(event_id),
                    log_text(self.consumer_name),
                    log_text(exc),
                )
                raise Reject(exc, requeue=False) from exc

    def _park_message(
        self, error: BaseException, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> NoReturn:
        """Park a message without a usable event id where the admin shows it, then reject it."""
        request = self.request
        reason = (
            f"{error} Task {self.name}, task id {request.id}; "
            f"args={_preview(args)}, kwargs={_preview(dict(kwargs))}"
        )
        park_message(
            self.consumer_name,
            str(request.id),
            reason,
            topic=self.topic,
            using=self.database,
        )
        missing = error if isinstance(error, MissingEventId) else MissingEventId(str(error))
        raise Reject(missing, requeue=False) from error

    def database_retry_countdown(self) -> float:
        """Seconds to wait before the next try while the database is unavailable.

        ``database_retry_delay * 2 ** retries``, capped at ``database_retry_delay_max``, of
        which a random half is taken off so that workers do not retry in step.
        """
        retries = min(int(self.request.retries or 0), 32)
        ceiling = float(min(self.database_retry_delay_max, self.database_retry_delay * 2**retries))
        return ceiling / 2 + random.uniform(0, ceiling / 2)

    def _retry_later(
        self, event_id: str, error: Exception, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> NoReturn:
        countdown = self.database_retry_countdown()
        message = (
            "database error, nothing applied, retrying in %.1fs (retry %d): event %s, "
            "consumer %s: %s"
        )
        shown = (
            countdown,
            int(self.request.retries or 0) + 1,
            log_text(event_id),
            log_text(self.consumer_name),
            log_text(error),
        )
        # While the database is unreachable every delivery comes here: one WARNING line for
        # the outage, this line at DEBUG, and one line when a delivery succeeds again.
        if note_outage(self.database, error, "deliveries retried", message, *shown):
            # Drop the lost connection now: the next delivery this process runs opens a new
            # one. Left to the worker's own clean-up, a pool child was seen failing every later
            # delivery with "the connection is lost" long after the database was back.
            connections[_alias(self.database)].close()  # the alias note_outage() looked at
        else:
            logger.warning(message, *shown)
        # Unbounded on purpose: the message waits for the database, however long it is down.
        raise self.retry(
            args=args,
            kwargs=kwargs,
            exc=error,
            countdown=countdown,
            max_retries=int(self.request.retries or 0) + 1,
        )


REDIS_REDELIVERED_SINCE = (5, 2, 4)
"""The first kombu release whose Redis transport sets ``delivery_info["redelivered"]`` on every
message it restores (kombu#1484)."""


def redis_flags_restores(version: tuple[Any, ...] | None = None) -> bool:
    """Whether the installed kombu's Redis transport flags every message it restores."""
    if version is None:
        import kombu

        version = tuple(getattr(kombu, "VERSION", ()))
    return tuple(int(part) for part in version[:3]) >= REDIS_REDELIVERED_SINCE


_HELD_RETRIES = "_idempotency_held_retries"
"""The request attribute under which the body's retry messages wait (a list), while it runs."""
_HOLDING = "_idempotency_holding"
"""Set (to that list) while :meth:`IdempotentConsumerMixin.retry` runs Celery's retry."""
_Publish = tuple[tuple[Any, ...], dict[str, Any]]
"""A held ``apply_async`` call: its positional arguments and its options."""

_DRIVER_TYPES: WeakKeyDictionary[Any, tuple[Any, str]] = WeakKeyDictionary()
"""Celery app -> (its broker URLs, their kombu driver type: "amqp", "redis", "memory", ...)."""


def _driver_type(app: Any) -> str:
    """The kind of broker an app reads from; the transport is built, never connected."""
    urls = (app.conf.broker_read_url, app.conf.broker_url)
    cached = _DRIVER_TYPES.get(app)
    if cached is None or cached[0] != urls:
        with app.connection_for_read() as connection:
            cached = (urls, str(connection.transport.driver_type))
        _DRIVER_TYPES[app] = cached
    return cached[1]


def _preview(value: object, limit: int = 500) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class IdempotentConsumer(IdempotentConsumerMixin, DjangoTaskBase):
    """The ready-made idempotent consumer Task base: ``@app.task(base=IdempotentConsumer, ...)``.

    It derives from Celery's ``DjangoTask``, so producers keep ``delay_on_commit()`` and
    ``apply_async_on_commit()``.
    """
