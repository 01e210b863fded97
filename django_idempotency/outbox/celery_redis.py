"""The Celery transport's Redis mode: a batch of task messages written in one pipeline.

:class:`~django_idempotency.outbox.transports.CeleryTransport` builds each task message with
Celery's own calls (the router, ``create_task_message``, ``send_task_message``). Through kombu,
that cost about 110 µs a message on Redis, half of what one relay spent per message
(``python -m bench.outbox``, issue 28). Two things here cut it, and a message on the wire stays
byte for byte what kombu would write, but for its ``delivery_tag`` (a fresh uuid either way):

* :class:`RedisBatch` stands in for kombu's ``Producer`` in ``send_task_message``: its
  :meth:`~RedisBatch.publish` does what ``Producer.publish`` and the Redis channel's
  ``basic_publish`` do for a message to the default (anonymous, direct) exchange, serialize
  the body, ``prepare_message``, encode the body, the delivery tag and the priority's list, and
  queues the ``LPUSH`` here. A batch's messages go in one pipeline at the end, one ``LPUSH`` per
  list (Redis pushes a command's values in order, so a list's order is the call's).
* Copies: the first message of a batch for a task and options (and header names) is built by
  Celery as above; the others with the same are copies of the written message, with their own
  task id, arguments and headers, under the rules of
  :mod:`~django_idempotency.outbox.celery_copies` (which ``CeleryTransport`` checks per batch).

A message this does not cover (another exchange, a queue with ``x-expires``, compression) is
published by kombu's own ``Producer.publish``, once the messages before it in the batch are
written, so a key's order holds; a protocol other than 2 (:func:`covered`) sends the whole batch
through kombu's ``Producer.batch``. The private kombu calls used
(``Channel._q_for_pri``, ``_get_message_priority``, ``_next_delivery_tag`` and ``_expires``)
are those kombu's own publish makes; ``tests/test_celery_redis.py`` compares what both paths
write, message by message, on generated messages, on every kombu version the project supports.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from django_idempotency.outbox.celery_copies import copied_body, copied_headers

# kombu is imported where it is used: this module is imported with the transports, which a
# project without Celery (Kafka only) imports too.

__all__ = ["RedisBatch", "covered"]


def covered(app: Any, channel: Any) -> bool:
    """Whether this app and channel are ones :class:`RedisBatch` writes for at all."""
    from kombu.transport import redis as kombu_redis

    return (
        isinstance(channel, kombu_redis.Channel)
        and int(app.conf.task_protocol) == 2
        and not app.conf.task_compression
    )


class _Template:
    """One message as written, and what differs between it and the next of its kind."""

    __slots__ = ("embed", "key", "message", "serializer")

    def __init__(self, key: str, message: dict[str, Any], embed: Any, serializer: str) -> None:
        self.key = key
        self.message = message
        self.embed = embed
        self.serializer = serializer


class RedisBatch:
    """A batch of task messages for one Redis channel, written by :meth:`execute`.

    Pass it to ``app.amqp.send_task_message`` as the producer: Celery calls :meth:`publish`. A
    message it does not cover goes to kombu's own ``producer`` (``Producer.publish``) once the
    batch's earlier messages are written (:meth:`flush`), so one key's messages keep their
    order and every message is built once (a publish signal's receiver sees it once).
    Before each message the transport sets :attr:`index`, its place in the call; the places
    written so far are in :attr:`written`.
    """

    def __init__(self, producer: Any, templates: bool) -> None:
        self.producer = producer
        self.channel = producer.channel
        self.connection = producer.connection
        self.default_delivery_mode = producer.exchange.delivery_mode
        self.templates_on = templates
        self.lists: dict[str, list[str]] = {}
        self.templates: dict[tuple[Any, ...], _Template] = {}
        self.index = -1
        self.held: list[int] = []
        """The places of the messages in :attr:`lists`, not written yet."""
        self.written: list[int] = []
        """The places of the messages written by a :meth:`flush` during the call."""
        self._last: _Template | None = None
        self._key = ""

    # --- Built by Celery ------------------------------------------------------------------

    def publish(self, body: Any, **options: Any) -> Any:
        """What ``Producer.publish`` and ``Channel.basic_publish`` write for this message
        (``options`` are ``Producer.publish``'s), or kombu's own publish of it."""
        from kombu.common import maybe_declare
        from kombu.entity import maybe_delivery_mode
        from kombu.serialization import dumps as serialize

        self._last = None
        routing_key = options.get("routing_key")
        exchange = options.get("exchange")
        if (
            getattr(exchange, "name", exchange)
            or options.get("compression")
            or options.get("content_type")
            or options.get("retry")
            or not routing_key
        ):
            return self._by_kombu(body, options)  # an exchange, compression, a raw body
        channel = self.channel
        known = {
            "routing_key", "delivery_mode", "mandatory", "immediate", "priority",
            "content_type", "content_encoding", "serializer", "headers", "compression",
            "exchange", "retry", "retry_policy", "declare", "expiration", "timeout",
            "confirm_timeout",
        }  # fmt: skip
        properties = {key: value for key, value in options.items() if key not in known}
        properties["delivery_mode"] = maybe_delivery_mode(
            options.get("delivery_mode") or self.default_delivery_mode
        )
        expiration = options.get("expiration")
        if expiration is not None:
            properties["expiration"] = str(int(expiration * 1000))
        serializer = options.get("serializer")
        content_type, content_encoding, data = serialize(body, serializer=serializer)
        message = channel.prepare_message(
            data,
            options.get("priority", 0),
            content_type,
            content_encoding,
            options.get("headers"),
            properties,
        )
        for entity in options.get("declare") or ():
            maybe_declare(entity, channel)
        if channel._expires and routing_key in channel._expires:  # known once declared
            return self._by_kombu(body, options)  # its PEXPIREs are kombu's
        self._augment(message, routing_key)
        if expiration is None and isinstance(body, tuple) and len(body) == 3:
            self._last = _Template("", message, body[2], serializer or "json")
        return None

    def _by_kombu(self, body: Any, options: dict[str, Any]) -> Any:
        """Publish through kombu's producer, after the batch's earlier messages."""
        self.flush()
        published = self.producer.publish(body, **options)
        self.written.append(self.index)
        return published

    def _augment(self, message: dict[str, Any], routing_key: str) -> None:
        """``basic_publish`` and ``_put``: the encoded body, the tag, the priority's list."""
        from kombu.utils.json import dumps as wire_json

        channel = self.channel
        message["body"], body_encoding = channel.encode_body(
            message["body"], channel.body_encoding
        )
        props = message["properties"]
        props.update(body_encoding=body_encoding, delivery_tag=channel._next_delivery_tag())
        props["delivery_info"].update(exchange="", routing_key=routing_key)
        priority = channel._get_message_priority(message, reverse=False)
        key = channel._q_for_pri(routing_key, priority)
        self.lists.setdefault(key, []).append(wire_json(message))
        self.held.append(self.index)
        self._key = key

    # --- Copies ---------------------------------------------------------------------------

    def remember(self, kind: tuple[Any, ...]) -> None:
        """Keep the message just published as the template of its ``kind`` (unless it had an
        expiry, a moment computed per message)."""
        last, self._last = self._last, None
        if self.templates_on and last is not None:
            last.key = self._key
            self.templates[kind] = last

    def copy(
        self,
        kind: tuple[Any, ...],
        task_id: str,
        args: list[Any],
        kwargs: dict[str, Any],
        argsrepr: Callable[[], str],
        kwargsrepr: Callable[[], str],
        headers: Mapping[str, Any],
    ) -> bool:
        """Write a copy of ``kind``'s template for this task; False when there is none yet."""
        template = self.templates.get(kind)
        if template is None:
            return False
        from kombu.serialization import dumps as serialize
        from kombu.utils.json import dumps as wire_json

        source = template.message
        message_headers = copied_headers(source["headers"], task_id, argsrepr, kwargsrepr, headers)
        channel = self.channel
        body_value = copied_body(args, kwargs, template.embed)
        _, _, data = serialize(body_value, serializer=template.serializer)
        body, _ = channel.encode_body(data, source["properties"]["body_encoding"])
        props = dict(source["properties"])
        props["correlation_id"] = task_id
        props["delivery_info"] = dict(props["delivery_info"])
        props["delivery_tag"] = channel._next_delivery_tag()
        message = {
            "body": body,
            "content-encoding": source["content-encoding"],
            "content-type": source["content-type"],
            "headers": message_headers,
            "properties": props,
        }
        self.lists.setdefault(template.key, []).append(wire_json(message))
        self.held.append(self.index)
        return True

    # --- Writing --------------------------------------------------------------------------

    def execute(self, client: Any) -> None:
        """Write what the batch holds: one pipeline, one ``LPUSH`` per list. Raises if Redis
        refuses (then none of it counts as written)."""
        if not self.lists:
            return
        with client.pipeline(transaction=False) as pipeline:
            for key, values in self.lists.items():
                pipeline.lpush(key, *values)
            pipeline.execute()
        self.lists = {}

    def flush(self) -> None:
        """Write what the batch holds now (before a message kombu publishes itself)."""
        if not self.lists:
            return
        with self.channel.conn_or_acquire() as client:
            self.execute(client)
        self.written.extend(self.held)
        self.held = []
