"""Idempotent Dramatiq actors: an actor's effect applies once per event id.

.. code-block:: python

    from django_idempotency.events.dramatiq import idempotent_actor

    @idempotent_actor(consumer="billing.ledger", queue_name="billing", max_retries=10)
    def apply_order_confirmed(event_id: str, order_id: int, amount_cents: int) -> None:
        LedgerEntry.objects.create(order_id=order_id, amount_cents=amount_cents)

:func:`idempotent_actor` is ``dramatiq.actor`` around a function that hands each message to
:func:`django_idempotency.events.core.process_event`, the same core as the Celery consumer: the
delivery is counted, the actor's body runs in one ``transaction.atomic`` with the event's
reservation (so the processed-event row commits with the effect, or not at all), a duplicate is
skipped and logged, and a poison message is parked.

Dramatiq's extension point for what happens around a message is a
:class:`dramatiq.Middleware`; :class:`IdempotentMessages` is the one this module adds to the
broker (once, when the first idempotent actor is declared). It tells the actor which message it
is running, so that:

* a message the ``Retries`` middleware sent again (``message.options["retries"] > 0``) is a
  redelivery and counts towards ``MAX_DELIVERIES`` (it starts the counter at 2 if the first
  failed delivery could not count itself);
* on RabbitMQ, a first delivery (AMQP's ``redelivered`` flag unset, no retries) skips the
  delivery count's own commit, as the Celery consumer does: if it dies with its worker, the
  broker's redelivery is flagged and counts for both. On Redis every delivery is counted.

What happens to a message:

* the event id is the actor's ``event_id`` argument (by position or keyword), else the
  ``"event_id"`` key of a first argument that is a mapping, else the message's
  ``options["event_id"]`` (where the outbox's ``DramatiqTransport`` puts it), which is then
  passed as the actor's ``event_id`` argument when it has one;
* none, or one that cannot be stored (a NUL, a lone surrogate, over 255 characters, a float):
  parked under ``no-event-id:<message id>`` with the reason and the arguments, for the admin,
  and failed without a retry (Dramatiq then moves it to its dead-letter queue);
* delivered more than ``max_deliveries`` times without completing (it raises every time, or
  kills its worker): parked, :class:`~django_idempotency.exceptions.EventParked`, failed
  without a retry. Keep the actor's ``max_retries`` at or above ``max_deliveries``, or
  ``Retries`` gives up first and dead-letters the message itself, without a parked row;
* any other exception rolls the reservation back and goes to ``Retries`` as usual.

Called directly (``apply_order_confirmed(...)``, not ``.send()``), it runs the same way, and
the errors above are raised as they are.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django_idempotency.extras import missing_extra

try:
    import dramatiq
    from dramatiq.broker import MessageProxy
except ImportError as error:  # Dramatiq is the "dramatiq" extra
    raise missing_extra("dramatiq", __name__) from error

from django_idempotency.events.core import park_message, process_event
from django_idempotency.events.ids import EVENT_ID_KEY, find_event_id, normalize_event_id
from django_idempotency.exceptions import EventParked, MissingEventId

__all__ = ["IdempotentMessages", "idempotent_actor"]

#: The exceptions that fail a message without a retry: a retry could only fail the same way.
NOT_RETRIED: tuple[type[BaseException], ...] = (EventParked, MissingEventId)

_current: contextvars.ContextVar[MessageProxy | None] = contextvars.ContextVar(
    "django_idempotency_dramatiq_message", default=None
)


class IdempotentMessages(dramatiq.Middleware):
    """Hands the message being processed to its idempotent actor (a worker thread's own)."""

    def before_process_message(self, broker: Any, message: MessageProxy) -> None:
        _current.set(message)

    def after_process_message(
        self,
        broker: Any,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        _current.set(None)

    def after_skip_message(self, broker: Any, message: MessageProxy) -> None:
        _current.set(None)


def redelivered(message: MessageProxy | None) -> bool | None:
    """What is known of this delivery: :func:`process_event`'s ``redelivered``.

    True for a message ``Retries`` sent again, or one RabbitMQ flags as redelivered; False for
    one RabbitMQ vouches was never delivered before; None otherwise (Redis, a direct call).
    """
    if message is None:
        return None
    if int(message.options.get("retries") or 0) > 0:
        return True
    flag = getattr(message, "redelivered", None)  # dramatiq's RabbitMQ messages only
    return bool(flag) if isinstance(flag, bool) else None


def idempotent_actor(
    fn: Callable[..., Any] | None = None,
    *,
    consumer: str | None = None,
    topic: str | None = None,
    ttl: timedelta | float | None = None,
    using: str | None = None,
    max_deliveries: int | None = None,
    count_deliveries: bool = True,
    broker: Any = None,
    **actor_options: Any,
) -> Any:
    """``dramatiq.actor``, whose body runs once per event id and consumer.

    :param consumer: the consumer's stable name; default the actor's name.
    :param topic: informational, shown in the admin.
    :param ttl: how long the processed-event row is kept; default ``EVENT_TTL``.
    :param using: the database alias of the business data; default ``DATABASE``.
    :param max_deliveries: deliveries before the event is parked; default ``MAX_DELIVERIES``.
        ``Retries``' retries count, so keep ``max_retries`` at or above it.
    :param count_deliveries: False skips poison counting (one commit less, and no parking).
    :param broker: the broker; default Dramatiq's global one.

    Every other keyword is ``dramatiq.actor``'s (``actor_name``, ``queue_name``, ``priority``,
    ``max_retries``, ``min_backoff``, ...). ``throws`` gains
    :class:`~django_idempotency.exceptions.EventParked` and
    :class:`~django_idempotency.exceptions.MissingEventId`.
    """

    def decorate(func: Callable[..., Any]) -> Any:
        target = broker if broker is not None else dramatiq.get_broker()
        if not any(isinstance(m, IdempotentMessages) for m in target.middleware):
            target.add_middleware(IdempotentMessages())
        name = actor_options.get("actor_name") or func.__name__
        consumer_name = consumer or name
        takes_event_id = EVENT_ID_KEY in inspect.signature(func).parameters

        @functools.wraps(func)
        def run(*args: Any, **kwargs: Any) -> Any:
            message = _current.get()
            try:
                raw = find_event_id(args, kwargs, func)
                if raw is None and message is not None:  # the outbox's DramatiqTransport
                    raw = message.options.get(EVENT_ID_KEY)
                    if raw is not None and takes_event_id:
                        kwargs = {**kwargs, EVENT_ID_KEY: raw}  # the body's event_id parameter
                if raw is None:
                    raise MissingEventId(
                        f"Actor {name} (consumer {consumer_name!r}) got a message without an "
                        f"event id. Give it an {EVENT_ID_KEY!r} argument, or a first argument "
                        f"that is a mapping with an {EVENT_ID_KEY!r} key."
                    )
                event_id = normalize_event_id(raw)
            except (ValueError, TypeError) as exc:
                if message is None:
                    raise
                reason = (
                    f"{exc} Actor {name}, message {message.message_id}; "
                    f"args={_preview(args)}, kwargs={_preview(kwargs)}"
                )
                park_message(consumer_name, message.message_id, reason, topic=topic, using=using)
                raise MissingEventId(reason) from exc
            outcome = process_event(
                consumer_name,
                event_id,
                lambda: func(*args, **kwargs),
                topic=topic,
                ttl=ttl,
                using=using,
                max_deliveries=max_deliveries,
                count_deliveries=count_deliveries,
                redelivered=redelivered(message),
            )
            return outcome.result

        options = dict(actor_options)
        if "throws" in target.actor_options:  # a broker with Retries: never retry those
            throws = options.pop("throws", ())
            throws = throws if isinstance(throws, tuple) else (throws,)
            options["throws"] = (*NOT_RETRIED, *throws)
        return dramatiq.actor(broker=target, **options)(run)

    return decorate(fn) if fn is not None else decorate


def _preview(value: object, limit: int = 500) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
