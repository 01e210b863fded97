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
import math
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connections, transaction
from django.db.models import JSONField, Value
from django.db.transaction import TransactionManagementError
from django.utils import timezone

from django_idempotency import telemetry
from django_idempotency.conf import SETTING_NAME, conf
from django_idempotency.events.core import (
    EventId,
    new_event_id,
    normalize_event_id,
)
from django_idempotency.exceptions import log_text
from django_idempotency.models import OUTBOX_UNSCHEDULED, OutboxEntry, outbox_unscheduled
from django_idempotency.outbox import schedule
from django_idempotency.outbox.capture import is_change_capture
from django_idempotency.outbox.celery_calls import prepare
from django_idempotency.outbox.store import NOTIFY_CHANNEL
from django_idempotency.outbox.transports import backend_class, get_transport
from django_idempotency.protection.core import (
    DATA,
    SEALED,
    is_sealed_value,
    seal_outbox_payload,
)

if TYPE_CHECKING:
    from celery import Signature, Task

__all__ = ["NOTIFY_CHANNEL", "publish", "send"]


MAX_NAME_LENGTH = 255


def publish(
    task: Task[Any, Any] | Signature[Any] | str,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    *,
    key: str | None = None,
    headers: Mapping[str, Any] | None = None,
    transport: str = "default",
    using: str | None = None,
    **options: Any,
) -> str:
    """Publish a Celery task call through the outbox, as ``task.apply_async(args, kwargs,
    **options)``: the task receives what ``apply_async`` would give it.

    The event id is the ``task_id`` option, else the ``event_id`` keyword argument, or the
    ``"event_id"`` key of a first argument that is a mapping, when the call carries one;
    otherwise a new UUIDv7. The message carries it as its task id and ``event_id`` header,
    where :class:`~django_idempotency.events.celery.IdempotentConsumer` finds it.

    :param task: the task, a signature of it (``task.s(1, 2).set(queue="x")``, sent as its
        ``apply_async()`` would send it), a chain (``a.s(1) | b.s()``: its first task is the
        message, the rest travel in it), or its registered name.
    :param args: positional arguments, a list or tuple; a string is refused.
    :param kwargs: keyword arguments.

    Values are what Celery's JSON serializer (kombu's) writes: JSON, ``datetime``, ``date``,
    ``time``, ``UUID``, ``Decimal``, ``bytes``, and the types registered with
    ``kombu.utils.json.register_type``; they are stored as kombu writes them, and the worker
    decodes them as after ``apply_async``. With another serializer (``pickle``, ``yaml``,
    ``msgpack``: the call's, the task's or the app's) a call is refused when the JSON in
    between would change what the task gets (:mod:`~django_idempotency.outbox.celery_calls`).
    A task given as an object has its arguments checked against its signature, and its options
    and shadow name applied, as ``apply_async`` does; a task given by name cannot be checked.
    :param key: the ordering key: messages with one key are sent in the order written.
    :param headers: message headers (``apply_async``'s ``headers``): strings, or plain JSON.
    :param transport: a name in ``IDEMPOTENCY["OUTBOX_TRANSPORTS"]``.
    :param using: the database alias; default the ``DATABASE`` setting.
    :param options: ``apply_async``'s: ``countdown`` (seconds after the commit), ``eta``,
        ``expires``, ``queue``, ``routing_key``, ``exchange``, ``priority``, ``time_limit``,
        ``soft_time_limit``, ``shadow``, ``serializer``, ``ignore_result``, ``task_id``, ...
        (:data:`~django_idempotency.outbox.celery_calls.OPTIONS`). ``retry``, ``retry_policy``
        and ``add_to_parent`` change nothing (the relay retries). ``link`` and ``link_error``
        (a signature or a list) go in the message, as Celery's protocol 2 carries them
        (:mod:`~django_idempotency.outbox.celery_canvas`; an idempotent consumer sends them on
        exactly once). The others, groups and chords among them, are refused with the reason
        (:data:`~django_idempotency.outbox.celery_calls.REFUSED`).
    :returns: the event id.
    :raises TransactionManagementError: outside ``transaction.atomic`` on that database.
    :raises TypeError: arguments that do not fit the task, a string ``args``, a value the
        serializer cannot write or that would reach the task changed, an unknown option.
    :raises ValueError: a refused option or canvas, a countdown or eta out of range;
        ``transport`` is a change-capture transport, which no relay sends through (a
        change-capture connector would route the task call to a topic named after the task).
    """
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
    call = prepare(task, args, kwargs, headers, options)
    return send(
        call.name,
        call.payload,
        key=key,
        headers=call.headers,
        transport=transport,
        event_id=call.event_id,
        using=using,
        countdown=call.countdown,
        eta=call.eta,
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
    countdown: float | None = None,
    eta: datetime | None = None,
) -> str:
    """Write one message for ``destination`` (a task name or a topic) in the current transaction.

    :param payload: any JSON-serialisable value; the transport decides its wire form.
    :param key: the ordering key (1 to 255 characters), or None for no order.
    :param event_id: the event id; default a new UUIDv7.
    :param countdown: seconds after the **commit** before the message is due (the producer's
        ``on_commit`` hook starts it; if the producer dies first, the relay that finds the
        message does, later rather than earlier).
    :param eta: an aware moment before which the message is not due. A transport that delivers
        late messages itself (Celery: the task's eta) gets it at once with its due time; the
        relay holds the others' (Kafka, Dramatiq) until then, holding back the later messages
        of their key, never the other keys.
    :returns: the event id.
    :raises TransactionManagementError: outside ``transaction.atomic`` on that database.
    :raises ValueError: an empty or too long name, key or event id, or a message (payload and
        headers as UTF-8 JSON) over ``OUTBOX_MAX_PAYLOAD_BYTES``; both ``countdown`` and
        ``eta``, or one out of range; nothing is written.
    :raises TypeError: a payload or headers that are not JSON the database stores (NaN or
        infinity, a lone surrogate, a NUL on PostgreSQL), headers that are not strings, a naive
        ``eta``.
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
    payload, payload_size, payload_text = _json("payload", payload, vendor)
    # The request's trace context, so that the consumer's span joins its trace, however late.
    headers_value, headers_size, _ = _json("headers", telemetry.inject(_headers(headers)), vendor)
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
    if is_sealed_value(payload):
        raise ValueError(
            f"A payload of exactly the keys {SEALED!r} and {DATA!r} is reserved for an encrypted "
            "payload (OUTBOX_ENCRYPT): wrap it in another object."
        )
    if conf.OUTBOX_ENCRYPT and not captured:  # a change-capture reader reads the row as is
        payload = seal_outbox_payload(payload, event)
    created_at = timezone.now()
    due_at, available_at = _due(created_at, countdown, eta, captured, transport, cls)
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
    if due_at is not None:
        values.update(due_at=due_at, available_at=available_at)
    fields = {field.name: field for field in OutboxEntry._meta.concrete_fields}
    quote = connection.ops.quote_name
    columns = ", ".join(quote(str(fields[name].column)) for name in values)
    params: list[Any] = [
        fields[name].get_db_prep_save(value, connection) for name, value in values.items()
    ]
    placeholders = ["%s"] * len(params)
    if payload_text is not None:  # PostgreSQL, with floats jsonb would turn into integers
        params[0 + list(values).index("payload")] = payload_text
        placeholders[list(values).index("payload")] = "CAST(%s AS jsonb)"
    table = quote(OutboxEntry._meta.db_table)
    scheduled = countdown is not None and not captured
    returning = " RETURNING id" if scheduled and vendor == "postgresql" else ""
    if connection.vendor == "postgresql" and conf.OUTBOX_NOTIFY and not captured:
        # One statement: the row, and a notification delivered when (and if) it commits.
        # PostgreSQL folds identical notifications of one transaction into one.
        sql = (
            f"INSERT INTO {table} ({columns}) SELECT {', '.join(placeholders)} "
            f"FROM pg_notify(%s, ''){returning}"
        )
        params.append(NOTIFY_CHANNEL)
    else:
        sql = f"INSERT INTO {table} ({columns}) VALUES ({', '.join(placeholders)}){returning}"
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        if scheduled:
            pk = cursor.fetchone()[0] if returning else cursor.lastrowid
    if scheduled:
        assert countdown is not None
        _start_countdown_on_commit(alias, int(pk), float(countdown), transport, cls)
    return event


def _due(
    created_at: datetime,
    countdown: float | None,
    eta: datetime | None,
    captured: bool,
    transport: str,
    cls: Any,
) -> tuple[datetime | None, datetime | None]:
    """``(due_at, available_at)`` of a new message: none for one due at once; for an eta, the
    moment (and the relay holds it until then, unless its transport delivers it late itself);
    for a countdown, a provisional due time that keeps the countdown, and not claimable until
    the commit starts it (:mod:`.schedule`)."""
    if countdown is None and eta is None:
        return None, None
    if countdown is not None and eta is not None:
        raise ValueError("Give a countdown or an eta, not both.")
    if captured:
        raise ValueError(
            f"Transport {transport!r} is read from the database's log: a change-capture "
            "connector sends each message as it commits, and cannot hold one until it is due."
        )
    if eta is not None:
        if not isinstance(eta, datetime) or timezone.is_naive(eta):
            raise TypeError(f"eta must be an aware datetime, not {eta!r:.80}.")
        if eta.astimezone(UTC).year >= OUTBOX_UNSCHEDULED.year:
            raise ValueError(f"eta {eta.isoformat()} is out of range.")
        if not settings.USE_TZ:
            eta = timezone.make_naive(eta)  # as Django stores datetimes then
        return eta, None if _delivers_late(transport, cls) else eta
    if isinstance(countdown, bool) or not isinstance(countdown, (int, float)):
        raise TypeError(f"countdown must be a number of seconds, not {countdown!r:.80}.")
    try:
        due = created_at + timedelta(seconds=countdown) if math.isfinite(countdown) else None
    except OverflowError:
        due = None
    if due is None or due.year >= OUTBOX_UNSCHEDULED.year:
        raise ValueError(f"countdown {countdown!r} is out of range.")
    return due, outbox_unscheduled()


def _delivers_late(name: str, cls: Any) -> bool:
    """Whether transport ``name`` delivers a message after its due time itself (Celery's eta,
    ``delayed_delivery``), so that the relay sends it at once; otherwise the relay holds it."""
    if cls is None or not getattr(cls, "delayed_delivery", False):
        return False
    return bool(get_transport(name).delayed_delivery)  # type: ignore[attr-defined]


def _start_countdown_on_commit(
    alias: str, pk: int, countdown: float, transport: str, cls: Any
) -> None:
    """Once the transaction commits, count the message's countdown from then. A failure here
    is logged, not raised (the transaction has committed): a relay then starts the countdown
    when it finds the message (:meth:`~django_idempotency.outbox.relay.Relay.schedule`)."""
    hold = not _delivers_late(transport, cls)

    def start() -> None:
        schedule.set_due(alias, pk, timezone.now() + timedelta(seconds=countdown), hold)

    transaction.on_commit(start, using=alias, robust=True)


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


def _depth(value: Any) -> tuple[int, str]:
    """How deep ``value`` nests lists, tuples and dicts (0 for a scalar), without recursion, and
    what floats it holds that ``jsonb`` would change: ``"-0"`` for a negative zero, ``"e"`` for
    one JSON writes with an exponent (``1e+16``, ``1e-05``), ``""`` for neither."""
    deepest, pending, floats = 0, [(value, 1)], ""
    while pending:
        item, level = pending.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            if type(item) is float:
                if item == 0.0 and math.copysign(1.0, item) < 0:
                    floats = "-0"
                elif item and not 1e-4 <= abs(item) < 1e16 and not floats:
                    floats = "e"
            continue
        deepest = max(deepest, level)
        if level <= MAX_JSON_DEPTH:  # deeper is refused anyway: stop counting there
            pending.extend((child, level + 1) for child in children)
    return deepest, floats


def _json(what: str, value: Any, vendor: str) -> tuple[Any, int, str | None]:
    """``value``, its size as UTF-8 JSON, and on PostgreSQL the JSON text to store instead of
    letting the driver write it (None: let it), once it is JSON that the database stores:
    strict JSON (``json.dumps`` writes NaN and infinity, which no JSON column accepts), and
    outside SQLite no lone surrogate (PostgreSQL and MySQL refuse one in JSON), and on
    PostgreSQL no NUL character (``jsonb`` refuses ``\\u0000``). Left to the INSERT, each of
    these raised a database error instead, which on PostgreSQL aborts the caller's transaction.

    ``jsonb`` keeps a number as ``numeric``, and gives back ``1e+16`` as the integer
    ``10000000000000000``: a float the task would receive as an int. Such floats are written
    in positional notation with a fraction (``10000000000000000.0``), which ``jsonb`` gives back
    as the same float. ``numeric`` has no negative zero: ``-0.0`` is refused there.
    """
    depth, floats = _depth(value)
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
            return value, len(text.encode("utf-8", "surrogatepass")), None
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
    if vendor == "postgresql" and floats == "-0":
        raise TypeError(
            f"The {what} holds -0.0, which PostgreSQL's jsonb keeps as 0.0 (its numbers have no "
            "negative zero): pass 0.0."
        )
    if vendor == "postgresql" and floats:
        return value, size, _EXPONENT.sub(_positional, text)
    return value, size, None


#: A JSON string (left as it is), or a number written with an exponent.
_EXPONENT = re.compile(r'"(?:[^"\\]|\\.)*"|(-?\d+(?:\.\d+)?[eE][-+]?\d+)')


def _positional(match: re.Match[str]) -> str:
    number = match.group(1)
    if number is None:
        return match.group(0)
    text = format(Decimal(number), "f")
    return text if "." in text else text + ".0"


def _headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    result = dict(headers or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in result.items()):
        raise TypeError(f"Headers must map strings to strings, not {result!r}.")
    return result
