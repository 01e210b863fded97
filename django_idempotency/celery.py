"""A Celery task base class that makes a task an idempotent consumer.

.. code-block:: python

    from django_idempotency.celery import IdempotentConsumer

    @app.task(base=IdempotentConsumer, bind=True, consumer="ledger.apply")
    def apply(self, event: dict) -> None:
        LedgerEntry.objects.create(...)

The behaviour lives in :class:`IdempotentConsumerMixin`, to combine with a project's own Task
base: ``class MyConsumer(IdempotentConsumerMixin, TracingTask)``, the mixin first (the other order
raises ``TypeError``). :class:`IdempotentConsumer` is the ready-made class. The mixin wraps
``__call__`` (``before_start`` cannot hold a transaction open around the body) and hands each call
to :func:`django_idempotency.events.process_event`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

from django.db import OperationalError

from django_idempotency.extras import missing_extra

try:
    from celery.app.task import Task as CeleryTask
    from celery.contrib.django.task import DjangoTask
    from celery.exceptions import Reject
except ImportError as error:  # Celery is the "celery" extra; 5.4 brought celery.contrib.django
    raise missing_extra("celery", __name__) from error

from django_idempotency.events import (
    EVENT_ID_KEY,
    EventId,
    find_event_id,
    normalize_event_id,
    process_event,
)
from django_idempotency.exceptions import EventParked, MissingEventId

__all__ = ["IdempotentConsumer", "IdempotentConsumerMixin"]

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from celery import Task

    _TaskBase = Task[..., Any]
    _DjangoTaskBase = DjangoTask[..., Any]
else:
    # Celery's Task classes are not subscriptable at run time in every supported release.
    _TaskBase = object
    _DjangoTaskBase = DjangoTask


class IdempotentConsumerMixin(_TaskBase):
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
      message, and no parking).

    The task defaults to ``acks_late=True`` and ``reject_on_worker_lost=True``: the message is
    acknowledged only after the transaction has committed, and a worker that dies mid-task gets
    its message redelivered. ``autoretry_for`` and ``self.retry()`` keep working: the retry
    exception rolls the reservation back, so the retried message runs the body again.

    What happens to a message:

    * no event id, or an invalid one: rejected without requeue
      (:class:`~celery.exceptions.Reject` wrapping
      :class:`~django_idempotency.exceptions.MissingEventId`), logged at ERROR; never retried;
    * first delivery: the body runs in ``transaction.atomic`` with the reservation;
    * duplicate: the body does not run, the task returns None, ``duplicate ignored`` is logged
      and :data:`~django_idempotency.signals.event_duplicate` is sent;
    * delivered more than ``max_deliveries`` times without completing (a message that kills its
      worker): parked, rejected without requeue, logged at ERROR,
      :data:`~django_idempotency.signals.event_parked` sent;
    * a database ``OperationalError`` (deadlock, lock timeout, serialization failure, lost
      connection) that escapes the transaction: nothing was applied, so the message is rejected
      *with* requeue and comes back; each return is counted, so this cannot loop past
      ``max_deliveries``.

    Inside the body, ``self.request.event_id`` holds the event id, wherever the message carried
    it.

    Called eagerly (``CELERY_TASK_ALWAYS_EAGER``, ``task.apply()``) or directly, the errors
    above are raised as they are (:class:`MissingEventId`, :class:`EventParked`, the database
    error) instead of becoming a ``Reject``: there is no broker to give the message back to.
    """

    consumer: str | None = None
    topic: str | None = None
    event_ttl: timedelta | float | None = None
    database: str | None = None
    max_deliveries: int | None = None
    count_deliveries: bool = True

    acks_late = True
    reject_on_worker_lost = True

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

        Looked for, in order, in the ``event_id`` keyword argument, the ``event_id`` message
        header (``apply_async(headers={"event_id": ...})``), and the ``"event_id"`` key of the
        first positional argument when that is a mapping. None when there is none.
        """
        value = kwargs.get(EVENT_ID_KEY)
        if value is None:
            value = self._header_event_id()
        if value is None:
            value = find_event_id(args, {})
        return cast("EventId | None", value)

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
                    f"id. Publish it with an {EVENT_ID_KEY!r} keyword argument, an "
                    f"{EVENT_ID_KEY!r} header, or a first argument that is a mapping with an "
                    f"{EVENT_ID_KEY!r} key; or override get_event_id()."
                )
            event_id = normalize_event_id(raw)
        except (ValueError, TypeError) as exc:
            if not from_broker:
                raise
            logger.error(
                "message rejected, no valid event id: task %s, consumer %s, task id %s: %s",
                self.name,
                consumer,
                request.id,
                exc,
            )
            error = exc if isinstance(exc, MissingEventId) else MissingEventId(str(exc))
            raise Reject(error, requeue=False) from exc

        # The body finds the id here wherever the message carried it.
        request.update({EVENT_ID_KEY: event_id})
        run_body = super().__call__
        try:
            outcome = process_event(
                consumer,
                event_id,
                lambda: run_body(*args, **kwargs),
                topic=self.topic,
                ttl=self.event_ttl,
                using=self.database,
                max_deliveries=self.max_deliveries,
                count_deliveries=self.count_deliveries,
            )
        except EventParked as exc:
            if not from_broker:
                raise
            raise Reject(exc, requeue=False) from exc
        except OperationalError as exc:
            if not from_broker:
                raise
            logger.warning(
                "database error, nothing applied, message requeued: event %s, consumer %s: %s",
                event_id,
                consumer,
                exc,
            )
            raise Reject(exc, requeue=True) from exc
        return outcome.result


class IdempotentConsumer(IdempotentConsumerMixin, _DjangoTaskBase):
    """The ready-made idempotent consumer Task base: ``@app.task(base=IdempotentConsumer, ...)``.

    It derives from Celery's ``DjangoTask``, so producers keep ``delay_on_commit()`` and
    ``apply_async_on_commit()``.
    """
