"""Opt-in PostgreSQL layout: ``ProcessedEvent`` range-partitioned by the event's own time.

A partitioned table enforces uniqueness only inside each partition. Partitioning by the time
of *processing* would send a late duplicate to a newer partition, where nothing stops it. So
the partition key, ``occurred_at``, is taken from the event itself, the same on every delivery:

1. the millisecond timestamp in a UUIDv7 event id (:func:`event_time`), else
2. an event time the consumer supplies (``occurred_at=``, read from the message), else
3. :data:`FALLBACK_TIME` (1970-01-01), for ids that carry no time and consumers that supply
   none. Those rows live in the *timeless* partition (everything before 1970-01-02), which is
   never dropped: its rows are purged one by one, exactly as on the plain table.

The table is then unique on ``(event_id, consumer, occurred_at)``; because ``occurred_at`` is a
function of the event, that is as strong as ``(consumer, event_id)``. A default partition
catches rows that no range partition covers (late events whose partition was dropped, producer
clocks far ahead), so an insert never fails for want of a partition; it is purged row by row
too, and stays small, so creating a partition (which scans it) stays cheap.

The conversion is in place: the table keeps its name, so the ORM, the admin and the purge keep
working. ``try_reserve`` must add ``occurred_at`` to its insert and its conflict target when
``IDEMPOTENCY["EVENT_PARTITIONS"]`` is set; :func:`event_insert` gives it both.

Maintenance (:func:`maintain`, run by the purge task and ``idempotency_partitions maintain``)
creates partitions ahead of time and drops a partition with ``DROP TABLE`` once its range ended
``EVENT_TTL`` ago and none of its rows is still live. Everything here runs on PostgreSQL only
and raises :class:`~django.core.exceptions.ImproperlyConfigured` elsewhere.

Why this module is long: the partitioned layout's DDL (convert, create ahead, drop expired) is
written out per interval with the checks that guard it, so the whole life of a partition reads
in one place.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.apps import apps
from django.core.exceptions import ImproperlyConfigured
from django.db import OperationalError, connections, transaction
from django.db.backends.utils import CursorWrapper
from django.db.models import Model

from django_idempotency.conf import PARTITION_INTERVALS, conf
from django_idempotency.retention.reports import MaintenanceResult, PurgeResult

PARTITION_COLUMN = "occurred_at"
"""The partition key column added by :func:`convert`."""
FALLBACK_TIME = datetime(1970, 1, 1, tzinfo=UTC)
"""The partition key of an event whose id carries no time and whose consumer supplies none."""
TIMELESS_END = datetime(1970, 1, 2, tzinfo=UTC)
"""The upper bound of the timeless partition, which starts at ``MINVALUE``."""
AHEAD = {"day": 7, "month": 2}
"""How many partitions beyond the current one :func:`ensure_partitions` keeps ready."""
MAX_AHEAD = {"day": 366, "month": 24}
"""The most partitions that may be asked for ahead: a year of days, two years of months. They
are there for producers whose clocks run ahead; far more did not fit one transaction (ten years
of days ran out of the server's lock table, "out of shared memory") or ran past the year 9999
(an ``OverflowError``)."""
LOCK_TIMEOUT = "2s"
"""How long maintenance DDL waits for a lock before giving up until the next run."""
SQL_FUNCTION = "django_idempotency_event_time"

_UUID7 = r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-7[0-9a-fA-F]{3}-[89abAB][0-9a-fA-F]{3}-[0-9a-fA-F]{12}"
_UUID7_RE = re.compile(_UUID7)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_LOCK_NOT_AVAILABLE = "55P03"

# The same rule as event_time(), in SQL, for rows copied by convert().
_FUNCTION_SQL = f"""
CREATE OR REPLACE FUNCTION {SQL_FUNCTION}(event_id text, fallback timestamptz)
RETURNS timestamptz LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $fn$
  SELECT CASE
    WHEN event_id ~ '^{_UUID7}$'
    THEN timestamptz 'epoch'
      + ('x' || lpad(translate(left(event_id, 13), '-', ''), 16, '0'))::bit(64)::bigint
        * interval '1 millisecond'
    ELSE fallback
  END
$fn$
"""


# --- the partition key -------------------------------------------------------------------


def event_time(event_id: str | uuid.UUID) -> datetime | None:
    """The time carried by a UUIDv7 event id in canonical form, or None for any other id.

    Only the canonical hyphenated form counts (either case), so Python and the SQL function
    used by :func:`convert` agree on every string.
    """
    text = str(event_id)
    if not _UUID7_RE.fullmatch(text):
        return None
    milliseconds = int(text[:8] + text[9:13], 16)
    return _EPOCH + timedelta(milliseconds=milliseconds)


def partition_time(event_id: str | uuid.UUID, occurred_at: datetime | None = None) -> datetime:
    """The partition key of an event: its UUIDv7 time, else ``occurred_at``, else 1970.

    The id wins over ``occurred_at`` because it cannot differ between deliveries. An
    ``occurred_at`` must come from the message (never the time of processing) and must be
    timezone-aware.
    """
    from_id = event_time(event_id)
    if from_id is not None:
        return from_id
    if occurred_at is None:
        return FALLBACK_TIME
    if occurred_at.tzinfo is None or occurred_at.utcoffset() is None:
        raise ValueError(f"occurred_at must be timezone-aware, not {occurred_at!r}.")
    return occurred_at.astimezone(UTC)


@dataclass(frozen=True)
class EventInsert:
    """What ``try_reserve`` adds to its ``INSERT`` for the configured layout."""

    columns: tuple[str, ...]
    """Extra columns to insert: none, or ``("occurred_at",)``."""
    values: tuple[datetime, ...]
    conflict_target: tuple[str, ...]
    """The ``ON CONFLICT (...)`` columns: the unique constraint of the active layout."""


def event_insert(event_id: str | uuid.UUID, occurred_at: datetime | None = None) -> EventInsert:
    """The partition column, its value and the conflict target for one reservation.

    Reads ``IDEMPOTENCY["EVENT_PARTITIONS"]`` only; it never queries the database.
    """
    if conf.EVENT_PARTITIONS is None:
        return EventInsert((), (), ("consumer", "event_id"))
    return EventInsert(
        (PARTITION_COLUMN,),
        (partition_time(event_id, occurred_at),),
        ("consumer", "event_id", PARTITION_COLUMN),
    )


# --- what is there -----------------------------------------------------------------------


@dataclass(frozen=True)
class Partition:
    name: str
    start: datetime | None
    """Inclusive lower bound; None for the default and the timeless partition (MINVALUE)."""
    end: datetime | None
    """Exclusive upper bound; None for the default partition."""
    approx_rows: int

    @property
    def is_default(self) -> bool:
        return self.start is None and self.end is None

    @property
    def is_range(self) -> bool:
        """A partition of one day or month: created ahead, dropped when expired."""
        return self.start is not None and self.end is not None


def _processed_event() -> type[Model]:
    """The ``ProcessedEvent`` model, from the app registry: this module is imported by
    :mod:`django_idempotency.managers`, which the models import, so it imports no model."""
    return apps.get_model("django_idempotency", "ProcessedEvent")


def _table() -> str:
    return _processed_event()._meta.db_table


def require_postgresql(alias: str) -> None:
    """Raise ImproperlyConfigured unless ``alias`` is a PostgreSQL database."""
    vendor = connections[alias].vendor
    if vendor != "postgresql":
        raise ImproperlyConfigured(
            f"The partitioned ProcessedEvent layout needs PostgreSQL; the database {alias!r} "
            f"is {vendor}. Keep the plain table: idempotency_purge deletes expired rows in "
            "batches on every database."
        )


def is_partitioned(alias: str) -> bool:
    """Whether ``ProcessedEvent`` is range-partitioned on ``alias`` (False off PostgreSQL)."""
    connection = connections[alias]
    if connection.vendor != "postgresql":
        return False
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_partitioned_table WHERE partrelid = to_regclass(%s))",
            [connection.ops.quote_name(_table())],
        )
        return bool(cursor.fetchone()[0])


def partitions(alias: str) -> list[Partition]:
    """The partitions, oldest first, the default partition last (empty for a plain table)."""
    require_postgresql(alias)
    connection = connections[alias]
    with connection.cursor() as cursor:
        cursor.execute(
            r"""
            SELECT c.relname,
                   (regexp_match(b.bound, 'FROM \(''([^'']+)''\)'))[1]::timestamptz,
                   (regexp_match(b.bound, 'TO \(''([^'']+)''\)'))[1]::timestamptz,
                   GREATEST(c.reltuples, 0)::bigint
            FROM pg_inherits i
            JOIN pg_class c ON c.oid = i.inhrelid
            CROSS JOIN LATERAL (SELECT pg_get_expr(c.relpartbound, c.oid) AS bound) b
            WHERE i.inhparent = to_regclass(%s)
            ORDER BY 2 NULLS LAST, 1
            """,
            [connection.ops.quote_name(_table())],
        )
        return [Partition(name, start, end, int(rows)) for name, start, end, rows in cursor]


def default_partition(alias: str) -> str | None:
    """The name of the default partition, or None (plain table, or none was made)."""
    for partition in partitions(alias):
        if partition.is_default:
            return partition.name
    return None


def row_purged_partitions(alias: str) -> list[str]:
    """The partitions whose expired rows are deleted one by one: timeless and default."""
    return [p.name for p in partitions(alias) if not p.is_range]


def database_now(alias: str) -> datetime:
    """The database clock (``statement_timestamp()``)."""
    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT statement_timestamp()")
        value: datetime = cursor.fetchone()[0]
        return value


# --- interval arithmetic -----------------------------------------------------------------


def _interval(value: str | None) -> str:
    interval = value or conf.EVENT_PARTITIONS
    if interval is None:
        raise ImproperlyConfigured(
            'Set IDEMPOTENCY["EVENT_PARTITIONS"] to "day" or "month" (or pass --interval): '
            "it says how wide a partition is, and try_reserve reads it to add the partition key."
        )
    if interval not in PARTITION_INTERVALS:
        raise ImproperlyConfigured(f"The interval must be 'day' or 'month', not {interval!r}.")
    return interval


def floor(moment: datetime, interval: str) -> datetime:
    """The start of the day or month (UTC) that holds ``moment``."""
    moment = moment.astimezone(UTC)
    if interval == "day":
        return moment.replace(hour=0, minute=0, second=0, microsecond=0)
    return moment.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def next_bound(moment: datetime, interval: str) -> datetime:
    """The start of the day or month after the one that holds ``moment``."""
    start = floor(moment, interval)
    if interval == "day":
        return start + timedelta(days=1)
    return (start + timedelta(days=32)).replace(day=1)


def partition_name(start: datetime) -> str:
    return f"{_table()}_p{start:%Y%m%d}"


def _literal(moment: datetime) -> str:
    return f"'{moment.astimezone(UTC).isoformat()}'"


def _lock_timeout(cursor: CursorWrapper, timeout: str) -> None:
    if not re.fullmatch(r"\d+(ms|s|min)?", timeout):
        raise ValueError(f"lock_timeout must look like '2s' or '500ms', not {timeout!r}.")
    cursor.execute(f"SET LOCAL lock_timeout = '{timeout}'")


def _lock_not_available(exc: OperationalError) -> bool:
    return getattr(exc.__cause__, "sqlstate", None) == _LOCK_NOT_AVAILABLE


# --- converting ---------------------------------------------------------------------------


def convert(
    alias: str,
    interval: str | None = None,
    ahead: int | None = None,
    now: datetime | None = None,
    lock_timeout: str = "10s",
) -> list[str]:
    """Turn the plain ``ProcessedEvent`` table into the partitioned layout, in place.

    One transaction: it takes an ``ACCESS EXCLUSIVE`` lock (consumers wait meanwhile), builds
    the partitioned table with partitions from ``EVENT_TTL`` ago to ``ahead`` intervals from
    now plus a default partition, copies every row with its partition key computed from the
    event id in SQL, and swaps the tables. Returns the partitions it created.
    """

    require_postgresql(alias)
    width = _interval(interval)
    connection = connections[alias]
    q = connection.ops.quote_name
    meta = _processed_event()._meta
    table, new = meta.db_table, f"{meta.db_table}__partitioned"
    pk = meta.pk.column if meta.pk else "id"
    columns = [field.column for field in meta.concrete_fields]
    unique = _unique_constraint_name()
    created: list[str] = []
    with transaction.atomic(using=alias), connection.cursor() as cursor:
        _lock_timeout(cursor, lock_timeout)
        cursor.execute(f"LOCK TABLE {q(table)} IN ACCESS EXCLUSIVE MODE")
        if is_partitioned(alias):
            raise ImproperlyConfigured(f"{table} is partitioned already.")
        moment = now or database_now(alias)
        cursor.execute(_FUNCTION_SQL)
        cursor.execute(
            f"CREATE TABLE {q(new)} ("
            f"LIKE {q(table)} INCLUDING DEFAULTS, "
            f"{q(PARTITION_COLUMN)} timestamptz NOT NULL, "
            f"CONSTRAINT {q(new + '_pkey')} PRIMARY KEY ({q(pk)}, {q(PARTITION_COLUMN)}), "
            f"CONSTRAINT {q(unique + '__p')} UNIQUE "
            f"({q('event_id')}, {q('consumer')}, {q(PARTITION_COLUMN)})"
            f") PARTITION BY RANGE ({q(PARTITION_COLUMN)})"
        )
        for index in meta.indexes:
            fields = ", ".join(q(_column(name)) for name in index.fields)
            cursor.execute(f"CREATE INDEX {q(str(index.name) + '__p')} ON {q(new)} ({fields})")
        # A sequence of its own (an identity column cannot be partitioned before PostgreSQL
        # 17) that goes on from where the old one stood.
        cursor.execute("SELECT nextval(pg_get_serial_sequence(%s, %s))", [q(table), pk])
        next_id = cursor.fetchone()[0]
        sequence = f"{table}_{pk}_seq"
        cursor.execute(f"CREATE SEQUENCE {q(sequence + '__p')} OWNED BY {q(new)}.{q(pk)}")
        cursor.execute("SELECT setval(%s, %s, false)", [q(sequence + "__p"), next_id])
        cursor.execute(
            f"ALTER TABLE {q(new)} ALTER COLUMN {q(pk)} "
            f"SET DEFAULT nextval('{q(sequence + '__p')}'::regclass)"
        )
        cursor.execute(f"CREATE TABLE {q(table + '_default')} PARTITION OF {q(new)} DEFAULT")
        cursor.execute(
            f"CREATE TABLE {q(table + '_timeless')} PARTITION OF {q(new)} "
            f"FOR VALUES FROM (MINVALUE) TO ({_literal(TIMELESS_END)})"
        )
        start = floor(moment - conf.EVENT_TTL, width)
        end = _horizon(moment, width, ahead)
        while start < end:
            upper = next_bound(start, width)
            name = partition_name(start)
            cursor.execute(
                f"CREATE TABLE {q(name)} PARTITION OF {q(new)} "
                f"FOR VALUES FROM ({_literal(start)}) TO ({_literal(upper)})"
            )
            created.append(name)
            start = upper
        column_list = ", ".join(q(column) for column in columns)
        cursor.execute(
            f"INSERT INTO {q(new)} ({column_list}, {q(PARTITION_COLUMN)}) "
            f"SELECT {column_list}, {SQL_FUNCTION}({q('event_id')}, {_literal(FALLBACK_TIME)}) "
            f"FROM {q(table)}"
        )
        cursor.execute(f"DROP TABLE {q(table)}")
        cursor.execute(f"ALTER TABLE {q(new)} RENAME TO {q(table)}")
        cursor.execute(
            f"ALTER TABLE {q(table)} RENAME CONSTRAINT {q(new + '_pkey')} TO {q(table + '_pkey')}"
        )
        cursor.execute(
            f"ALTER TABLE {q(table)} RENAME CONSTRAINT {q(unique + '__p')} TO {q(unique)}"
        )
        for index in meta.indexes:
            cursor.execute(f"ALTER INDEX {q(str(index.name) + '__p')} RENAME TO {q(index.name)}")
        cursor.execute(f"ALTER SEQUENCE {q(sequence + '__p')} RENAME TO {q(sequence)}")
    return created


def revert(alias: str, lock_timeout: str = "10s") -> int:
    """Turn the partitioned layout back into the plain table the migrations describe.

    One transaction under an ``ACCESS EXCLUSIVE`` lock. If the same (consumer, event id) was
    stored under two partition keys, the row that expires last is kept. Returns the rows copied.
    """

    require_postgresql(alias)
    connection = connections[alias]
    q = connection.ops.quote_name
    meta = _processed_event()._meta
    table, old = meta.db_table, f"{meta.db_table}__partitioned"
    pk = meta.pk.column if meta.pk else "id"
    unique = _unique_constraint_name()
    sequence = f"{table}_{pk}_seq"
    columns = ", ".join(q(field.column) for field in meta.concrete_fields)
    with transaction.atomic(using=alias), connection.cursor() as cursor:
        _lock_timeout(cursor, lock_timeout)
        cursor.execute(f"LOCK TABLE {q(table)} IN ACCESS EXCLUSIVE MODE")
        if not is_partitioned(alias):
            raise ImproperlyConfigured(f"{table} is not partitioned.")
        cursor.execute(f"ALTER TABLE {q(table)} RENAME TO {q(old)}")
        cursor.execute(
            f"ALTER TABLE {q(old)} RENAME CONSTRAINT {q(table + '_pkey')} TO {q(old + '_pkey')}"
        )
        cursor.execute(
            f"ALTER TABLE {q(old)} RENAME CONSTRAINT {q(unique)} TO {q(unique + '__p')}"
        )
        for index in meta.indexes:
            cursor.execute(f"ALTER INDEX {q(index.name)} RENAME TO {q(str(index.name) + '__p')}")
        cursor.execute(f"ALTER SEQUENCE {q(sequence)} RENAME TO {q(sequence + '__p')}")
        cursor.execute("SELECT nextval(%s)", [q(sequence + "__p")])
        next_id = cursor.fetchone()[0]
        with connection.schema_editor(atomic=False) as editor:
            editor.create_model(_processed_event())
        cursor.execute(
            f"INSERT INTO {q(table)} ({columns}) "
            f"SELECT DISTINCT ON ({q('consumer')}, {q('event_id')}) {columns} FROM {q(old)} "
            f"ORDER BY {q('consumer')}, {q('event_id')}, {q('expires_at')} DESC"
        )
        copied = cursor.rowcount
        cursor.execute(
            "SELECT setval(pg_get_serial_sequence(%s, %s), %s, false)", [q(table), pk, next_id]
        )
        cursor.execute(f"DROP TABLE {q(old)}")
        cursor.execute(f"DROP FUNCTION IF EXISTS {SQL_FUNCTION}(text, timestamptz)")
    return int(copied)


def _column(field_name: str) -> str:
    from django.db.models import Field

    field = _processed_event()._meta.get_field(field_name)
    if not isinstance(field, Field) or field.column is None:
        raise ImproperlyConfigured(f"ProcessedEvent.{field_name} is not a column.")
    return field.column


def _unique_constraint_name() -> str:
    from django.db.models import UniqueConstraint

    for constraint in _processed_event()._meta.constraints:
        if isinstance(constraint, UniqueConstraint) and set(constraint.fields) == {
            "consumer",
            "event_id",
        }:
            return str(constraint.name)
    raise ImproperlyConfigured("ProcessedEvent has no unique constraint on (consumer, event_id).")


def _horizon(moment: datetime, interval: str, ahead: int | None) -> datetime:
    """The upper bound the partitions must reach: ``ahead`` intervals past the current one."""
    count = AHEAD[interval] if ahead is None else ahead
    if not 0 <= count <= MAX_AHEAD[interval]:
        raise ValueError(
            f"ahead must be from 0 to {MAX_AHEAD[interval]} partitions of a {interval}, "
            f"not {count}."
        )
    end = next_bound(moment, interval)
    for _ in range(count):
        end = next_bound(end, interval)
    return end


# --- maintenance --------------------------------------------------------------------------


def ensure_partitions(
    alias: str,
    interval: str | None = None,
    ahead: int | None = None,
    now: datetime | None = None,
    since: datetime | None = None,
    dry_run: bool = False,
    lock_timeout: str = LOCK_TIMEOUT,
) -> list[str]:
    """Create the partitions missing between the newest one (or ``since``) and the horizon.

    Each partition is created as a plain table and attached (``ATTACH PARTITION`` needs only a
    ``SHARE UPDATE EXCLUSIVE`` lock on the parent, so consumers keep inserting). Rows of its
    range that waited in the default partition are moved into it in the same transaction.
    Returns the partitions created (in a dry run: that would be created).
    """
    require_postgresql(alias)
    width = _interval(interval)
    moment = now or database_now(alias)
    existing = [p for p in partitions(alias) if p.is_range]
    if not existing and not is_partitioned(alias):
        raise ImproperlyConfigured(
            f"{_table()} is not partitioned; run `manage.py idempotency_partitions convert` first."
        )
    horizon = _horizon(moment, width, ahead)
    oldest_useful = floor(moment - conf.EVENT_TTL, width)
    if since is not None:
        start = floor(since, width)
    elif existing and existing[-1].end is not None:
        # After a long pause, do not fill years of gap: the default partition holds it.
        start = max(existing[-1].end, oldest_useful)
    else:
        start = floor(moment, width)
    taken = [(p.start, p.end) for p in existing if p.start is not None and p.end is not None]
    created: list[str] = []
    while start < horizon:
        upper = next_bound(start, width)
        if not any(lo < upper and start < hi for lo, hi in taken):
            name = partition_name(start)
            if not dry_run:
                try:
                    if not _attach_partition(alias, name, start, upper, lock_timeout):
                        start = upper
                        continue  # another maintenance run made it meanwhile
                except OperationalError as exc:
                    if not _lock_not_available(exc):
                        raise
                    break  # busy: the next run goes on from here
            created.append(name)
        start = upper
    return created


def _exists(cursor: CursorWrapper, name: str, quote: Callable[[str], str]) -> bool:
    cursor.execute("SELECT to_regclass(%s) IS NOT NULL", [quote(name)])
    return bool(cursor.fetchone()[0])


def _attach_partition(
    alias: str, name: str, start: datetime, end: datetime, lock_timeout: str
) -> bool:
    connection = connections[alias]
    q = connection.ops.quote_name
    table = _table()
    default = default_partition(alias)
    key = q(PARTITION_COLUMN)
    bounds = f"{key} >= {_literal(start)} AND {key} < {_literal(end)}"
    with transaction.atomic(using=alias), connection.cursor() as cursor:
        _lock_timeout(cursor, lock_timeout)
        # Parent first, then the default partition: the order inserts take them in.
        cursor.execute(f"LOCK TABLE ONLY {q(table)} IN SHARE UPDATE EXCLUSIVE MODE")
        if default is not None:
            cursor.execute(f"LOCK TABLE {q(default)} IN ACCESS EXCLUSIVE MODE")
        if _exists(cursor, name, q):
            return False
        cursor.execute(f"CREATE TABLE {q(name)} (LIKE {q(table)} INCLUDING DEFAULTS)")
        if default is not None:
            cursor.execute(
                f"WITH moved AS (DELETE FROM {q(default)} WHERE {bounds} RETURNING *) "
                f"INSERT INTO {q(name)} SELECT * FROM moved"
            )
        # A matching CHECK lets ATTACH skip scanning the new table.
        check = f"{name[:50]}_bounds"
        cursor.execute(f"ALTER TABLE {q(name)} ADD CONSTRAINT {q(check)} CHECK ({bounds})")
        cursor.execute(
            f"ALTER TABLE {q(table)} ATTACH PARTITION {q(name)} "
            f"FOR VALUES FROM ({_literal(start)}) TO ({_literal(end)})"
        )
        cursor.execute(f"ALTER TABLE {q(name)} DROP CONSTRAINT {q(check)}")
    return True


def drop_expired_partitions(
    alias: str,
    now: datetime | None = None,
    dry_run: bool = False,
    lock_timeout: str = LOCK_TIMEOUT,
) -> MaintenanceResult:
    """``DROP TABLE`` each partition whose range ended ``EVENT_TTL`` ago and holds no live row.

    A partition that still holds a row with ``expires_at`` in the future (an event processed
    long after it occurred, or reserved with a longer ``ttl``) is kept until that row expires.
    The check is repeated under an ``ACCESS EXCLUSIVE`` lock on the parent (held for
    milliseconds, waited for at most ``lock_timeout``), so a late insert cannot slip in between.
    """
    require_postgresql(alias)
    connection = connections[alias]
    q = connection.ops.quote_name
    moment = now or database_now(alias)
    cutoff = moment - conf.EVENT_TTL
    dropped: list[str] = []
    dropped_rows = 0
    kept: list[tuple[str, str]] = []
    for partition in partitions(alias):
        if not partition.is_range or partition.end is None or partition.end > cutoff:
            continue
        live_until = _live_until(alias, partition.name)
        if live_until is not None and live_until > moment:
            kept.append((partition.name, f"holds live rows until {live_until.isoformat()}"))
            continue
        if dry_run:
            dropped.append(partition.name)
            dropped_rows += partition.approx_rows
            continue
        try:
            with transaction.atomic(using=alias), connection.cursor() as cursor:
                _lock_timeout(cursor, lock_timeout)
                cursor.execute(f"LOCK TABLE ONLY {q(_table())} IN ACCESS EXCLUSIVE MODE")
                if not _exists(cursor, partition.name, q):
                    continue  # another maintenance run dropped it meanwhile
                live_until = _live_until(alias, partition.name)
                if live_until is not None and live_until > moment:
                    kept.append(
                        (partition.name, f"holds live rows until {live_until.isoformat()}")
                    )
                    continue
                cursor.execute(f"DROP TABLE {q(partition.name)}")
        except OperationalError as exc:
            if not _lock_not_available(exc):
                raise
            kept.append((partition.name, f"busy: no lock within {lock_timeout}, next run"))
            continue
        dropped.append(partition.name)
        dropped_rows += partition.approx_rows
    return MaintenanceResult(
        dropped=tuple(dropped), dropped_rows=dropped_rows, kept=tuple(kept), dry_run=dry_run
    )


def _live_until(alias: str, partition: str) -> datetime | None:
    connection = connections[alias]
    with connection.cursor() as cursor:
        q = connection.ops.quote_name
        cursor.execute(f"SELECT max({q('expires_at')}) FROM {q(partition)}")
        value: datetime | None = cursor.fetchone()[0]
        return value


def maintain(
    alias: str,
    interval: str | None = None,
    now: datetime | None = None,
    ahead: int | None = None,
    dry_run: bool = False,
    lock_timeout: str = LOCK_TIMEOUT,
) -> MaintenanceResult:
    """Create partitions ahead, then drop expired ones; what the purge runs on this layout."""
    created = ensure_partitions(
        alias, interval, ahead=ahead, now=now, dry_run=dry_run, lock_timeout=lock_timeout
    )
    dropped = drop_expired_partitions(alias, now=now, dry_run=dry_run, lock_timeout=lock_timeout)
    return MaintenanceResult(
        created=tuple(created),
        dropped=dropped.dropped,
        dropped_rows=dropped.dropped_rows,
        kept=dropped.kept,
        dry_run=dry_run,
    )


def purge_row_partitions(
    alias: str,
    batch_size: int,
    max_seconds: float,
    dry_run: bool = False,
) -> PurgeResult:
    """Delete the expired rows of the timeless and the default partition, in batches.

    Each batch is one statement (``DELETE ... WHERE id IN (SELECT ... FOR UPDATE SKIP
    LOCKED)``) in its own transaction. Range partitions are left to
    :func:`drop_expired_partitions`.
    """

    label = _processed_event()._meta.label
    started = time.monotonic()
    connection = connections[alias]
    q = connection.ops.quote_name
    expired = f"{q('expires_at')} < statement_timestamp()"
    names = row_purged_partitions(alias)
    if dry_run:
        count = 0
        with connection.cursor() as cursor:
            for name in names:
                cursor.execute(f"SELECT count(*) FROM {q(name)} WHERE {expired}")
                count += int(cursor.fetchone()[0])
        return PurgeResult(
            label, count, -(-count // batch_size), time.monotonic() - started, True, True
        )
    deleted = batches = 0
    finished = True
    for name in names:
        while True:
            with transaction.atomic(using=alias), connection.cursor() as cursor:
                cursor.execute(
                    f"DELETE FROM {q(name)} WHERE {q('id')} IN ("
                    f"SELECT {q('id')} FROM {q(name)} WHERE {expired} "
                    f"ORDER BY {q('expires_at')} LIMIT %s FOR UPDATE SKIP LOCKED)",
                    [batch_size],
                )
                removed = cursor.rowcount
            if removed:
                batches += 1
                deleted += removed
            finished = removed < batch_size
            if finished or (max_seconds and time.monotonic() - started >= max_seconds):
                break
        if not finished:
            break
    return PurgeResult(label, deleted, batches, time.monotonic() - started, finished=finished)
