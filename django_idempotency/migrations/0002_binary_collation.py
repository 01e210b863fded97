"""Keys, owners, event ids and consumer names compare byte for byte on MySQL and MariaDB.

A no-op on PostgreSQL and SQLite (see :mod:`django_idempotency.collation`). ``utf8mb4_bin``
still ignores trailing spaces; ``0009_nopad_collation`` replaces it with a NO PAD collation.
The columns are listed here as they were when this migration was written.
"""

from typing import Any

from django.db import migrations


def _columns() -> Any:
    from django_idempotency.collation import Column

    return {
        "django_idempotency_idempotencyrecord": (Column("owner"), Column("key")),
        "django_idempotency_processedevent": (Column("consumer"), Column("event_id")),
        "django_idempotency_eventdelivery": (Column("consumer"), Column("event_id")),
    }


def to_binary(apps: Any, schema_editor: Any) -> None:
    from django_idempotency.collation import set_collation

    set_collation(schema_editor.connection, "utf8mb4_bin", _columns())


def to_default(apps: Any, schema_editor: Any) -> None:
    from django_idempotency.collation import set_collation

    set_collation(schema_editor.connection, None, _columns())


class Migration(migrations.Migration):
    dependencies = [("django_idempotency", "0001_initial")]

    operations = [migrations.RunPython(to_binary, to_default, elidable=False)]
