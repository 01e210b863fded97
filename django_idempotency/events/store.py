"""The event side's rows: what a reservation, a delivery count and a park read and write.

:mod:`django_idempotency.events.core` is the core that decides what happens to a delivery (reserve,
count, park); this module is how each of those reaches the database, per backend, as
:mod:`django_idempotency.http.store` is for the HTTP core. It reads no setting and makes no
decision:
the core passes in what it resolved (the time to keep a row, whether a count may commit
asynchronously), and gets back what the database found.

* The reservation: one :class:`~django_idempotency.models.ProcessedEvent` row, inserted unless
  it is there (:func:`reserve`). On PostgreSQL (default layout) it is a call of the function
  that migration ``0013_reserve_function_v2`` creates; elsewhere an insert
  that names its conflict target (:func:`insert_new`). A first delivery's reservation also
  reads the event's counter (:func:`_read_counters`), right at every isolation level.
* The delivery count: an upsert of the :class:`~django_idempotency.models.EventDelivery`
  counter (:func:`count`, :func:`call_count`), or, on PostgreSQL with psycopg 3, the count and
  the reservation in one round trip (:func:`count_and_reserve`).
* The counter's other writes: :func:`park`, :func:`record_error`, :func:`clear_error`, and
  :func:`fail_reserved` for a failed first delivery.

SQL text is built once per backend and column list, and cached in :data:`_SQL`.

Why this module is long: the same four operations (reserve, count, park, read the errors) are
written out for PostgreSQL, MariaDB and SQLite side by side, so that a reader compares one
backend's SQL with another's in one place.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import DatabaseError, IntegrityError, NotSupportedError, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Exists, Field, Model
from django.db.transaction import TransactionManagementError
from django.utils import timezone

from django_idempotency.exceptions import error_text, log_text
from django_idempotency.models import EventDelivery, ProcessedEvent
from django_idempotency.pg_roundtrips import execute_apart_first, execute_first
from django_idempotency.retention.partitioning import EventInsert, event_insert

#: The core's logger: what goes wrong here is reported where the core reports.
logger = logging.getLogger("django_idempotency.events.core")

ER_DUP_ENTRY = 1062
"""MySQL/MariaDB error number of a duplicate key, and the only one that means "already there"."""


def sql_layout(
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
first delivery, see :func:`reserve`) its delivery counter is parked."""

RESERVE_POSTGRESQL = "SELECT django_idempotency_reserve_v2(%s, %s, %s, %s, %s, %s)"
"""The reservation on PostgreSQL (default layout): a call of the function that migration
``0013_reserve_function_v2`` creates, whose plan PostgreSQL caches per server session. (v1, of
``0006_event_functions``, read a first delivery's counter in the snapshot under ``REPEATABLE
READ``; it stays for the code of the release before, during a deploy.)"""


def reserve(
    connection: BaseDatabaseWrapper,
    name: str,
    event: str,
    topic: str,
    now: datetime,
    expires: datetime,
    *,
    occurred_at: datetime | None = None,
    first_delivery: bool = False,
) -> str:
    """Reserve ``event`` for consumer ``name`` in the open transaction; RESERVED, PROCESSED or
    PARKED.

    With ``first_delivery`` (a delivery whose count was skipped) the reservation also reads
    what the count would have: a parked counter is PARKED (the caller rolls the reservation
    back), and an error an earlier delivery left on it is cleared in this transaction. The
    counter is read after the insert, which waits for any delivery that holds the event, and
    it must be the latest counter, not the one of a snapshot taken before that wait
    (``REPEATABLE READ``, ``SERIALIZABLE``): see :func:`_read_counters`. On PostgreSQL
    (default layout) all of it is one call of ``django_idempotency_reserve_v2``; elsewhere
    :func:`_read_counters` follows the insert. ``occurred_at`` is for the partitioned layout
    only."""
    layout = sql_layout(connection, event, occurred_at)
    if layout is None:
        # psycopg takes the datetimes as they are (Django's field preparation changes nothing
        # on PostgreSQL, and costs a tenth of the call). Usually the first statement of the
        # transaction: its BEGIN travels with it.
        params = [name, event, topic, now, expires, first_delivery]
        return str(execute_first(connection, RESERVE_POSTGRESQL, params)[0][0])
    values = _row(name, event, topic, now, expires)
    raw = dict(zip(layout.columns, layout.values, strict=True))
    if not insert_new(connection, ProcessedEvent, values, unique=layout.conflict_target, raw=raw):
        return PROCESSED
    if not first_delivery:
        return RESERVED
    return _read_counters(connection, name, [event], topic, now, expires)[event]


CHUNK = 500
"""Rows per statement of :func:`reserve_first_deliveries`, at most (``BATCH_SIZE`` goes up to
10,000 messages); fewer where the backend binds fewer values (:func:`chunk_size`)."""

