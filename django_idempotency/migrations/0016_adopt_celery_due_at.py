"""Delayed outbox messages (issue 36): the ``due_at`` column, and an index on ``available_at``.

* ``due_at``: when a message with a countdown or an eta is due. Celery gets it as the task's
  eta; for a transport without delayed delivery (Kafka, Dramatiq) the relay holds the message
  until then (``available_at``). A nullable column without a default: no table rewrite on
  PostgreSQL or MariaDB.
* ``idem_outbox_avail_idx``: the pending rows that wait for a time (a backoff, a held message,
  one whose commit was not seen yet), by that time. The relay reads it to find the messages
  whose countdown it must start itself (the producer died between its COMMIT and its
  ``on_commit`` hook) and to wake up when the next held message is due. On PostgreSQL and
  SQLite a partial index (``available_at IS NOT NULL``), so the ordinary message, written with
  none, costs its insert nothing; MariaDB and MySQL have no partial index, and get
  ``(state, available_at)``. Like the claim's indexes (migration 0011) it is not declared in the
  model's ``Meta``.

On a large outbox table, ``CREATE INDEX`` blocks writes while it builds: purge sent rows first,
or create the index by hand beforehand (``CREATE INDEX CONCURRENTLY`` on PostgreSQL, same name
and definition); the migration skips an index that exists.
"""

from django.db import migrations, models
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps

TABLE = "django_idempotency_outboxentry"
INDEX = "idem_outbox_avail_idx"
PARTIAL = "(available_at) WHERE state = 'pending' AND available_at IS NOT NULL"


def create(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    vendor = schema_editor.connection.vendor
    if vendor in {"postgresql", "sqlite"}:
        schema_editor.execute(f"CREATE INDEX IF NOT EXISTS {INDEX} ON {TABLE} {PARTIAL}")
        return
    with schema_editor.connection.cursor() as cursor:
        existing = schema_editor.connection.introspection.get_constraints(cursor, TABLE)
    if INDEX not in existing:
        schema_editor.execute(f"CREATE INDEX {INDEX} ON {TABLE} (state, available_at)")


def drop(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor in {"postgresql", "sqlite"}:
        schema_editor.execute(f"DROP INDEX IF EXISTS {INDEX}")
    else:
        schema_editor.execute(f"DROP INDEX {INDEX} ON {TABLE}")


class Migration(migrations.Migration):
    dependencies = [
        ("django_idempotency", "0015_data_protection"),
    ]

    operations = [
        migrations.AddField(
            model_name="outboxentry",
            name="due_at",
            field=models.DateTimeField(
                blank=True,
                help_text=(
                    "Not delivered before this time: the call's eta, or its countdown counted "
                    "from the commit. Celery gets it as the task's eta; other transports' "
                    "messages are held until then. Empty: at once."
                ),
                null=True,
                verbose_name="due",
            ),
        ),
        migrations.AlterField(
            model_name="outboxentry",
            name="available_at",
            field=models.DateTimeField(
                blank=True,
                help_text=(
                    "Not sent before this time (a backoff after a failure, or a delayed "
                    "message held until it is due); empty: at once."
                ),
                null=True,
                verbose_name="next attempt",
            ),
        ),
        # Not in a transaction of its own: MySQL refuses DDL in one (on PostgreSQL the whole
        # migration is one transaction anyway).
        migrations.RunPython(create, drop, elidable=False, atomic=False),
    ]
