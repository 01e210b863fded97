"""The transactional outbox: an event leaves if and only if its transaction commits.

.. code-block:: python

    from django_idempotency.outbox import core as outbox

    with transaction.atomic():
        order = Order.objects.create(...)
        outbox.publish(apply_order_confirmed, kwargs={"order_id": order.pk}, key=str(order.pk))
        # or, to a topic through another transport:
        outbox.send("orders.confirmed", {"order_id": order.pk}, key=str(order.pk),
                    transport="kafka")

:func:`publish` (a Celery task) and :func:`send` (any destination) write one
:class:`~django_idempotency.models.OutboxEntry` row in the caller's transaction, on the database
of the business data, and return the message's event id. They refuse to run outside
``transaction.atomic``: there, the row would commit on its own and the point of the outbox (the
message and the state change commit together) would be lost. If the transaction rolls back, the
message is gone with it; if it commits, the relay (:mod:`django_idempotency.outbox.relay`) sends
it, at
least once, and the consumer's processed events turn that into exactly one effect.

On PostgreSQL the insert also queues a ``NOTIFY`` on the relay's channel, in the same statement
and the same transaction, so a waiting relay wakes when the transaction commits (and only then).

A message for a :class:`~django_idempotency.outbox.capture.ChangeCaptureTransport` is written for
a change-capture reader such as Debezium instead: in the ``external`` state, which no relay
claims, expiring ``OUTBOX_TTL`` after it was written, without a ``NOTIFY``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.db.models import JSONField, Value
from django.db.transaction import TransactionManagementError
from django.utils import timezone

from django_idempotency import telemetry
from django_idempotency.conf import SETTING_NAME, conf
from django_idempotency.events.core import (
    EventId,
    find_event_id,
    new_event_id,
    normalize_event_id,
)
from django_idempotency.exceptions import log_text
from django_idempotency.models import OutboxEntry
from django_idempotency.outbox.capture import is_change_capture
from django_idempotency.outbox.store import NOTIFY_CHANNEL
from django_idempotency.outbox.transports import backend_class, celery_envelope, get_transport

if TYPE_CHECKING:
    from celery import Task

__all__ = ["NOTIFY_CHANNEL", "publish", "send"]


MAX_NAME_LENGTH = 255


def publish(
    task: Task[Any, Any] | str,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    *,
    key: str | None = None,
    headers: Mapping[str, str] | None = None,
    transport: str = "default",
    using: str | None = None,
    **options: Any,
) -> str:
    """Publish a Celery task call through the outbox, as ``task.apply_async(args, kwargs)``.

    The event id is the ``event_id`` keyword argument, or the ``"event_id"`` key of a first
    argument that is a mapping, when the call carries one; otherwise a new UUIDv7. The message
    carries it as its task id and ``event_id`` header, where
    :class:`~django_idempotency.events.celery.IdempotentConsumer` finds it.

    :param task: the task, or its registered name.
    :param args: positional arguments (JSON-serialisable), a list or tuple; a string is refused.
    :param kwargs: keyword arguments (JSON-serialisable).

    A task given as an object has its arguments checked against its signature, as
    ``apply_async`` does (not when the task has ``typing=False``); a task given by name cannot
    be checked. Values are stored as JSON, and what ``json.dumps`` cannot write is refused with
    ``TypeError``: a ``datetime``, ``UUID`` or ``Decimal``, which Celery's own JSON serializer
    would encode, must be passed as a string here (``isoformat()``, ``str()``).
    :param key: the ordering key: messages with one key are sent in the order written.
    :param headers: extra message headers (strings).
    :param transport: a name in ``IDEMPOTENCY["OUTBOX_TRANSPORTS"]``.
    :param using: the database alias; default the ``DATABASE`` setting.
    :param options: ``queue``, ``routing_key``, ``exchange``, ``priority`` or ``expires``.
    :returns: the event id.
    :raises TransactionManagementError: outside ``transaction.atomic`` on that database.
    :raises TypeError: arguments that do not fit the task, a string ``args``, or a value that
        is not JSON.
    :raises ValueError: ``transport`` is a change-capture transport, which no relay sends
        through: a change-capture connector would route the task call to a topic named after
        the task.
    """
    name = task if isinstance(task, str) else str(task.name)
    configured = conf.OUTBOX_TRANSPORTS
    if (
        isinstance(transport, str)
        and transport in configured
        and is_change_capture(configured[transport]["BACKEND"])
    ):
        raise ValueError(
            f"outbox.publish() writes a Celery task call for the relay to send, but transport "
            f"{transport!r} is a ChangeCaptureTransport: no relay sends its messages, and the "
            "change-capture connector would route the call to a topic named after the task. "
            "Publish through a CeleryTransport, or write topic messages with outbox.send()."
        )
    if isinstance(args, (str, bytes)) or not isinstance(args, (Sequence, type(None))):
        # list("ab") is ["a", "b"]: a string was stored as one argument per character.
        raise TypeError(f"args must be a list or tuple of arguments, not {args!r:.100}.")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs must be a mapping, not {kwargs!r:.100}.")
    if not isinstance(task, str):
        _check_arguments(task, args, kwargs)
    envelope = celery_envelope(args, kwargs, options)
    found = find_event_id(tuple(envelope["args"]), envelope["kwargs"])
    return send(
        name,
        envelope,
        key=key,
        headers=headers,
        transport=transport,
        event_id=found,
        using=using,
    )


def send(
    destination: str,
    payload: Any,
    *,
    key: str | None = None,
    headers: Mapping[str, str] | None = None,
    transport: str = "default",
    event_id: EventId | None = None,
    using: str | None = None,
) -> str:
    """Write one message for ``destination`` (a task name or a topic) in the current transaction.

    :param payload: any JSON-serialisable value; the transport decides its wire form.
    :param key: the ordering key (1 to 255 characters), or None for no order.
    :param event_id: the event id; default a new UUIDv7.
    :returns: the event id.
    :raises TransactionManagementError: outside ``transaction.atomic`` on that database.
    :raises ValueError: an empty or too long name, key or event id, or a message (payload and
        headers as UTF-8 JSON) over ``OUTBOX_MAX_PAYLOAD_BYTES``; nothing is written.
    :raises TypeError: a payload or headers that are not JSON the database stores (NaN or
        infinity, a lone surrogate, a NUL on PostgreSQL), headers that are not strings.
    :raises ImproperlyConfigured: ``transport`` is not configured.

    The transport may refuse the message here with ``TypeError`` or ``ValueError``, when it
    defines ``validate_message`` (see :func:`_validate`).
    """
    alias = using if using is not None else conf.DATABASE
    connection = connections[alias]
    if not connection.in_atomic_block:
        raise TransactionManagementError(
            f"outbox.send() and outbox.publish() must run inside transaction.atomic("
            f"using={alias!r}), in the transaction that changes the state the message announces. "
            "Outside one, the message would commit on its own."
        )
    event = str(new_event_id()) if event_id is None else normalize_event_id(event_id)
    destination = _name("destination", destination)
    transport = _transport(transport)
    vendor = connection.vendor
    payload, payload_size = _json("payload", payload, vendor)
    # The request's trace context, so that the consumer's span joins its trace, however late.
    headers_value, headers_size = _json("headers", telemetry.inject(_headers(headers)), vendor)
    limit = conf.OUTBOX_MAX_PAYLOAD_BYTES
    if payload_size + headers_size > limit:
        raise ValueError(
            f"The outbox message is {payload_size + headers_size} bytes as JSON (payload and "
            f"headers); the most is {limit} ({SETTING_NAME}['OUTBOX_MAX_PAYLOAD_BYTES']). "
            "Store a large document elsewhere and send its reference."
        )
    cls = _transport_class(transport)
    _validate(transport, cls, destination, payload, headers_value)
    # A change-capture reader (Debezium) has the row from the log once it commits: no relay
    # claims it, and it expires as a sent message does.
    captured = getattr(cls, "change_capture", False) is True
    created_at = timezone.now()
    values = {
        "event_id": event,
        "destination": destination,
        "transport": transport,
        # None is JSON null: left bare, it would be SQL NULL, which the column refuses.
        "payload": Value(None, JSONField()) if payload is None else payload,
        "headers": headers_value,
        "ordering_key": None if key is None else _name("ordering key", key),
        "state": OutboxEntry.State.EXTERNAL if captured else OutboxEntry.State.PENDING,
        "attempts": 0,
        "last_error": "",
        "created_at": created_at,
        "expires_at": created_at + conf.OUTBOX_TTL if captured else None,
    }
    fields = {field.name: field for field in OutboxEntry._meta.concrete_fields}
    quote = connection.ops.quote_name
    columns = ", ".join(quote(str(fields[name].column)) for name in values)
    params: list[Any] = [
        fields[name].get_db_prep_save(value, connection) for name, value in values.items()
    ]
    placeholders = ", ".join(["%s"] * len(params))
    table = quote(OutboxEntry._meta.db_table)
    if connection.vendor == "postgresql" and conf.OUTBOX_NOTIFY and not captured:
        # One statement: the row, and a notification delivered when (and if) it commits.
        # PostgreSQL folds identical notifications of one transaction into one.
        sql = f"INSERT INTO {table} ({columns}) SELECT {placeholders} FROM pg_notify(%s, '')"
        params.append(NOTIFY_CHANNEL)
    else:
        sql = f"INSERT INTO {table} ({columns}) VALUES ({placeholders})"
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
    return event


def _transport_class(name: str) -> Any:
    """The class of transport ``name``, or None where its ``BACKEND`` does not import (check
    E030 reports it, and the relay fails the message with the reason)."""
    try:
        return backend_class(conf.OUTBOX_TRANSPORTS[name]["BACKEND"])
    except ImportError:
        return None


def _validate(
    name: str, cls: Any, destination: str, payload: Any, headers: dict[str, str]
) -> None:
    """Let the message's transport refuse a message it can never send, now rather than after
    an hour of retries that hold back its key (``send("shop.effect", {"order_id": 1})`` to a
    Celery destination, whose payload is no task call).

    A transport class may define ``validate_message(destination, payload, headers)``, raising
    ``TypeError`` or ``ValueError``. Only then is the transport built in this process (once, as
    the relay builds it); a transport without the method is not built here.
    """
    if not callable(getattr(cls, "validate_message", None)):
        return
    get_transport(name).validate_message(destination, payload, headers)  # type: ignore[attr-defined]


def _check_arguments(
    task: Task[Any, Any], args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None
) -> None:
    """Refuse a call the task can never run, as ``apply_async`` does: Celery binds the
    arguments to the task's signature (``Task.__header__``, built by
    ``celery.utils.functional.head_from_fun``, which leaves out ``self`` of a bound task)
    unless the task says ``typing=False``. Stored unchecked, ``publish(task, args=[1, 2, 3])``
    for a two-argument task was sent, and every worker then failed it with ``TypeError``."""
    if not getattr(task, "typing", True):
        return
    check = getattr(task, "__header__", None)
    if not callable(check):
        return
    try:
        check(*(args or ()), **(kwargs or {}))
    except TypeError as exc:
        raise TypeError(
            f"publish({getattr(task, 'name', task)!r}): the arguments do not fit the task's "
            f"signature: {exc}."
        ) from exc


def _name(what: str, value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"The {what} must be a non-empty string, not {value!r}.")
    if len(value) > MAX_NAME_LENGTH:
        raise ValueError(f"The {what} is {len(value)} characters long; the most is 255.")
    # What no text column stores: a NUL (PostgreSQL) and a lone surrogate (no UTF-8 for it).
    # Left to the INSERT, each failed it and, on PostgreSQL, the caller's transaction.
    if "\x00" in value or (not value.isascii() and _has_surrogate(value)):
        raise ValueError(
            f"The {what} holds a NUL or a lone surrogate, which no database stores: "
            f"{log_text(value, 80)}."
        )
    return value


def _has_surrogate(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _transport(name: object) -> str:
    configured = conf.OUTBOX_TRANSPORTS
    if not isinstance(name, str) or name not in configured:
        raise ImproperlyConfigured(
            f"No outbox transport named {name!r}. Configure it in "
            f"IDEMPOTENCY['OUTBOX_TRANSPORTS'] (now: {', '.join(map(repr, configured))})."
        )
    return name


#: How deep a payload or its headers may nest lists and dicts: MariaDB's JSON column refuses
#: deeper values (its ``JSON_VALID`` check refuses 32 levels), and far deeper ones kill consumers
#: (a Celery prefork worker dies pickling one of about 500 levels for its pool), so every
#: backend refuses them at the producer.
MAX_JSON_DEPTH = 31


def _depth(value: Any) -> int:
    """How deep ``value`` nests lists, tuples and dicts (0 for a scalar), without recursion."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, level = pending.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        if level <= MAX_JSON_DEPTH:  # deeper is refused anyway: stop counting there
            pending.extend((child, level + 1) for child in children)
    return deepest


