"""Idempotent Django tasks: a task's effect applies once per event id.

.. code-block:: python

    from django.tasks import task  # Django 6.0+; on Django 5.2: from django_tasks import task

    from django_idempotency.events.django_tasks import idempotent_task

    @task()
    @idempotent_task("billing.ledger")
    def apply_order_confirmed(event_id: str, order_id: int, amount_cents: int) -> int:
        return LedgerEntry.objects.create(order_id=order_id, amount_cents=amount_cents).pk

:func:`idempotent_task` goes **under** ``@task``: the task keeps the wrapped function, so every
backend and worker (the ``db_worker`` of django-tasks-db, or any other) runs the wrapper. The
wrapper finds the event id among the call's arguments and hands the call to
:func:`django_idempotency.events.core.process_event`, the same core as the Celery consumer: the
delivery
is counted, the body runs in one transaction with the event's reservation, a duplicate is skipped
and a poison task is parked.

The module imports nothing from ``django.tasks`` or the ``django_tasks`` backport: it wraps a
plain function, so it imports whether or not a tasks framework is installed.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from datetime import timedelta
from typing import Any, ParamSpec, TypeVar

from django_idempotency.events.consumers import idempotent_consumer
from django_idempotency.events.ids import EVENT_ID_KEY, checked_event_id
from django_idempotency.exceptions import InvalidEventId, MissingEventId

__all__ = ["idempotent_task"]

P = ParamSpec("P")
R = TypeVar("R")

_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def idempotent_task(
    consumer: str,
    *,
    event_id_arg: str = EVENT_ID_KEY,
    topic: str | None = None,
    ttl: timedelta | float | None = None,
    using: str | None = None,
    max_deliveries: int | None = None,
    count_deliveries: bool = True,
) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
    """Make a Django task's function run once per event id; put it under ``@task``.

    The event id is the argument passed for the parameter ``event_id_arg`` (default
    ``event_id``), positionally or by keyword: ``task.enqueue(evt_id, ...)`` and
    ``task.enqueue(event_id=evt_id, ...)`` name the same event. A ``str``, a
    :class:`uuid.UUID` or an ``int`` (stored as its decimal string, so ``42`` and ``"42"`` are one
    id).

    Each run counts the delivery, opens ``transaction.atomic(using=...)``, reserves the event and
    runs the function only the first time; the reservation commits with the function's writes. A
    duplicate returns None and logs ``duplicate ignored``. A run without an event id raises
    :class:`~django_idempotency.exceptions.MissingEventId`; an event run more than
    ``max_deliveries`` times without completing (a task that kills its worker) raises
    :class:`~django_idempotency.exceptions.EventParked`. Both leave the task result ``FAILED``.

    :param consumer: the consumer's stable name. Renaming it makes every event new again.
    :param event_id_arg: the name of the function's parameter that carries the event id.
    :param topic: informational, shown in the admin.
    :param ttl: how long the processed-event row is kept; default ``EVENT_TTL``.
    :param using: the database alias of the business data; default ``DATABASE``.
    :param max_deliveries: runs before the event is parked; default ``MAX_DELIVERIES``.
    :param count_deliveries: False skips poison counting (and parking).
    :raises TypeError: at decoration, when the function has no ``event_id_arg`` parameter, is a
        coroutine function, or is already a task (``@idempotent_task`` above ``@task``).
    """

    def decorate(func: Callable[P, R]) -> Callable[P, R | None]:
        if not inspect.isfunction(func):
            raise TypeError(
                f"@idempotent_task wraps a plain function, not {func!r}. Put it under @task: "
                "@task() first, then @idempotent_task(...), then def."
            )
        name = func.__qualname__
        if inspect.iscoroutinefunction(func):
            raise TypeError(
                f"@idempotent_task cannot wrap the coroutine function {name}: the reservation "
                "and the effect share a synchronous database transaction. Make the task "
                "function synchronous."
            )
        signature = inspect.signature(func)
        parameter = signature.parameters.get(event_id_arg)
        if parameter is None or parameter.kind in _VARIADIC:
            raise TypeError(
                f"Task function {name} has no parameter {event_id_arg!r} to take the event id "
                f"from. Add one, or name it: @idempotent_task(..., event_id_arg='<parameter>')."
            )

        def event_id(*args: Any, **kwargs: Any) -> str:
            try:
                arguments = signature.bind(*args, **kwargs).arguments
            except TypeError as exc:
                raise TypeError(
                    f"Task {name} was enqueued with arguments that do not fit: {exc}"
                ) from exc
            value = arguments.get(event_id_arg, parameter.default)
            if value is None:
                raise MissingEventId(
                    f"Task {name} (consumer {consumer!r}) was enqueued without an event id: pass "
                    f"the {event_id_arg!r} argument, positionally or by keyword."
                )
            return _event_id(value, name)

        return idempotent_consumer(
            consumer,
            event_id=event_id,
            topic=topic,
            ttl=ttl,
            using=using,
            max_deliveries=max_deliveries,
            count_deliveries=count_deliveries,
        )(func)

    return decorate


def _event_id(value: object, task: str) -> str:
    """The stored form of an event id argument (see
    :func:`~django_idempotency.events.ids.checked_event_id`). One that cannot be stored (a float,
    a bool, a dict, a blank or over-long string, a NUL or a lone surrogate) raises
    :class:`~django_idempotency.exceptions.InvalidEventId` naming the task, before the database
    sees it: the task fails with that clear error, and nothing is counted."""
    try:
        return checked_event_id(value)
    except InvalidEventId as exc:
        raise InvalidEventId(f"Task {task} got an event id it cannot use: {exc}") from exc
