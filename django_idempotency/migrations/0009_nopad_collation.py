"""Identity columns compare trailing spaces too on MySQL and MariaDB: a NO PAD binary collation.

``utf8mb4_bin`` (migration ``0002``) is PAD SPACE, so ``order-42`` and ``order-42 `` were one
event id, one key, one consumer name; the outbox's event id and ordering key (which had the
table's default collation, case-insensitive) get it too, so a parked ``Order-7`` no longer holds
back ``order-7``. A no-op on PostgreSQL and SQLite (see :mod:`django_idempotency.collation`).

Going back to ``utf8mb4_bin`` fails with a duplicate-key error if two rows now differ only by
trailing spaces: delete one of them first.
"""

from typing import Any

from django.db import migrations


def _columns() -> tuple[Any, Any]:
    from django_idempotency.collation import Column

    identity = {
        "django_idempotency_idempotencyrecord": (Column("owner"), Column("key")),
        "django_idempotency_processedevent": (Column("consumer"), Column("event_id")),
        "django_idempotency_eventdelivery": (Column("consumer"), Column("event_id")),
    }
    outbox = {
        "django_idempotency_outboxentry": (Column("event_id"), Column("ordering_key", null=True)),
    }
    return identity, outbox


def to_nopad(apps: Any, schema_editor: Any) -> None:
    from django_idempotency.collation import binary_collation, set_collation

    connection = schema_editor.connection
    identity, outbox = _columns()
    set_collation(connection, binary_collation(connection), {**identity, **outbox})


def to_padded(apps: Any, schema_editor: Any) -> None:
    from django_idempotency.collation import set_collation

    identity, outbox = _columns()
    set_collation(schema_editor.connection, "utf8mb4_bin", identity)
    set_collation(schema_editor.connection, None, outbox)


class Migration(migrations.Migration):
    dependencies = [("django_idempotency", "0008_write_once")]

    operations = [migrations.RunPython(to_nopad, to_padded, elidable=False)]
