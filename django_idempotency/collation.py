"""Byte-for-byte comparison of keys, owners, event ids and consumer names on MySQL and MariaDB.

Their default ``utf8mb4`` collations ignore case (and accents, and trailing spaces), so the
unique constraints would take ``Order-7f3A`` and ``order-7f3a``, or ``evt_1NqQaB`` and
``evt_1NqQAb``, for one key: a different request replays the first one's response and a
different event is skipped as a duplicate. Migration ``0002_binary_collation`` gives these
columns the binary collation; the system check ``django_idempotency.E010`` finds a column whose
collation was changed back. PostgreSQL and SQLite already compare bytes (``=`` on ``text`` is
case sensitive under their default collations), so both are no-ops there.
"""

from __future__ import annotations

from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper

__all__ = ["BINARY_COLLATION", "IDENTITY_COLUMNS", "non_binary_columns", "set_collation"]

BINARY_COLLATION = "utf8mb4_bin"

IDENTITY_COLUMNS: dict[str, tuple[str, ...]] = {
    "django_idempotency_idempotencyrecord": ("owner", "key"),
    "django_idempotency_processedevent": ("consumer", "event_id"),
    "django_idempotency_eventdelivery": ("consumer", "event_id"),
}
"""Table: the columns that identify a row and must compare byte for byte. All are
``varchar(255) NOT NULL``."""


def set_collation(connection: BaseDatabaseWrapper, collation: str | None) -> None:
    """Give the identity columns ``collation`` (None: the table's default); MySQL/MariaDB only."""
    if connection.vendor != "mysql":
        return
    quote = connection.ops.quote_name
    clause = f" COLLATE {collation}" if collation else ""
    with connection.cursor() as cursor:
        for table, columns in IDENTITY_COLUMNS.items():
            changes = ", ".join(
                f"MODIFY {quote(column)} varchar(255) CHARACTER SET utf8mb4{clause} NOT NULL"
                for column in columns
            )
            cursor.execute(f"ALTER TABLE {quote(table)} {changes}")


def non_binary_columns(connection: BaseDatabaseWrapper) -> list[tuple[str, str, Any]]:
    """``(table, column, collation)`` of each identity column that does not compare bytes.

    Empty on other databases, and for tables that do not exist yet (not migrated).
    """
    if connection.vendor != "mysql":
        return []
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT table_name, column_name, collation_name FROM information_schema.columns "
            "WHERE table_schema = DATABASE() AND table_name IN %s",
            [tuple(IDENTITY_COLUMNS)],
        )
        rows = cursor.fetchall()
    return sorted(
        (str(table), str(column), collation)
        for table, column, collation in rows
        if str(column) in IDENTITY_COLUMNS.get(str(table), ())
        and not str(collation or "").endswith("_bin")
    )
