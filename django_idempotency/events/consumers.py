"""The decorator for plain consumer functions, a thin adapter over the event core.

:func:`idempotent_consumer` makes a Kafka, NATS or SQS loop's handler run once per event. The
Celery adapter is :mod:`django_idempotency.events.celery`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from datetime import timedelta
from typing import ParamSpec, TypeVar

from django_idempotency.events.core import process_event
from django_idempotency.events.ids import EventId, checked_name, find_event_id
from django_idempotency.exceptions import MissingEventId

__all__ = ["idempotent_consumer"]

P = ParamSpec("P")
R = TypeVar("R")


def idempotent_consumer(
    consumer: str,
    event_id: Callable[..., EventId | None] | None = None,
    *,
    topic: str | Callable[..., str | None] | None = None,
    ttl: timedelta | float | None = None,
    using: str | None = None,
    max_deliveries: int | None = None,
    count_deliveries: bool = True,
    redelivered: Callable[..., bool | None] | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
    """Make a plain consumer function (a Kafka, NATS or SQS loop's handler) run once per event.

    .. code-block:: python

        @idempotent_consumer("billing.order-confirmed", event_id=lambda evt: evt["event_id"])
        def on_order_confirmed(evt: dict) -> None:
            LedgerEntry.objects.create(...)

    Each call counts the delivery (see :func:`process_event`), opens
    ``transaction.atomic(using=...)``, reserves the event and runs the function only the first
    time. A duplicate returns None and logs ``duplicate ignored`` with the event id and consumer.
    An event delivered more than ``max_deliveries`` times without completing raises
    :class:`~django_idempotency.exceptions.EventParked`: acknowledge it (or send it to a dead
    letter queue) and go on.

    :param consumer: the consumer's stable name. Renaming it makes every event new again.
    :param event_id: called with the function's arguments, returns the event id. Default: the
        function's ``event_id`` parameter, passed by position or by keyword, or the ``"event_id"``
        key of the first positional argument when that is a mapping. An ``int`` id is taken as
        its decimal string. No id raises
        :class:`~django_idempotency.exceptions.MissingEventId`.
    :param topic: a string, or a callable of the function's arguments; informational.
    :param ttl: how long the processed-event row is kept; default ``EVENT_TTL``.
    :param using: the database alias; default the ``DATABASE`` setting.
    :param max_deliveries: deliveries before the event is parked; default ``MAX_DELIVERIES``.
    :param count_deliveries: False skips poison-message counting (and parking).
    :param redelivered: called with the function's arguments, returns what the broker says of
        the message: False if the broker vouches that it was never delivered before, which
        skips that delivery's count (one commit less); True if it may have been; None if it
        does not say. Default: None for every message. See
        :func:`~django_idempotency.events.core.process_event` for when False is safe. For example
        ``redelivered=lambda msg: msg.delivery_info["redelivered"]`` for an AMQP (RabbitMQ)
        message, or ``lambda msg: int(msg.attributes["ApproximateReceiveCount"]) > 1`` for
        SQS.
    """
    checked_name("consumer name", consumer)

    def decorate(func: Callable[P, R]) -> Callable[P, R | None]:
        if inspect.iscoroutinefunction(func):
            raise TypeError(
                f"@idempotent_consumer cannot wrap the coroutine function {func.__qualname__}: "
                "the reservation and the effect share a synchronous database transaction. Call "
                "a synchronous handler through asgiref.sync.sync_to_async instead."
            )

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
            raw = (
                event_id(*args, **kwargs)
                if event_id is not None
                else find_event_id(args, kwargs, func)
            )
            if raw is None:
                raise MissingEventId(
                    f"Consumer {consumer!r} ({func.__qualname__}) got a message without an event "
                    "id. Pass event_id=... to @idempotent_consumer to say where it is."
                )
            topic_value = topic(*args, **kwargs) if callable(topic) else topic
            flag = redelivered(*args, **kwargs) if redelivered is not None else None
            outcome = process_event(
                consumer,
                raw,
                functools.partial(func, *args, **kwargs),
                topic=topic_value,
                ttl=ttl,
                using=using,
                max_deliveries=max_deliveries,
                count_deliveries=count_deliveries,
                redelivered=flag,
            )
            return outcome.result

        return wrapper

    return decorate
