"""Byte-for-byte comparison of keys, owners, event ids, consumer names and ordering keys on
MySQL and MariaDB.

Their default ``utf8mb4`` collations ignore case (and accents, and trailing spaces), so the
unique constraints would take ``Order-7f3A`` and ``order-7f3a``, or ``evt_1NqQaB`` and
``evt_1NqQAb``, for one key: a different request replays the first one's response and a
different event is skipped as a duplicate. Migration ``0002_binary_collation`` gave these
columns ``utf8mb4_bin``. That is a PAD SPACE collation: it still compares ``order-42`` and
``order-42 `` as equal (trailing spaces are ignored), so a second event whose id only adds a
space was skipped, and an outbox key ``Order-7`` parked held back ``Order-7 ``. Migration
``0009_nopad_collation`` gives every identity column a NO PAD binary collation
(:func:`binary_collation`: ``utf8mb4_nopad_bin`` on MariaDB, ``utf8mb4_0900_bin`` on MySQL 8),
and the outbox's event id and ordering key too. The system check ``django_idempotency.E010``
finds a column whose collation was changed back, or is binary but pads.

PostgreSQL and SQLite already compare bytes (``=`` on ``text`` is case and space sensitive
under their default collations), so both are no-ops there.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from django.db.backends.base.base import BaseDatabaseWrapper

__all__ = [
    "BINARY_COLLATION",
    "IDENTITY_COLUMNS",
    "Column",
    "binary_collation",
    "compares_bytes",
    "non_binary_columns",
    "set_collation",
]

BINARY_COLLATION = "utf8mb4_nopad_bin"
"""The collation migration ``0009_nopad_collation`` gives the identity columns on MariaDB."""

MYSQL_BINARY_COLLATION = "utf8mb4_0900_bin"
"""Its MySQL 8 counterpart (MySQL has no ``utf8mb4_nopad_bin``; its ``0900`` ones are NO PAD)."""


class Column(NamedTuple):
    """An identity column: its name, and the type it is re-declared with to change collation."""

    name: str
    null: bool = False
    length: int = 255


IDENTITY_COLUMNS: dict[str, tuple[Column, ...]] = {
    "django_idempotency_idempotencyrecord": (Column("owner"), Column("key")),
    "django_idempotency_processedevent": (Column("consumer"), Column("event_id")),
    "django_idempotency_eventdelivery": (Column("consumer"), Column("event_id")),
    "django_idempotency_outboxentry": (Column("event_id"), Column("ordering_key", null=True)),
}
"""Table: the text columns that take part in a unique key or a lookup, and so must compare
byte for byte (the saga step names and ``OWNER`` values live in the consumer and owner
columns). All are ``varchar(255)``: with 4 bytes a character, a two-column unique key stays
within InnoDB's 3,072-byte index limit."""


def binary_collation(connection: BaseDatabaseWrapper) -> str:
    """The NO PAD binary collation of this server: MariaDB's, else MySQL 8's."""
    return (
        BINARY_COLLATION
        if getattr(connection, "mysql_is_mariadb", True)
        else MYSQL_BINARY_COLLATION
    )


def compares_bytes(collation: object) -> bool:
    """Whether a MySQL/MariaDB collation compares byte for byte: binary, and NO PAD.

    MariaDB names its NO PAD collations ``*_nopad_*``; MySQL 8's ``*_0900_*`` collations are NO
    PAD, its older ones (``utf8mb4_bin`` included) PAD SPACE.
    """
    name = str(collation or "")
    return name.endswith("_bin") and ("_nopad_" in name or "_0900_" in name)


def set_collation(
    connection: BaseDatabaseWrapper,
    collation: str | None,
    columns: dict[str, tuple[Column, ...]] | None = None,
) -> None:
    """Give ``columns`` (default: every identity column) ``collation`` (None: the table's
    default); MySQL/MariaDB only. InnoDB rebuilds each table's indexes on those columns, the
    unique keys included, in the same ``ALTER TABLE``.

    A migration passes the columns as they were at its time, so a later change of
    :data:`IDENTITY_COLUMNS` never reaches back into an older migration.
    """
    if connection.vendor != "mysql":
        return
    quote = connection.ops.quote_name
    clause = f" COLLATE {collation}" if collation else ""
    with connection.cursor() as cursor:
        for table, spec in (IDENTITY_COLUMNS if columns is None else columns).items():
            changes = ", ".join(
                f"MODIFY {quote(column.name)} varchar({column.length}) CHARACTER SET "
                f"utf8mb4{clause} {'NULL' if column.null else 'NOT NULL'}"
                for column in spec
            )
            cursor.execute(f"ALTER TABLE {quote(table)} {changes}")


PADDED_COLUMNS: dict[str, tuple[str, ...]] = {
    "django_idempotency_idempotencyrecord": ("owner", "key"),
    "django_idempotency_processedevent": ("consumer", "event_id"),
    "django_idempotency_eventdelivery": ("consumer", "event_id"),
}
"""The columns migration ``0002_binary_collation`` gave ``utf8mb4_bin`` (binary, PAD SPACE)."""


def _applied(connection: BaseDatabaseWrapper) -> set[str]:
    """The names of this app's migrations applied on ``connection``."""
    from django.db.migrations.recorder import MigrationRecorder

    recorder = MigrationRecorder(connection)
    if not recorder.has_table():
        return set()
    return {name for app, name in recorder.applied_migrations() if app == "django_idempotency"}


def non_binary_columns(connection: BaseDatabaseWrapper) -> list[tuple[str, str, Any]]:
    """``(table, column, collation)`` of each identity column that does not compare bytes: one
    whose collation ignores case, or a binary one that pads (``utf8mb4_bin``).

    Only what the applied migrations promise is asked for: before ``0009_nopad_collation`` a
    column is reported only if ``0002_binary_collation`` gave it ``utf8mb4_bin`` and it lost
    it. ``migrate`` runs this check before it migrates, so asking more would stop the very
    migration that fixes the column. Empty on other databases, and for tables that do not exist
    yet (not migrated).
    """
    if connection.vendor != "mysql":
        return []
    applied = _applied(connection)
    if any(name.endswith("_nopad_collation") for name in applied):
        wanted = {
            table: {column.name for column in spec} for table, spec in IDENTITY_COLUMNS.items()
        }
        fine = compares_bytes
    elif any(name.endswith("_binary_collation") for name in applied):
        wanted = {table: set(columns) for table, columns in PADDED_COLUMNS.items()}

        def fine(collation: object) -> bool:
            return str(collation or "").endswith("_bin")

    else:
        return []
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT table_name, column_name, collation_name FROM information_schema.columns "
            "WHERE table_schema = DATABASE() AND table_name IN %s",
            [tuple(wanted)],
        )
        rows = cursor.fetchall()
    return sorted(
        (str(table), str(column), collation)
        for table, column, collation in rows
        if str(column) in wanted.get(str(table), ()) and not fine(collation)
    )