def _json(what: str, value: Any, vendor: str) -> tuple[Any, int]:
    """``value`` and its size as UTF-8 JSON, once it is JSON that the database stores: strict
    JSON (``json.dumps`` writes NaN and infinity, which no JSON column accepts), and outside
    SQLite no lone surrogate (PostgreSQL and MySQL refuse one in JSON), and on PostgreSQL no
    NUL character (``jsonb`` refuses ``\\u0000``). Left to the INSERT, each of these raised a
    database error instead, which on PostgreSQL aborts the caller's transaction.
    """
    depth = _depth(value)
    if depth > MAX_JSON_DEPTH:
        raise ValueError(
            f"The {what} is nested {depth} levels deep; the most is {MAX_JSON_DEPTH} (MariaDB's "
            "JSON limit; far deeper values also kill the consumers that parse or copy them)."
        )
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"The {what} must be JSON-serialisable: {exc}.") from exc
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        if vendor == "sqlite":
            return value, len(text.encode("utf-8", "surrogatepass"))
        raise TypeError(
            f"The {what} holds a lone surrogate ({exc.object[exc.start : exc.end]!r}), which "
            f"{vendor} cannot store in JSON."
        ) from exc
    # json.dumps writes a NUL as the escape \u0000 and a backslash as two; dropping the pairs
    # first keeps a backslash followed by "u0000" from passing for a NUL.
    if vendor == "postgresql" and "\\u0000" in text.replace("\\\\", ""):
        raise TypeError(
            f"The {what} holds a NUL character (\\u0000), which PostgreSQL cannot store in JSON."
        )
    return value, size


def _headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    result = dict(headers or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in result.items()):
        raise TypeError(f"Headers must map strings to strings, not {result!r}.")
    return result
