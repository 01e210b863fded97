"""Keys, owners, event ids and consumer names compare byte for byte on MySQL and MariaDB.

A no-op on PostgreSQL and SQLite (see :mod:`django_idempotency.collation`).
"""

from typing import Any

from django.db import migrations


def to_binary(apps: Any, schema_editor: Any) -> None:
    from django_idempotency.collation import BINARY_COLLATION, set_collation

    set_collation(schema_editor.connection, BINARY_COLLATION)


def to_default(apps: Any, schema_editor: Any) -> None:
    from django_idempotency.collation import set_collation

    set_collation(schema_editor.connection, None)


class Migration(migrations.Migration):
    dependencies = [("django_idempotency", "0001_initial")]

    operations = [migrations.RunPython(to_binary, to_default, elidable=False)]
