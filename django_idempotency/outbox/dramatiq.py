"""The outbox relay's way to Dramatiq: ``DramatiqTransport``, on RabbitMQ and Redis.

.. code-block:: python

    IDEMPOTENCY = {
        "OUTBOX_TRANSPORTS": {
            "dramatiq": {
                "BACKEND": "django_idempotency.outbox.dramatiq.DramatiqTransport",
                "OPTIONS": {"broker_url": "amqp://guest:guest@127.0.0.1:5672/%2F"},
            },
        },
    }

    with transaction.atomic():
        order.save()
        outbox.send(
            "apply_order_confirmed",  # the actor's name
            dramatiq_envelope(kwargs={"order_id": order.pk}, queue_name="billing"),
            key=f"order-{order.pk}",
            transport="dramatiq",
        )

Each outbox row becomes the Dramatiq message ``actor.send_with_options(args=..., kwargs=...)``
would enqueue, with the event id as its ``message_id`` and in its ``options["event_id"]``, where
:func:`~django_idempotency.events.dramatiq.idempotent_actor` finds it when the arguments carry
none. A worker consumes it as any other message of the actor.

The sending rules are the Celery transport's (:class:`~.transports.CeleryTransport`):

* a message counts as sent only once the broker has it: on RabbitMQ after its publisher
  confirm (the broker is built with ``confirm_delivery=True``, and ``mandatory``, so a message
  no queue takes fails), on Redis once Redis has answered its ``LPUSH``;
* messages of one ordering key are enqueued in their order, one after the other; after a
  failure, the later messages of that key in the call are not sent and report the same error;
* a lost connection fails the rest of the call, and the broker is built again for the next one;
* no broker call waits longer than ``timeout`` seconds (pika's socket, blocked-connection and
  stack timeouts; Redis's socket timeouts), ``connect_timeout`` for the connection, and
  :meth:`DramatiqTransport.limit_to_lease` keeps both within a quarter of the relay's lease.
  The relay retries with backoff; Dramatiq's own enqueue retries a lost RabbitMQ connection up
  to three times within one call.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from django_idempotency.events.ids import EVENT_ID_KEY
from django_idempotency.outbox.transports import (
    OutboxMessage,
    _checked_timeouts,
    _envelope_parts,
    _limit_to_lease,
)

__all__ = ["DRAMATIQ_OPTIONS", "DramatiqTransport", "dramatiq_envelope"]

logger = logging.getLogger(__name__)

DRAMATIQ_OPTIONS = frozenset(
    {"queue_name", "max_retries", "min_backoff", "max_backoff", "time_limit", "max_age"}
)
"""The message options an outbox message may carry: where it goes, and the per-message options
of Dramatiq's ``Retries``, ``TimeLimit`` and ``AgeLimit`` middleware (JSON values). A ``delay``
is refused: ``outbox.send(..., countdown=...)`` (counted from the commit) or ``eta=`` makes the
relay hold the message until it is due."""


def dramatiq_envelope(
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """The payload of a Dramatiq message: ``{"args": [...], "kwargs": {...}, "options": {...}}``.

    :raises TypeError: an option not in :data:`DRAMATIQ_OPTIONS`.
    """
    unknown = set(options) - DRAMATIQ_OPTIONS
    if unknown:
        raise TypeError(
            f"Unsupported Dramatiq option(s) for the outbox: {', '.join(sorted(unknown))}. "
            f"Supported: {', '.join(sorted(DRAMATIQ_OPTIONS))}. For a delay, pass outbox.send() "
            "a countdown or an eta: the relay holds the message until it is due."
        )
    return {"args": list(args or ()), "kwargs": dict(kwargs or {}), "options": dict(options)}


def _parts(destination: str, payload: Any) -> tuple[list[Any], dict[str, Any], dict[str, Any]]:
    args, kwargs, options = _envelope_parts(
        destination, payload, "Dramatiq actor", "dramatiq_envelope()"
    )
    dramatiq_envelope(**options)  # unknown options raise TypeError
    return args, kwargs, options


class DramatiqTransport:
    """Enqueue outbox messages as Dramatiq messages, and wait until the broker has them.

    :param broker: a Dramatiq broker, or its dotted path. Default: one built from
        ``broker_url``, else Dramatiq's global broker. A broker given here is used as it is
        (build a RabbitMQ one with ``confirm_delivery=True``, or nothing is confirmed).
    :param broker_url: ``amqp://...`` (RabbitMQ, with publisher confirms) or ``redis://...``.
    :param queue_name: the queue of a message whose options name none; default the queue of the
        actor when it is declared in this process, else ``"default"`` (Dramatiq's).
    :param connect_timeout: seconds to wait for the broker's connection.
    :param timeout: the most seconds any one broker call may wait (default 10).
    """

    def __init__(
        self,
        broker: Any = None,
        broker_url: str | None = None,
        queue_name: str | None = None,
        connect_timeout: float = 5.0,
        timeout: float = 10.0,
    ) -> None:
        self.connect_timeout, self.timeout = _checked_timeouts(
            "DramatiqTransport", connect_timeout, timeout
        )
        if broker is not None and broker_url is not None:
            raise ImproperlyConfigured(
                "DramatiqTransport takes a broker or a broker_url, not both."
            )
        if broker_url is not None and not broker_url.startswith(("amqp", "redis", "rediss")):
            raise ImproperlyConfigured(
                f"DramatiqTransport broker_url must be amqp://... or redis://..., not "
                f"{broker_url!r}."
            )
        self._broker_spec = broker
        self.broker_url = broker_url
        self.queue_name = queue_name
        self._broker: Any = None

    def limit_to_lease(self, lease: float) -> None:
        """Keep every broker call within a quarter of the relay's ``lease`` (seconds)."""
        _limit_to_lease(self, lease)

    # --- Validation -------------------------------------------------------------------------

    def validate_message(self, destination: str, payload: Any, headers: dict[str, str]) -> None:
        """Refuse a message no worker could run (called when it is written).

        :raises TypeError: the payload is not a :func:`dramatiq_envelope`, or has an option
            Dramatiq messages cannot carry.
        :raises ValueError: an empty actor name, or headers that are not strings.
        """
        if not isinstance(destination, str) or not destination:
            raise ValueError(f"A Dramatiq destination is an actor name, not {destination!r}.")
        if not isinstance(headers, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
        ):
            raise ValueError("Dramatiq message headers must map strings to strings.")
        _parts(destination, payload)

    # --- Sending ----------------------------------------------------------------------------

    def _open(self) -> Any:
        if self._broker is None:
            self._broker = self._build()
        return self._broker

    def _build(self) -> Any:
        import dramatiq

        spec = self._broker_spec
        if isinstance(spec, str):
            return import_string(spec)
        if spec is not None:
            return spec
        if self.broker_url is None:
            return dramatiq.get_broker()
        if self.broker_url.startswith("amqp"):
            import pika  # type: ignore[import-untyped]
            from dramatiq.brokers.rabbitmq import RabbitmqBroker

            parameters = pika.URLParameters(self.broker_url)
            parameters.socket_timeout = self.connect_timeout
            parameters.stack_timeout = self.connect_timeout
            parameters.blocked_connection_timeout = self.timeout
            broker = RabbitmqBroker(confirm_delivery=True, middleware=[])
            broker.parameters = parameters
            return broker
        from dramatiq.brokers.redis import RedisBroker

        return RedisBroker(  # type: ignore[no-untyped-call]
            url=self.broker_url,
            middleware=[],
            socket_timeout=self.timeout,
            socket_connect_timeout=self.connect_timeout,
        )

    def _queue_of(self, broker: Any, actor: str, options: Mapping[str, Any]) -> str:
        if options.get("queue_name"):
            return str(options["queue_name"])
        if self.queue_name:
            return self.queue_name
        try:
            return str(broker.get_actor(actor).queue_name)
        except Exception:  # noqa: BLE001 - not declared here (ActorNotFound): Dramatiq's default
            return "default"

    def send(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        try:
            broker = self._open()
        except Exception as exc:  # noqa: BLE001 - the broker cannot be built: nothing is sent
            self.close(broken=True)
            return [exc] * len(messages)
        from dramatiq import Message
        from dramatiq.errors import BrokerConnectionError

        results: list[BaseException | None] = [None] * len(messages)
        failed_keys: dict[str, BaseException] = {}
        lost: BaseException | None = None
        for index, message in enumerate(messages):
            key = message.ordering_key
            if lost is not None:
                results[index] = lost
                continue
            if key is not None and key in failed_keys:
                results[index] = failed_keys[key]  # held back behind an earlier failure
                continue
            try:
                args, kwargs, options = _parts(message.destination, message.payload)
                options[EVENT_ID_KEY] = message.event_id
                if message.headers:
                    options["headers"] = dict(message.headers)
                queue = self._queue_of(broker, message.destination, options)
                options.pop("queue_name", None)
                broker.enqueue(
                    Message(
                        queue_name=queue,
                        actor_name=message.destination,
                        args=tuple(args),
                        kwargs=kwargs,
                        options=options,
                        message_id=message.event_id,
                    )
                )
            except Exception as exc:  # noqa: BLE001 - reported to the relay, which retries it
                results[index] = exc
                if key is not None:
                    failed_keys[key] = exc
                if _is_connection_error(exc, BrokerConnectionError):
                    lost = exc
                    self.close(broken=True)
        return results

    def close(self, broken: bool = False) -> None:
        """Release the broker's connections (a broker passed in is left to its owner)."""
        broker, self._broker = self._broker, None
        if broker is None or self._broker_spec is not None or self.broker_url is None:
            return
        try:
            broker.close()
        except Exception:
            logger.debug("closing the Dramatiq transport's broker failed", exc_info=True)


def _is_connection_error(exc: BaseException, dramatiq_error: type[BaseException]) -> bool:
    if isinstance(exc, (dramatiq_error, OSError, TimeoutError)):
        return True
    module = type(exc).__module__
    return module.startswith(("pika", "redis"))
