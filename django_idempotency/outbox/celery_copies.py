"""Task messages copied from the first of their kind in a batch, instead of each built by Celery.

:class:`~django_idempotency.outbox.transports.CeleryTransport` builds a message with Celery's
own calls (the task's options, the router, ``create_task_message``, ``send_task_message``), and
for a batch of 500 messages to one task, 499 of those builds give the same message but for the
task id, the arguments and the headers. Here the first is built by Celery and its
``Producer.publish`` arguments recorded (:class:`Recorder`); each later one of its kind is
published with those arguments, its own body, task id (``id``, ``root_id``,
``correlation_id``), ``argsrepr``/``kwargsrepr`` and headers (:meth:`Copies.publish`). On
RabbitMQ that took about a fifth of the relay's time per message off (``python -m bench.outbox``,
issue 28); on Redis, :mod:`~django_idempotency.outbox.celery_redis` copies the written message
itself the same way.

Only where nothing else in a message can differ (:func:`copiable`): a router made only of
``task_routes`` maps (which route by name), no receivers on Celery's publish signals (which may
change each message), no task-sent events, and per message no ``expires`` (a moment computed at
each publish; such a message is always built by Celery). ``tests/test_celery_redis.py`` and
``tests/test_celery_copies.py`` compare copies with what Celery builds, on generated messages.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["Copies", "Recorder", "copiable", "copied_body", "kind", "observed"]


def kind(
    destination: str, options: Mapping[str, Any], headers: Mapping[str, Any]
) -> tuple[Any, ...]:
    """What two messages must share to be copies of one: the task, the message's own
    options, and its header names in their order."""
    if not options:
        given: Any = ""
    elif all(type(value) in _PLAIN for value in options.values()):
        given = tuple(sorted(options.items()))  # a queue name, a priority: no JSON to write
    else:
        given = json.dumps(options, sort_keys=True, default=repr)
    return destination, given, tuple(headers)


#: The option values a kind compares as they are (exact types: ``True`` and ``1.0`` are not
#: ``1`` here, as they are not in the JSON a message carries).
_PLAIN = (str, int, type(None))


def observed() -> bool:
    """Whether a receiver listens on one of Celery's publish signals (it sees each build)."""
    from celery import signals

    return any(
        signal.receivers
        for signal in (signals.before_task_publish, signals.after_task_publish, signals.task_sent)
    )


def copiable(app: Any, sent_event: bool) -> bool:
    """Whether a batch's messages may be copies of the first of their kind (see the module)."""
    from celery.app.routes import MapRoute

    if sent_event or observed():
        return False
    return all(isinstance(route, MapRoute) for route in app.amqp.router.routes)


def copied_headers(
    source: Mapping[str, Any],
    task_id: str,
    argsrepr: Callable[[], str],
    kwargsrepr: Callable[[], str],
    headers: Mapping[str, Any],
) -> dict[str, Any]:
    """A copy's headers: the source's, with what ``as_task_v2`` derives from the task id and
    the arguments replaced, then the message's own, as ``send_task_message`` adds them."""
    copied = dict(source)
    copied.update(id=task_id, root_id=task_id, argsrepr=argsrepr(), kwargsrepr=kwargsrepr())
    copied.update(headers)
    return copied


def copied_body(args: list[Any], kwargs: dict[str, Any], embed: Any) -> tuple[Any, Any, Any]:
    """A copy's body, as ``as_task_v2`` writes it: empty arguments as ``()`` and ``{}`` (a
    serializer may tell them from ``[]``), then the template's embed."""
    return args or (), kwargs or {}, embed


class Recorder:
    """Stands in for a kombu ``Producer`` in ``send_task_message``: publishes through it, and
    keeps what the publish was given."""

    def __init__(self, producer: Any) -> None:
        self.producer = producer
        self.connection = producer.connection
        self.last: tuple[Any, dict[str, Any]] | None = None

    def publish(self, body: Any, **kwargs: Any) -> Any:
        self.last = (body, kwargs)
        return self.producer.publish(body, **kwargs)


class _Template:
    __slots__ = ("embed", "kwargs")

    def __init__(self, embed: Any, kwargs: dict[str, Any]) -> None:
        self.embed = embed
        self.kwargs = kwargs


class Copies:
    """The templates of one transport call, by :func:`kind`; ``on`` False keeps none."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self.templates: dict[tuple[Any, ...], _Template] = {}

    def remember(self, kind: tuple[Any, ...], recorder: Recorder) -> None:
        """Keep what ``recorder`` last published as the template of ``kind`` (not a message
        with an expiry, nor a body that is not protocol 2's ``(args, kwargs, embed)``)."""
        last, recorder.last = recorder.last, None
        if not self.on or last is None:
            return
        body, kwargs = last
        if kwargs.get("expiration") is not None or not (
            isinstance(body, tuple) and len(body) == 3
        ):
            return
        self.templates[kind] = _Template(body[2], kwargs)

    def publish(
        self,
        kind: tuple[Any, ...],
        producer: Any,
        task_id: str,
        args: list[Any],
        kwargs: dict[str, Any],
        argsrepr: Callable[[], str],
        kwargsrepr: Callable[[], str],
        headers: Mapping[str, Any],
    ) -> bool:
        """Publish a copy of ``kind``'s template through ``producer``; False if there is none."""
        template = self.templates.get(kind)
        if template is None:
            return False
        options = dict(template.kwargs)
        options["headers"] = copied_headers(
            options["headers"], task_id, argsrepr, kwargsrepr, headers
        )
        options["correlation_id"] = task_id
        options["declare"] = []  # the template's publish declared them
        producer.publish(copied_body(args, kwargs, template.embed), **options)
        return True
