"""Idempotent message consumers: an event's effect applies once per consumer.

Brokers deliver at least once. A consumer makes that *effectively once* by writing a
:class:`~django_idempotency.models.ProcessedEvent` row for ``(consumer, event_id)`` **in the same
transaction** as the event's business effect. The unique constraint on that pair does the rest:
the first transaction to insert the row applies the effect; every later delivery finds the row and
skips the body; a delivery whose transaction rolls back leaves no row behind, so the next delivery
runs again.

This module is the one core that decides: reserve, count, park. It offers:

* :func:`try_reserve`, the primitive: one insert that does nothing on conflict, inside the
  caller's ``transaction.atomic``;
* :func:`count_delivery`, the delivery counter committed apart (see below);
* :func:`process_event`, which counts the delivery, opens the transaction, reserves the event and
  runs a body only the first time. :func:`~django_idempotency.consumers.idempotent_consumer`
  (for plain loops) and :class:`django_idempotency.celery.IdempotentConsumer` are thin adapters
  over it;
* :func:`park_message`, which parks a message that carries no usable event id where the admin
  shows it.

What an event id is and where a message carries it lives in :mod:`django_idempotency.event_ids`
(:func:`new_event_id` too); both are re-exported here.

Poison messages
---------------
A message that kills its worker (a segfault, the OOM killer, ``SIGKILL``) never reaches the end of
its transaction, so nothing in the business transaction can remember that it was tried. Each
delivery is therefore counted in an :class:`~django_idempotency.models.EventDelivery` row that is
committed **apart** from the business transaction: :func:`count_delivery` runs in its own
``transaction.atomic`` *before* the business transaction opens, and commits at once. (Two
transactions cannot be nested on one connection and still commit separately, so the count has to
come first.) When an event has been delivered more than ``MAX_DELIVERIES`` times without being
processed, it is parked: ``parked_at`` is set, :class:`~django_idempotency.exceptions.EventParked`
is raised, and the adapter rejects the message without requeueing it.

The count is one statement that also reads the processed event: it counts the delivery only
``WHERE NOT EXISTS`` a :class:`~django_idempotency.models.ProcessedEvent` row, so a duplicate of a
processed event writes nothing and is answered there (duplicates are not counted). A first
delivery still commits twice, the count and then the business transaction, and each commit waits
on its WAL flush. On PostgreSQL with psycopg 3 the count needs no round trip of its own: it
commits in the same query that opens the business transaction with the reservation
(:func:`_count_and_reserve`); elsewhere it is a statement of its own, and a duplicate opens no
transaction. ``IDEMPOTENCY["ASYNC_DELIVERY_COUNT"]`` (PostgreSQL, off by
default) lets the count's own statement commit without waiting on its flush: it stays visible at
once and survives the worker's death, and the business transaction's synchronous commit flushes
it along; only a crash of the database server in between can lose that one increment, which
delays parking by one delivery (docs/consumers.md, "What a delivery costs").

When the consumer is itself called inside an outer ``transaction.atomic`` on the same database
(eager Celery tasks inside a request or a test, a loop that batches messages in one transaction),
the count joins that outer transaction and is only as durable as it is. A worker calls its tasks
outside any transaction, so there the count always commits on its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Generic, NamedTuple, NoReturn, TypeVar

from django.db import (
    DatabaseError,
    IntegrityError,
    NotSupportedError,
    connections,
    transaction,
)
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Exists, Field, Model
from django.db.transaction import TransactionManagementError
from django.utils import timezone

from django_idempotency import signals
from django_idempotency.conf import conf
from django_idempotency.event_ids import (
    EVENT_ID_KEY,
    MAX_ID_LENGTH,
    EventId,
    checked_name,
    find_event_id,
    new_event_id,
    normalize_event_id,
)
from django_idempotency.exceptions import EventParked, MissingEventId, OnCommitFailed
from django_idempotency.models import EventDelivery, ProcessedEvent
from django_idempotency.partitioning import EventInsert, event_insert
from django_idempotency.pg_roundtrips import apart_may_travel, execute_apart_first, execute_first

__all__ = [
    "EVENT_ID_KEY",
    "MAX_ID_LENGTH",
    "EventId",
    "Processed",
    "count_delivery",
    "find_event_id",
    "new_event_id",
    "normalize_event_id",
    "park_message",
    "process_event",
    "try_reserve",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

ER_DUP_ENTRY = 1062
"""MySQL/MariaDB error number of a duplicate key, and the only one that means "already there"."""


def __getattr__(name: str) -> Any:
    # idempotent_consumer moved to consumers.py, an adapter over this core; it is imported on
    # first use because consumers.py imports this module.
    if name == "idempotent_consumer":
        from django_idempotency.consumers import idempotent_consumer

        return idempotent_consumer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- Validation ---------------------------------------------------------------------------------


def _checked_topic(topic: object) -> str:
    return "" if topic is None else checked_name("topic", topic, allow_empty=True)


def _ttl(ttl: timedelta | float | None) -> timedelta:
    if ttl is None:
        return conf.EVENT_TTL
    if isinstance(ttl, bool) or not isinstance(ttl, (timedelta, int, float)):
        raise TypeError(f"ttl must be a timedelta or a number of seconds, not {ttl!r}.")
    duration = ttl if isinstance(ttl, timedelta) else timedelta(seconds=ttl)
    if duration <= timedelta(0):
        raise ValueError(f"ttl must be longer than zero, not {duration}.")
    return duration


def _alias(using: str | None) -> str:
    return using if using is not None else conf.DATABASE


# --- The reservation ----------------------------------------------------------------------------


def try_reserve(
    event_id: EventId,
    consumer: str,
    *,
    topic: str | None = None,
    ttl: timedelta | float | None = None,
    using: str | None = None,
    occurred_at: datetime | None = None,
) -> bool:
    """Reserve ``event_id`` for ``consumer`` in the current transaction.

    Returns True if this call inserted the :class:`~django_idempotency.models.ProcessedEvent` row,
    so the caller should apply the event's effect, and False if the row was already there, so the
    event was processed before and the caller should skip it.

    It must run inside ``transaction.atomic(using=...)`` on the database that holds the business
    data, together with the effect: the row commits or rolls back with it. When two transactions
    race on one id, the second waits for the first to finish, then returns False if the first
    committed and True if it rolled back.

    Retryable errors (a lock wait timeout, a deadlock, a serialization failure) and every other
    database error propagate; they never read as "already processed".

    :param event_id: the event's id, a ``str`` or a :class:`uuid.UUID`; 1 to 255 characters.
    :param consumer: the consumer's stable name; each consumer processes an event once.
    :param topic: optional, informational (shown in the admin).
    :param ttl: how long the row is kept (a ``timedelta`` or seconds); default ``EVENT_TTL``. It
        must outlast the longest time a duplicate can still arrive.
    :param using: the database alias; default the ``DATABASE`` setting.
    :param occurred_at: only for the partitioned PostgreSQL layout
        (``IDEMPOTENCY["EVENT_PARTITIONS"]``): the event's own time, read from the message, for
        an id that is not a UUIDv7. Never the time of processing.
    :raises ValueError: the event id or consumer is empty or longer than 255 characters.
    :raises TransactionManagementError: called outside ``transaction.atomic`` on that database.
    """
    event = normalize_event_id(event_id)
    name = checked_name("consumer name", consumer)
    topic_value = _checked_topic(topic)
    duration = _ttl(ttl)
    alias = _alias(using)
    connection = connections[alias]
    if not connection.in_atomic_block:
        raise TransactionManagementError(
            f"try_reserve() must run inside transaction.atomic(using={alias!r}), in the same "
            "transaction as the event's effect. Outside one, the reservation would commit on "
            "its own and a crash before the effect would lose the event."
        )
    now = timezone.now()
    layout = _sql_layout(connection, event, occurred_at)
    if layout is None:
        return _call_reserve(connection, name, event, topic_value, now, now + duration) == RESERVED
    return _insert_new(
        connection,
        ProcessedEvent,
        {
            "consumer": name,
            "event_id": event,
            "topic": topic_value,
            "processed_at": now,
            "expires_at": now + duration,
        },
        unique=layout.conflict_target,
        raw=dict(zip(layout.columns, layout.values, strict=True)),
    )


def _sql_layout(
    connection: BaseDatabaseWrapper, event: str, occurred_at: datetime | None = None
) -> EventInsert | None:
    """How ``event``'s rows are keyed where the reservation and the count are SQL text; None
    where they are the functions of ``0006_event_functions`` (PostgreSQL, default layout).

    The opt-in partitioned layout (``EVENT_PARTITIONS``, PostgreSQL) adds its partition column
    to the row and to the conflict target; MariaDB and SQLite key by consumer and event id."""
    if connection.vendor != "postgresql":
        return DEFAULT_LAYOUT
    layout = event_insert(event, occurred_at)
    return layout if layout.columns else None


DEFAULT_LAYOUT = EventInsert((), (), ("consumer", "event_id"))

RESERVED, PROCESSED, PARKED = "reserved", "processed", "parked"
"""What a reservation found: this call reserved the event, it was processed before, or (for a
first delivery, see :func:`_reserve_first_delivery`) its delivery counter is parked."""

RESERVE_POSTGRESQL = "SELECT django_idempotency_reserve_v1(%s, %s, %s, %s, %s, %s)"
"""The reservation on PostgreSQL (default layout): a call of the function that migration
``0006_event_functions`` creates, whose plan PostgreSQL caches per server session."""


def _call_reserve(
    connection: BaseDatabaseWrapper,
    name: str,
    event: str,
    topic: str,
    now: datetime,
    expires: datetime,
    *,
    first_delivery: bool = False,
) -> str:
    """Reserve through ``django_idempotency_reserve_v1``; RESERVED, PROCESSED or PARKED.

    With ``first_delivery`` the function also reads the event's delivery counter: a parked event
    is refused (nothing inserted), and an error an earlier delivery recorded is cleared in the
    reserving transaction, so it stays only if this delivery rolls back."""
    # psycopg takes the datetimes as they are (Django's field preparation changes nothing on
    # PostgreSQL, and costs a tenth of the call).
    # Usually the first statement of the transaction: its BEGIN travels with it.
    params = [name, event, topic, now, expires, first_delivery]
    return str(execute_first(connection, RESERVE_POSTGRESQL, params)[0][0])


def _reserve_first_delivery(event: str, name: str, topic: str, ttl: Any, alias: str) -> str:
    """Reserve a delivery the broker vouches was never made before (``redelivered=False``).

    Its count was skipped, so the reservation reads what the count would have: a parked event
    is refused (PARKED: the caller rolls the reservation back), and an error an earlier failed
    delivery left on the counter is cleared with this delivery's success. The counter is read
    after the insert, which waits for any delivery that holds the event, so it sees the error
    a failed delivery recorded while holding it (:func:`_fail_first_delivery`). On PostgreSQL
    (default layout) all of it is the one function call of :func:`try_reserve`; elsewhere a
    plain read of the counter follows the insert.
    """
    connection = connections[alias]
    if _sql_layout(connection, event) is None:
        now = timezone.now()
        return _call_reserve(
            connection, name, event, topic, now, now + _ttl(ttl), first_delivery=True
        )
    if not try_reserve(event, name, topic=topic, ttl=ttl, using=alias):
        return PROCESSED
    counter = EventDelivery.objects.using(alias).filter(consumer=name, event_id=event)
    found = list(counter.values_list("parked_at", "last_error")[:1])
    if found and found[0][0] is not None:
        return PARKED
    if found and found[0][1]:
        counter.update(last_error="")
    return RESERVED


def _field(model: type[Model], name: str) -> Field[Any, Any]:
    for field in model._meta.concrete_fields:
        if field.name == name:
            return field
    raise LookupError(f"{model.__name__} has no column {name!r}.")


def _insert_sql(
    connection: BaseDatabaseWrapper,
    model: type[Model],
    values: Mapping[str, Any],
    raw: Mapping[str, Any] | None = None,
    *,
    select: bool = False,
) -> tuple[str, list[Any]]:
    """``INSERT INTO table (columns) VALUES (...)`` with quoted names and prepared parameters.

    ``values`` are keyed by model field name; ``raw`` by column name, for columns the model does
    not declare (the partition key), with values the driver takes as they are. With ``select``,
    ``SELECT ...`` replaces ``VALUES (...)``, so that the caller can add a ``WHERE``. The SQL
    text is built once per backend, model and column list, then reused (:data:`_SQL`).
    """
    raw = raw or {}
    cache_key = ("insert", connection.vendor, model, tuple(values), tuple(raw), select)
    cached = _SQL.get(cache_key)
    if cached is None:
        quote = connection.ops.quote_name
        fields = tuple(_field(model, name) for name in values)
        columns = ", ".join([*(quote(field.column) for field in fields), *map(quote, raw)])
        placeholders = ", ".join(["%s"] * (len(fields) + len(raw)))
        rows = f"SELECT {placeholders}" if select else f"VALUES ({placeholders})"
        text = f"INSERT INTO {quote(model._meta.db_table)} ({columns}) {rows}"
        cached = _SQL[cache_key] = (text, fields)
    sql, fields = cached
    params = [field.get_db_prep_save(values[field.name], connection) for field in fields]
    params.extend(raw.values())
    return sql, params


_SQL: dict[tuple[Any, ...], Any] = {}
"""Built SQL text (and the fields it binds), keyed by what it depends on; never by a value."""


def _columns(connection: BaseDatabaseWrapper, model: type[Model], names: tuple[str, ...]) -> str:
    """Quoted column names of fields (or of undeclared columns, named as they are)."""
    declared = {field.name: field.column for field in model._meta.concrete_fields}
    return ", ".join(connection.ops.quote_name(declared.get(name, name)) for name in names)


def _insert_new(
    connection: BaseDatabaseWrapper,
    model: type[Model],
    values: Mapping[str, Any],
    *,
    unique: tuple[str, ...],
    raw: Mapping[str, Any] | None = None,
) -> bool:
    """Insert one row unless ``unique`` already holds; True if this call inserted it.

    PostgreSQL and SQLite name the conflict target, so only that unique constraint is ignored: a
    NOT NULL or any other error still raises (``INSERT OR IGNORE`` would hide it). On MySQL and
    MariaDB, ``ON DUPLICATE KEY UPDATE`` cannot be counted reliably (Django sets the FOUND_ROWS
    client flag) and ``INSERT IGNORE`` hides errors, so a plain insert runs in a savepoint and only
    a duplicate-key error (1062) means "already there".
    """
    sql, params = _insert_sql(connection, model, values, raw)
    vendor = connection.vendor
    if vendor in ("postgresql", "sqlite"):
        cache_key = ("insert_new", vendor, sql, unique)
        if cache_key not in _SQL:
            target = _columns(connection, model, unique)
            _SQL[cache_key] = f"{sql} ON CONFLICT ({target}) DO NOTHING"
        sql = _SQL[cache_key]
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            return bool(cursor.rowcount == 1)
    if vendor == "mysql":
        try:
            with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
                cursor.execute(sql, params)
        except IntegrityError as exc:
            if _mysql_errno(exc) == ER_DUP_ENTRY:
                return False
            raise
        return True
    raise NotSupportedError(
        f"django-idempotency supports PostgreSQL, MySQL/MariaDB and SQLite, not {vendor!r}."
    )


def _mysql_errno(exc: BaseException) -> int | None:
    code = exc.args[0] if exc.args else None
    return code if isinstance(code, int) else None


# --- Counting deliveries (poison messages) ------------------------------------------------------


@dataclass(frozen=True)
class Delivery:
    """One counted delivery of an event to a consumer."""

    consumer: str
    event_id: str
    topic: str
    count: int
    """How many times the event has now been delivered to this consumer, this one included."""
    parked: bool
    """Whether the event was parked already, before this delivery."""


def count_delivery(
    event_id: EventId,
    consumer: str,
    *,
    topic: str | None = None,
    ttl: timedelta | float | None = None,
    using: str | None = None,
) -> Delivery:
    """Count one delivery of an event, in a transaction of its own that commits at once.

    Call it before the business transaction opens: the count must survive a process that dies
    inside the business transaction. Inside an outer ``atomic`` block it joins that block (see the
    module notes). One upsert (plus one ``SELECT`` on MySQL/MariaDB). On PostgreSQL and SQLite,
    outside a transaction, the upsert runs in autocommit: one statement that commits itself, as
    durable as a transaction of its own and without its ``BEGIN`` and ``COMMIT`` round trips.
    """
    event = normalize_event_id(event_id)
    name = checked_name("consumer name", consumer)
    topic_value = _checked_topic(topic)
    connection = connections[_alias(using)]
    counted = _count(connection, _delivery_values(name, event, topic_value, ttl))
    assert counted is not None  # without a guard, every delivery is counted
    return Delivery(name, event, topic_value, *counted)


def _count_unless_processed(
    event: str,
    name: str,
    topic: str,
    ttl: timedelta | float | None,
    alias: str,
    *,
    redelivered: bool = False,
) -> Delivery | None:
    """Count the delivery unless the event is processed already; None if it is.

    One statement on PostgreSQL and SQLite: the upsert's row is selected only ``WHERE NOT
    EXISTS`` a processed-event row, so a duplicate writes nothing, waits on no WAL flush and
    returns no row. On PostgreSQL (default layout) the statement is a call of
    ``django_idempotency_count_v1`` (migration ``0006_event_functions``), planned once per server
    session. On MySQL/MariaDB a plain ``SELECT`` comes first. With ``ASYNC_DELIVERY_COUNT``
    (PostgreSQL, outside a transaction) the count commits without waiting on its WAL flush; see
    :data:`ASYNC_COMMIT`.

    ``redelivered``: the broker says the event was delivered before, so a counter that is not
    there yet starts at 2: the earlier delivery was a first one, which skips its count.
    """
    connection = connections[alias]
    guard: dict[str, Any] = {"consumer": name, "event_id": event}
    deliveries = 2 if redelivered else 1
    asynchronous = conf.ASYNC_DELIVERY_COUNT
    layout = _sql_layout(connection, event)
    if layout is None:
        counted = _call_count(connection, name, event, topic, ttl, deliveries, asynchronous)
        return None if counted is None else Delivery(name, event, topic, *counted)
    # The partitioned layout keys a processed event by its partition column too; the guard asks
    # what try_reserve's conflict target would find (and prunes to one partition).
    guard.update(zip(layout.columns, layout.values, strict=True))
    values = _delivery_values(name, event, topic, ttl, deliveries)
    counted = _count(connection, values, guard=guard, asynchronous=asynchronous)
    return None if counted is None else Delivery(name, event, topic, *counted)


COUNT_POSTGRESQL = "SELECT * FROM django_idempotency_count_v1(%s, %s, %s, %s, %s, %s, %s)"
"""The guarded delivery count on PostgreSQL (default layout): a call of the function that
migration ``0006_event_functions`` creates."""


def _call_count(
    connection: BaseDatabaseWrapper,
    name: str,
    event: str,
    topic: str,
    ttl: timedelta | float | None,
    deliveries: int,
    asynchronous: bool,
) -> tuple[int, bool] | None:
    """Count through ``django_idempotency_count_v1``; None if the event is processed.

    Outside a transaction the call is one autocommit statement, asynchronous if asked; inside
    one it joins it in a savepoint and is never asynchronous (see :func:`_count`)."""
    now = timezone.now()
    params: list[Any] = [name, event, topic, deliveries, now, now + _ttl(ttl)]
    if not connection.in_atomic_block:
        return _fetch_count(connection, [*params, asynchronous])
    with transaction.atomic(using=connection.alias):
        return _fetch_count(connection, [*params, False])


def _count_travels(event: str, alias: str) -> bool:
    """Whether the count can travel with the reservation (:func:`_count_and_reserve`): on
    PostgreSQL with psycopg 3 (default layout), outside any transaction."""
    connection = connections[alias]
    return _sql_layout(connection, event) is None and apart_may_travel(connection)


def _count_and_reserve(
    event: str, name: str, topic: str, ttl: Any, alias: str, *, redelivered: bool
) -> tuple[Delivery | None, str]:
    """Count the delivery in a transaction of its own, then open the business transaction with
    the reservation, in one round trip (``BEGIN; <count>; COMMIT; BEGIN; <reserve>``).

    The first delivery of an event pays one round trip for both, where counting apart paid two.
    The count commits, flushed as before (or asynchronously, with ``ASYNC_DELIVERY_COUNT``),
    before the reservation runs, so it survives a worker that dies in the business transaction.
    Returns the delivery (None if the count found the event processed) and what the reservation
    found. A duplicate learns that it is one from this same round trip, and then ends the
    transaction it opened, which wrote nothing."""
    connection = connections[alias]
    now = timezone.now()
    expires = now + _ttl(ttl)
    asynchronous = conf.ASYNC_DELIVERY_COUNT
    count = [name, event, topic, 2 if redelivered else 1, now, expires, asynchronous]
    reserve = [name, event, topic, now, expires, False]
    sent = execute_apart_first(
        connection, (COUNT_POSTGRESQL, count), (RESERVE_POSTGRESQL, reserve)
    )
    if sent is None:
        raise TransactionManagementError(
            "django-idempotency could not count the delivery apart from the business "
            "transaction: a statement ran on the connection between process_event() and its "
            "reservation. Please report this."
        )
    counted, reserved = sent
    delivery = Delivery(name, event, topic, *_counted(counted[0])) if counted else None
    return delivery, str(reserved[0][0])


def _counted(row: tuple[Any, ...]) -> tuple[int, bool]:
    """(deliveries, parked before) from a row of ``django_idempotency_count_v1``."""
    return int(row[0]), bool(row[1])


def _fetch_count(connection: BaseDatabaseWrapper, params: list[Any]) -> tuple[int, bool] | None:
    with connection.cursor() as cursor:
        cursor.execute(COUNT_POSTGRESQL, params)
        row = cursor.fetchone()
    return None if row is None else _counted(row)


def _delivery_values(
    name: str, event: str, topic: str, ttl: timedelta | float | None, deliveries: int = 1
) -> dict[str, Any]:
    now = timezone.now()
    return {
        "consumer": name,
        "event_id": event,
        "topic": topic,
        "deliveries": deliveries,
        "first_delivered_at": now,
        "last_delivered_at": now,
        "last_error": "",
        "expires_at": now + _ttl(ttl),
    }


def _count(
    connection: BaseDatabaseWrapper,
    values: Mapping[str, Any],
    *,
    guard: Mapping[str, Any] | None = None,
    asynchronous: bool = False,
) -> tuple[int, bool] | None:
    """Upsert the counter; (deliveries, parked before), or None if ``guard`` found the event
    processed (:class:`~django_idempotency.models.ProcessedEvent` columns and their values)."""
    vendor = connection.vendor
    if vendor == "mysql":
        # No RETURNING with ON DUPLICATE KEY UPDATE: read the count back in the same transaction.
        if guard is not None and _processed(connection, guard):
            return None
        with transaction.atomic(using=connection.alias):
            return _upsert_delivery(connection, values, None, asynchronous=False)
    if vendor not in ("postgresql", "sqlite"):
        raise NotSupportedError(
            f"django-idempotency supports PostgreSQL, MySQL/MariaDB and SQLite, not {vendor!r}."
        )
    if not connection.in_atomic_block:
        # One autocommit statement. Asynchronous commit is only ever asked for here: inside a
        # transaction, set_config(..., true) would last until that transaction's own COMMIT.
        asynchronous = asynchronous and vendor == "postgresql"
        return _upsert_delivery(connection, values, guard, asynchronous=asynchronous)
    with transaction.atomic(using=connection.alias):
        return _upsert_delivery(connection, values, guard, asynchronous=False)


ASYNC_COMMIT = "set_config('synchronous_commit', 'off', true) = 'off'"
"""PostgreSQL: this statement's own (autocommit) transaction commits without waiting on its WAL
flush. ``true`` scopes the setting to that transaction; it is back to the server's value when
the statement returns. The next synchronous commit on the server flushes the count with it."""


def _upsert_delivery(
    connection: BaseDatabaseWrapper,
    values: Mapping[str, Any],
    guard: Mapping[str, Any] | None,
    *,
    asynchronous: bool,
) -> tuple[int, bool] | None:
    model = EventDelivery
    # INSERT ... SELECT when a WHERE follows (the guard, or the asynchronous commit).
    sql, params = _insert_sql(connection, model, values, select=bool(guard) or asynchronous)
    upsert, select = _delivery_sql(connection, sql, tuple(guard or ()), asynchronous)
    with connection.cursor() as cursor:
        if connection.vendor == "mysql":
            prepared = dict(zip(values, params, strict=True))
            cursor.execute(
                upsert, [*params, prepared["last_delivered_at"], prepared["expires_at"]]
            )
            cursor.execute(select, [prepared["consumer"], prepared["event_id"]])
        else:
            cursor.execute(upsert, [*params, *(guard or {}).values()])
        row = cursor.fetchone()
    if row is None:  # the guard found a processed event: nothing was written
        return None
    count, parked = row
    # parked_at is tested here, not in SQL: SQLite 3.40 answers "parked_at IS NOT NULL" wrongly
    # (true for a NULL) in the RETURNING clause of an upsert.
    return int(count), parked is not None


def _delivery_sql(
    connection: BaseDatabaseWrapper, insert: str, guard: tuple[str, ...], asynchronous: bool
) -> tuple[str, str]:
    """The delivery upsert (and MySQL's read-back), built once per backend, insert and guard.

    With a guard (PostgreSQL, SQLite), ``insert`` is an ``INSERT ... SELECT`` and gets
    ``WHERE NOT EXISTS (the processed event)``: on a processed event it inserts nothing, updates
    nothing and returns no row. (Not ``ON CONFLICT DO UPDATE ... WHERE``: that still locks the
    conflicting row, a write that waits on a WAL flush.)
    """
    cache_key = ("delivery", connection.vendor, insert, guard, asynchronous)
    cached = _SQL.get(cache_key)
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    model = EventDelivery
    quote = connection.ops.quote_name
    table = quote(model._meta.db_table)

    def column(name: str) -> str:
        return quote(_field(model, name).column)

    deliveries, parked_at = column("deliveries"), column("parked_at")
    last, expires = column("last_delivered_at"), column("expires_at")
    select = ""
    if connection.vendor == "mysql":
        upsert = (
            f"{insert} ON DUPLICATE KEY UPDATE {deliveries} = {deliveries} + 1, "
            f"{last} = %s, {expires} = %s"
        )
        select = (
            f"SELECT {deliveries}, {parked_at} FROM {table} "
            f"WHERE {column('consumer')} = %s AND {column('event_id')} = %s"
        )
    else:
        conditions = [f"NOT EXISTS ({_processed_sql(connection, guard)})"] if guard else []
        if asynchronous:
            conditions.append(ASYNC_COMMIT)
        where = f" WHERE {' AND '.join(conditions)}" if conditions else ""
        target = _columns(connection, model, ("consumer", "event_id"))
        upsert = (
            f"{insert}{where} ON CONFLICT ({target}) DO UPDATE SET "
            f"{deliveries} = {table}.{deliveries} + 1, "
            f"{last} = excluded.{last}, {expires} = excluded.{expires} "
            f"RETURNING {deliveries}, {parked_at}"
        )
    _SQL[cache_key] = (upsert, select)
    return upsert, select


def _processed_sql(connection: BaseDatabaseWrapper, guard: tuple[str, ...]) -> str:
    """``SELECT 1 FROM processed_event WHERE column = %s AND ...`` for the ``guard`` columns."""
    quote = connection.ops.quote_name
    declared = {field.name: field.column for field in ProcessedEvent._meta.concrete_fields}
    conditions = " AND ".join(f"{quote(declared.get(name, name))} = %s" for name in guard)
    return f"SELECT 1 FROM {quote(ProcessedEvent._meta.db_table)} WHERE {conditions}"


def _processed(connection: BaseDatabaseWrapper, guard: Mapping[str, Any]) -> bool:
    """Whether the event is processed already (MySQL/MariaDB: a plain read, no lock)."""
    cache_key = ("processed", connection.vendor, tuple(guard))
    sql = _SQL.get(cache_key)
    if sql is None:
        sql = _SQL[cache_key] = _processed_sql(connection, tuple(guard))
    with connection.cursor() as cursor:
        cursor.execute(sql, list(guard.values()))
        return cursor.fetchone() is not None


def _park(delivery: Delivery, using: str) -> bool:
    """Mark the event parked in a transaction of its own; True if this call parked it."""
    with transaction.atomic(using=using):
        return (
            EventDelivery.objects.using(using)
            .filter(consumer=delivery.consumer, event_id=delivery.event_id, parked_at=None)
            .update(parked_at=timezone.now())
            == 1
        )


def _record_error(
    delivery: Delivery, error: BaseException, using: str, *, unless_processed: bool = False
) -> None:
    """Keep the last error of a failed delivery, for the admin; never hides the error itself.

    With ``unless_processed``, the error is kept only while this is still the latest delivery
    and the event is not processed: a retry that a failed delivery published before it finished
    (Celery's ``autoretry_for``) may already have counted itself or applied the event, and then
    this error is stale.
    """
    text = f"{type(error).__name__}: {error}"[:2000]
    rows = EventDelivery.objects.using(using).filter(
        consumer=delivery.consumer, event_id=delivery.event_id
    )
    if unless_processed:
        # A later delivery has counted itself (and will clear or replace the error), or has
        # applied the event: this error is stale either way.
        rows = rows.filter(deliveries=delivery.count).exclude(
            Exists(
                ProcessedEvent.objects.using(using).filter(
                    consumer=delivery.consumer, event_id=delivery.event_id
                )
            )
        )
    try:
        with transaction.atomic(using=using):
            rows.update(last_error=text)
    except DatabaseError:  # the body's error is the one that matters, and it propagates
        logger.warning(
            "could not record the error of event %s for consumer %s",
            delivery.event_id,
            delivery.consumer,
            exc_info=True,
        )


# --- Processing one event -----------------------------------------------------------------------


class Processed(NamedTuple, Generic[T]):
    """What :func:`process_event` did."""

    applied: bool
    """True if the body ran and its transaction committed; False for a duplicate."""
    result: T | None
    """The body's return value, or None for a duplicate."""


class _ParkInstead(Exception):
    """Rolls the reservation back when an over-delivered event must be parked, not run."""


def process_event(
    consumer: str,
    event_id: EventId,
    body: Callable[[], T],
    *,
    topic: str | None = None,
    ttl: timedelta | float | None = None,
    using: str | None = None,
    max_deliveries: int | None = None,
    count_deliveries: bool = True,
    redelivered: bool | None = None,
) -> Processed[T]:
    """Run ``body`` once for ``(consumer, event_id)``, in one transaction with the reservation.

    1. Count the delivery in its own committed transaction (unless ``count_deliveries`` is
       False), in one statement that counts only if the event is not processed yet: a duplicate
       of a processed event returns ``Processed(False, None)``, having written nothing (logged
       and signalled as in step 2). An event already parked raises :class:`EventParked`.
    2. Open ``transaction.atomic(using=...)`` and :func:`try_reserve` the event. A duplicate
       returns ``Processed(False, None)``, logs ``duplicate ignored`` and sends
       :data:`~django_idempotency.signals.event_duplicate`.

       On PostgreSQL with psycopg 3, outside any transaction, steps 1 and 2 are one round trip
       (:func:`_count_and_reserve`): the count commits, then the reservation opens the
       transaction. A parked event's reservation is then rolled back before it is refused.
    3. If the event has been delivered more than ``max_deliveries`` times (default
       ``MAX_DELIVERIES``) and the reservation shows it was never processed, roll back, park it,
       log at ERROR, send :data:`~django_idempotency.signals.event_parked` and raise
       :class:`EventParked`. (The parking decision waits on the reservation, so a delivery that
       is merely concurrent with a successful one is never parked.)
    4. Otherwise run ``body`` in the transaction; its exception rolls the reservation back and
       propagates unchanged, so the next delivery runs again. A success clears the
       ``last_error`` an earlier failed delivery left on the counter.
    5. An exception raised *after* the transaction committed (by an ``on_commit`` callback the
       body registered) is raised as :class:`~django_idempotency.exceptions.OnCommitFailed`,
       with the original as its ``__cause__``: the event is applied and a redelivery would be
       skipped as a duplicate, so it must not be read as "nothing applied".

    ``redelivered`` is what the broker says of this message, where it says it reliably:

    * ``None`` (the default): unknown; every delivery is counted as above.
    * ``False``: the broker vouches that this message was never delivered before (AMQP's
      ``redelivered`` flag, which RabbitMQ sets on every message it delivers again). Step 1 is
      skipped: its commit is what makes a first delivery cost twice the effect alone. Nothing
      is lost by it: if this delivery dies with its process, the broker's next delivery says
      ``redelivered=True`` and counts for both. Step 2 still refuses (and counts) a parked
      event, and a delivery that fails counts itself after its rollback, then parks the event
      once it has failed ``max_deliveries`` times, so its body runs at most that often and a
      loop of retries ends.
    * ``True``: the message may have been delivered before. It is counted as in step 1, and a
      counter that does not exist yet starts at 2, for the uncounted first delivery.

    Never pass ``False`` from a broker that does not set the flag for certain: a message that
    kills its worker on every delivery would then never be counted, and never parked.
    """
    event = normalize_event_id(event_id)
    name = checked_name("consumer name", consumer)
    topic_value = _checked_topic(topic)
    alias = _alias(using)
    limit = conf.MAX_DELIVERIES if max_deliveries is None else max_deliveries
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"max_deliveries must be a positive integer, not {limit!r}.")
    if redelivered is not None and not isinstance(redelivered, bool):
        raise TypeError(f"redelivered must be True, False or None, not {redelivered!r}.")

    # The broker vouches for a first delivery: its count is skipped (see above).
    first = count_deliveries and redelivered is False
    counted = count_deliveries and not first
    # On PostgreSQL the count travels with the reservation (_count_and_reserve), where it can.
    travels = counted and _count_travels(event, alias)
    delivery = None
    if counted and not travels:
        delivery = _count_unless_processed(
            event, name, topic_value, ttl, alias, redelivered=bool(redelivered)
        )
        if delivery is None:  # processed before: answered by the count's one read
            _duplicate_ignored(event, name, topic_value)
            return Processed(False, None)
        if delivery.parked:
            _reject_parked(event, name, topic_value, delivery.count)
    committed: list[bool] = []

    try:
        with transaction.atomic(using=alias):
            # Registered first, so it runs first among the commit hooks: once it has run, the
            # transaction has committed, whatever a later hook raises.
            transaction.on_commit(lambda: committed.append(True), using=alias)
            if travels:
                delivery, state = _count_and_reserve(
                    event, name, topic_value, ttl, alias, redelivered=bool(redelivered)
                )
            elif first:
                state = _reserve_first_delivery(event, name, topic_value, ttl, alias)
            else:
                reserved = try_reserve(event, name, topic=topic_value, ttl=ttl, using=alias)
                state = RESERVED if reserved else PROCESSED
            if state == PROCESSED:
                applied = False
                result = None
            elif state == PARKED or (
                delivery is not None and (delivery.parked or delivery.count > limit)
            ):
                raise _ParkInstead
            else:
                applied = True
                result = body()
                if delivery is not None and delivery.count > 1:
                    _clear_error(delivery, alias)
    except _ParkInstead:
        if delivery is None:  # a first delivery found the event parked: counted, refused
            delivery = _count_skipped(event, name, topic_value, ttl, alias)
            _reject_parked(event, name, topic_value, None if delivery is None else delivery.count)
        if delivery.parked:  # counted with the reservation, which it rolled back
            _reject_parked(event, name, topic_value, delivery.count)
        _park_and_raise(delivery, limit, alias)
    except BaseException as exc:
        if isinstance(exc, Exception):
            if first and not committed:
                # Its count was skipped: the failure counts itself, after the rollback.
                _fail_first_delivery(event, name, topic_value, ttl, alias, exc, limit)
            elif first:
                delivery = _count_skipped(event, name, topic_value, ttl, alias)
            if committed:
                _after_commit_failed(event, name, delivery, exc, alias)
            if delivery is not None and not first:
                _record_error(delivery, exc, alias, unless_processed=True)
        raise

    if not applied:
        _duplicate_ignored(event, name, topic_value)
    return Processed(applied, result)


def _reject_parked(event: str, consumer: str, topic: str, count: int | None) -> NoReturn:
    times = "" if count is None else f" ({count} deliveries)"
    logger.error(
        "parked event delivered again and rejected: event %s, consumer %s%s. Delete its "
        "EventDelivery row to let it run again.",
        event,
        consumer,
        times,
        extra={"event_id": event, "consumer": consumer, "topic": topic},
    )
    raise EventParked(f"Event {event} for consumer {consumer!r} is parked{times}.")


def _fail_first_delivery(
    event: str,
    name: str,
    topic: str,
    ttl: Any,
    alias: str,
    error: BaseException,
    limit: int,
) -> None:
    """Count a failed first delivery (its count was skipped), keep its error, park if due.

    It runs in a transaction that first reserves the event, and gives the reservation up again
    before it commits. That reservation orders it against every other delivery of the event:

    * a delivery that applied the event meanwhile (a retry Celery published before this one
      ended) has it reserved: the insert waits for it, then finds it processed, and nothing is
      recorded, so no stale error lands on a processed event;
    * a delivery that comes meanwhile waits for this transaction, then reads the counter as it
      left it: it clears the error if it succeeds, and it is refused if the event got parked.

    The event is parked in the same transaction once it has failed ``limit`` times, so its
    body runs at most ``limit`` times, as when every delivery is counted before it runs (there,
    delivery ``limit + 1`` is parked without running).
    A database error here is logged and never hides the body's own error, which propagates.
    """
    text = f"{type(error).__name__}: {error}"[:2000]
    try:
        with transaction.atomic(using=alias):
            if not try_reserve(event, name, topic=topic, ttl=ttl, using=alias):
                return  # applied meanwhile: this error is stale
            delivery = count_delivery(event, name, topic=topic, ttl=ttl, using=alias)
            changes: dict[str, Any] = {"last_error": text}
            park = delivery.count >= limit and not delivery.parked
            if park:
                changes["parked_at"] = timezone.now()
            EventDelivery.objects.using(alias).filter(consumer=name, event_id=event).update(
                **changes
            )
            ProcessedEvent.objects.using(alias).filter(consumer=name, event_id=event).delete()
    except DatabaseError:
        logger.warning(
            "could not count the failed delivery of event %s for consumer %s",
            event,
            name,
            exc_info=True,
        )
        return
    if park:
        _parked(delivery, limit, newly=True)


def _count_skipped(event: str, name: str, topic: str, ttl: Any, alias: str) -> Delivery | None:
    """Count a first delivery after all: one whose ``on_commit`` callback failed (the event is
    applied, and its counter is where the admin shows the error), or one that found the event
    parked (every delivery of a parked event is counted). None if the count failed (logged)."""
    try:
        return count_delivery(event, name, topic=topic, ttl=ttl, using=alias)
    except DatabaseError:
        logger.warning(
            "could not count the delivery of event %s for consumer %s",
            event,
            name,
            exc_info=True,
        )
        return None


def _duplicate_ignored(event: str, consumer: str, topic: str) -> None:
    logger.info(
        "duplicate ignored: event %s, consumer %s",
        event,
        consumer,
        extra={"event_id": event, "consumer": consumer, "topic": topic},
    )
    signals.event_duplicate.send(sender=consumer, event_id=event, topic=topic)


def _clear_error(delivery: Delivery, using: str) -> None:
    """Clear the error an earlier delivery recorded, in the transaction of the success."""
    EventDelivery.objects.using(using).filter(
        consumer=delivery.consumer, event_id=delivery.event_id
    ).exclude(last_error="").update(last_error="")


def _after_commit_failed(
    event: str, consumer: str, delivery: Delivery | None, error: Exception, using: str
) -> NoReturn:
    logger.error(
        "event %s applied and committed for consumer %s, but an on_commit callback then "
        "failed: %s: %s. A redelivery is skipped as a duplicate, so the callback's work is "
        "not retried.",
        event,
        consumer,
        type(error).__name__,
        error,
        extra={"event_id": event, "consumer": consumer},
    )
    failure = OnCommitFailed(
        f"Event {event} for consumer {consumer!r} committed, then an on_commit callback "
        f"failed: {type(error).__name__}: {error}"
    )
    if delivery is not None:
        _record_error(delivery, failure, using)
    raise failure from error


def _park_and_raise(delivery: Delivery, limit: int, using: str) -> NoReturn:
    _parked(delivery, limit, _park(delivery, using))
    raise EventParked(
        f"Event {delivery.event_id} for consumer {delivery.consumer!r} was delivered "
        f"{delivery.count} times without being processed (limit {limit}) and is parked."
    )


def _parked(delivery: Delivery, limit: int, newly: bool) -> None:
    """Log a parked event at ERROR, and signal it the first time."""
    logger.error(
        "EVENT PARKED: event %s, consumer %s, delivered %d times without being processed "
        "(MAX_DELIVERIES=%d). It will not run again. Find it in the admin under "
        "'event deliveries' (parked); delete that row to let it run again.",
        delivery.event_id,
        delivery.consumer,
        delivery.count,
        limit,
        extra={
            "event_id": delivery.event_id,
            "consumer": delivery.consumer,
            "topic": delivery.topic,
        },
    )
    if newly:
        signals.event_parked.send(
            sender=delivery.consumer,
            event_id=delivery.event_id,
            topic=delivery.topic,
            deliveries=delivery.count,
        )


MISSING_ID_PREFIX = "no-event-id:"
"""Prefix of the ``event_id`` under which :func:`park_message` parks a message without one."""


def park_message(
    consumer: str,
    message_ref: str,
    reason: str,
    *,
    topic: str | None = None,
    using: str | None = None,
) -> str:
    """Park a message that carries no usable event id, where the admin shows it; return its key.

    Such a message cannot be deduplicated, so it must not run, and it must not vanish either.
    It is recorded as a parked :class:`~django_idempotency.models.EventDelivery` row for
    ``consumer`` under the event id ``"no-event-id:<message_ref>"`` (the broker's message or
    task id), with ``reason`` (what was wrong, and the message's arguments) as its last error.
    The row lives ``EVENT_TTL`` like any other counter. Logged at ERROR;
    :data:`~django_idempotency.signals.event_parked` is sent the first time.
    """
    name = checked_name("consumer name", consumer)
    key = MISSING_ID_PREFIX + str(message_ref)[: MAX_ID_LENGTH - len(MISSING_ID_PREFIX)]
    alias = _alias(using)
    delivery = count_delivery(key, name, topic=topic, using=alias)
    newly = _park(delivery, alias)
    _record_error(delivery, MissingEventId(reason), alias)
    logger.error(
        "MESSAGE PARKED, no usable event id: consumer %s, message %s: %s. Find it in the admin "
        "under 'event deliveries' (parked), event id %s.",
        name,
        message_ref,
        reason,
        key,
        extra={"event_id": key, "consumer": name, "topic": delivery.topic},
    )
    if newly:
        signals.event_parked.send(
            sender=name, event_id=key, topic=delivery.topic, deliveries=delivery.count
        )
    return key