ROW_VALUES = 5
"""Values one reservation's row binds (:func:`_row`)."""


def chunk_size(connection: BaseDatabaseWrapper) -> int:
    """Rows per statement of :func:`reserve_first_deliveries` on ``connection``: :data:`CHUNK`,
    or what fits Django's bound on a statement's values (SQLite's 999: SQLite before 3.32,
    Ubuntu 20.04's 3.31 among them, binds no more, and the insert failed there with "too many
    SQL variables" on every batch of more than 199 messages)."""
    limit = connection.features.max_query_params
    return CHUNK if not limit else max(1, min(CHUNK, limit // ROW_VALUES))


def reserve_first_deliveries(
    connection: BaseDatabaseWrapper,
    name: str,
    events: list[str],
    topic: str,
    now: datetime,
    expires: datetime,
) -> dict[str, str]:
    """Reserve distinct first deliveries (default layout) in the open transaction, in a few
    statements for all of them; RESERVED, PROCESSED or PARKED per event.

    What :func:`reserve` with ``first_delivery`` does for one event, for many: one read of the
    events processed already, one multi-row ``INSERT`` of the others, then one read of their
    counters (after the inserts, as in :func:`reserve`, and of their latest committed state at
    every isolation level: :func:`_read_counters`), and an update that clears the errors
    earlier deliveries left, if any. (Per :func:`chunk_size` events.)

    The insert is a plain one: no ``ON CONFLICT``, no ``INSERT IGNORE``, no savepoint. An event
    another transaction reserved after the read raises the duplicate-key ``IntegrityError``
    (as does any other error), and the caller's transaction must then roll back; the caller
    processes the events one at a time instead. So the read only has to be right in the common
    case, never for the unique constraint to hold.
    """
    states: dict[str, str] = {}
    reserved: list[list[str]] = []
    size = chunk_size(connection)
    for start in range(0, len(events), size):
        chunk = events[start : start + size]
        processed = set(
            ProcessedEvent.objects.using(connection.alias)
            .filter(consumer=name, event_id__in=chunk)
            .values_list("event_id", flat=True)
        )
        states.update(dict.fromkeys(processed, PROCESSED))
        new = [event for event in chunk if event not in processed]
        if not new:
            continue
        sql, params = _insert_sql(
            connection, ProcessedEvent, _row(name, new[0], topic, now, expires)
        )
        for event in new[1:]:
            params.extend(
                _insert_sql(connection, ProcessedEvent, _row(name, event, topic, now, expires))[1]
            )
        head, values = sql.rsplit(" VALUES ", 1)
        with connection.cursor() as cursor:
            cursor.execute(f"{head} VALUES {', '.join([values] * len(new))}", params)
        states.update(dict.fromkeys(new, RESERVED))
        reserved.append(new)
    # The counters are read once every insert is done (each may have waited for a delivery
    # that held one of the events), in the latest committed state (_read_counters). Reading
    # them after all the inserts also keeps a read's locks (MySQL/MariaDB) from being taken
    # before a later insert waits.
    for new in reserved:
        states.update(_read_counters(connection, name, new, topic, now, expires))
    return states


def _read_counters(
    connection: BaseDatabaseWrapper,
    name: str,
    events: list[str],
    topic: str,
    now: datetime,
    expires: datetime,
) -> dict[str, str]:
    """What the counters of reserved first deliveries say, each RESERVED or PARKED; the errors
    earlier deliveries left on the others are cleared in the open transaction.

    Called after the reservations' inserts, which waited for any delivery that held one of the
    events (a failed one parks it or records its error while it holds it:
    ``events._fail_first_delivery``), the read must see the latest committed counters, not a
    snapshot taken before that wait, which ``REPEATABLE READ`` and ``SERIALIZABLE`` read:

    * PostgreSQL: at those levels (the statement asks ``transaction_isolation`` itself, so no
      level set anywhere escapes it) one statement also inserts the counters ``ON CONFLICT DO
      NOTHING`` (:data:`COUNTERS_POSTGRESQL`), as ``django_idempotency_reserve_v2`` does for
      one event. A counter committed after the snapshot raises a serialization failure
      (``40001``: nothing applied, retry later); one in the snapshot is the latest, and the
      counters it inserted, where there were none, are deleted again. At ``READ COMMITTED`` it
      is a plain read, as before.
    * MySQL/MariaDB: a locking read, which reads the latest committed rows at any level.
    * SQLite: a plain read; a writer has the whole database to itself.

    ``events`` are distinct. A counter equal to one of several events only by the column's
    collation (case, trailing spaces) refuses them all (PARKED): which one it counts is unclear,
    so the caller processes them one at a time, each alone here, where the counter the column
    finds is the event's own.
    """
    alias = connection.alias
    counters = EventDelivery.objects.using(alias).filter(consumer=name, event_id__in=events)
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(
                _counters_sql(connection),
                [name, topic, now, now, expires, events, name, events],
            )
            rows = cursor.fetchall()
        probed = [event for event, _, _, inserted in rows if inserted]
        if probed:  # REPEATABLE READ or SERIALIZABLE, events without a counter: none is left
            with connection.cursor() as cursor:
                cursor.execute(_counters_sql(connection, delete=True), [name, probed])
        found = [(event, parked_at, error) for event, parked_at, error, inserted in rows]
    else:
        rows = counters.select_for_update() if connection.vendor == "mysql" else counters
        found = list(rows.values_list("event_id", "parked_at", "last_error"))
    states = dict.fromkeys(events, RESERVED)
    errors = []
    for event, parked_at, last_error in found:
        if event not in states:
            if len(events) > 1:
                return dict.fromkeys(events, PARKED)
            event = events[0]  # the one counter the column finds equal to the event
        if parked_at is not None:
            states[event] = PARKED
        elif last_error:
            errors.append(event)
    if errors:
        counters.filter(event_id__in=errors).update(last_error="")
    return states


COUNTERS_POSTGRESQL = """
WITH probe AS (
    INSERT INTO {table} AS d ({columns})
    SELECT %s, e.id, %s, 1, %s, %s, '', %s FROM unnest(%s::text[]) AS e (id)
    WHERE current_setting('transaction_isolation') IN ('repeatable read', 'serializable')
    ON CONFLICT ({consumer}, {event_id}) DO NOTHING
    RETURNING d.{event_id}
)
SELECT {event_id}, {parked_at}, {last_error}, false FROM {table}
WHERE {consumer} = %s AND {event_id} = ANY(%s::text[])
UNION ALL
SELECT {event_id}, NULL, '', true FROM probe
"""
"""PostgreSQL: the counters of reserved first deliveries (not the partition column: counters
are keyed by consumer and event id in every layout), as :func:`_read_counters` reads them. At
``REPEATABLE READ`` and ``SERIALIZABLE`` the ``probe`` inserts a counter for each event; its
conflict with a counter committed after the snapshot raises ``40001``. The read beside it shares
the statement's snapshot, so it never sees the probe's rows, which come back flagged ``true``.
At ``READ COMMITTED`` the probe's ``WHERE`` is false and it inserts nothing."""

DELETE_PROBED = "DELETE FROM {table} WHERE {consumer} = %s AND {event_id} = ANY(%s::text[])"


def _counters_sql(connection: BaseDatabaseWrapper, *, delete: bool = False) -> str:
    """:data:`COUNTERS_POSTGRESQL`, or with ``delete`` the deletion of the probe's counters."""
    cache_key = ("counters", connection.vendor, delete)
    cached = _SQL.get(cache_key)
    if cached is None:
        quote = connection.ops.quote_name

        def column(name: str) -> str:
            return quote(_field(EventDelivery, name).column)

        names = (
            "consumer",
            "event_id",
            "topic",
            "deliveries",
            "first_delivered_at",
            "last_delivered_at",
            "last_error",
            "expires_at",
        )
        text = DELETE_PROBED if delete else COUNTERS_POSTGRESQL
        cached = _SQL[cache_key] = text.format(
            table=quote(EventDelivery._meta.db_table),
            columns=", ".join(map(column, names)),
            consumer=column("consumer"),
            event_id=column("event_id"),
            parked_at=column("parked_at"),
            last_error=column("last_error"),
        ).strip()
    return str(cached)


PQTRANS_INERROR = 3
"""libpq's transaction status of a transaction that a failed statement aborted (psycopg 3's
``TransactionStatus.INERROR``, psycopg2's ``TRANSACTION_STATUS_INERROR``)."""


def transaction_doomed(connection: BaseDatabaseWrapper) -> bool:
    """Whether the open transaction can only roll back, though no exception says so: marked by
    ``transaction.set_rollback(True)`` (or an error that left an inner ``atomic`` without a
    savepoint), or, on PostgreSQL, aborted by a failed statement whose error was caught. Its
    ``COMMIT`` then rolls back without an error. No query: what Django and the driver know."""
    if connection.needs_rollback:
        return True
    raw = connection.connection
    if connection.vendor != "postgresql" or raw is None:
        return False
    return int(raw.info.transaction_status) == PQTRANS_INERROR


def _row(name: str, event: str, topic: str, now: datetime, expires: datetime) -> dict[str, Any]:
    return {
        "consumer": name,
        "event_id": event,
        "topic": topic,
        "processed_at": now,
        "expires_at": expires,
    }


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


def insert_new(
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
            if mysql_errno(exc) == ER_DUP_ENTRY:
                return False
            raise
        return True
    raise NotSupportedError(
        f"django-idempotency supports PostgreSQL, MySQL/MariaDB and SQLite, not {vendor!r}."
    )


def mysql_errno(exc: BaseException) -> int | None:
    code = exc.args[0] if exc.args else None
    return code if isinstance(code, int) else None


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


COUNT_POSTGRESQL = "SELECT * FROM django_idempotency_count_v1(%s, %s, %s, %s, %s, %s, %s)"
"""The guarded delivery count on PostgreSQL (default layout): a call of the function that
migration ``0006_event_functions`` creates."""


def call_count(
    connection: BaseDatabaseWrapper,
    name: str,
    event: str,
    topic: str,
    ttl: timedelta,
    deliveries: int,
    asynchronous: bool,
) -> tuple[int, bool] | None:
    """Count through ``django_idempotency_count_v1``; None if the event is processed.

    Outside a transaction the call is one autocommit statement, asynchronous if asked; inside
    one it joins it in a savepoint and is never asynchronous (see :func:`count`)."""
    now = timezone.now()
    params: list[Any] = [name, event, topic, deliveries, now, now + ttl]
    if not connection.in_atomic_block:
        return _fetch_count(connection, [*params, asynchronous])
    with transaction.atomic(using=connection.alias):
        return _fetch_count(connection, [*params, False])


def count_and_reserve(
    connection: BaseDatabaseWrapper,
    name: str,
    event: str,
    topic: str,
    ttl: timedelta,
    *,
    redelivered: bool,
    asynchronous: bool,
) -> tuple[Delivery | None, str]:
    """Count the delivery in a transaction of its own, then open the business transaction with
    the reservation, in one round trip (``BEGIN; <count>; COMMIT; BEGIN; <reserve>``).

    The first delivery of an event pays one round trip for both, where counting apart paid two.
    The count commits, flushed (or, with ``asynchronous``, without waiting on its flush),
    before the reservation runs, so it survives a worker that dies in the business transaction.
    Returns the delivery (None if the count found the event processed) and what the reservation
    found. A duplicate learns that it is one from this same round trip, and then ends the
    transaction it opened, which wrote nothing."""
    now = timezone.now()
    expires = now + ttl
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


def delivery_values(
    name: str, event: str, topic: str, ttl: timedelta, deliveries: int = 1
) -> dict[str, Any]:
    """The columns of a new counter, by field name: delivered now, kept for ``ttl``."""
    now = timezone.now()
    return {
        "consumer": name,
        "event_id": event,
        "topic": topic,
        "deliveries": deliveries,
        "first_delivered_at": now,
        "last_delivered_at": now,
        "last_error": "",
        "expires_at": now + ttl,
    }


def count(
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


def park(delivery: Delivery, using: str) -> bool:
    """Mark the event parked in a transaction of its own; True if this call parked it."""
    with transaction.atomic(using=using):
        return (
            EventDelivery.objects.using(using)
            .filter(consumer=delivery.consumer, event_id=delivery.event_id, parked_at=None)
            .update(parked_at=timezone.now())
            == 1
        )


def record_error(
    delivery: Delivery, error: BaseException, using: str, *, unless_processed: bool = False
) -> None:
    """Keep the last error of a failed delivery, for the admin; never hides the error itself.

    With ``unless_processed``, the error is kept only while this is still the latest delivery
    and the event is not processed: a retry that a failed delivery published before it finished
    (Celery's ``autoretry_for``) may already have counted itself or applied the event, and then
    this error is stale.
    """
    text = error_text(error)
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
            log_text(delivery.event_id),
            log_text(delivery.consumer),
            exc_info=True,
        )


def clear_error(delivery: Delivery, using: str) -> None:
    """Clear the error an earlier delivery recorded, in the transaction of the success."""
    EventDelivery.objects.using(using).filter(
        consumer=delivery.consumer, event_id=delivery.event_id
    ).exclude(last_error="").update(last_error="")


def fail_reserved(
    alias: str, name: str, event: str, error: BaseException | None, *, park: bool
) -> None:
    """Keep a failed first delivery's error on its counter (unless ``error`` is None; and park
    it, if ``park``), then give up the reservation that ordered this transaction against the
    event's other deliveries."""
    changes: dict[str, Any] = {} if error is None else {"last_error": error_text(error)}
    if park:
        changes["parked_at"] = timezone.now()
    if changes:
        EventDelivery.objects.using(alias).filter(consumer=name, event_id=event).update(**changes)
    ProcessedEvent.objects.using(alias).filter(consumer=name, event_id=event).delete()
