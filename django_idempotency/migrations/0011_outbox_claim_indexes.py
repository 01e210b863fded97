"""Two partial indexes for the relay's claim, on PostgreSQL and SQLite.

* ``idem_outbox_pending_idx``: the pending rows in id order, which the claim walks;
* ``idem_outbox_touched_idx``: per key, the unsent rows a relay has touched (leased, backing
  off, parked: :data:`django_idempotency.models.OUTBOX_TOUCHED`), the only rows that can hold
  back the rest of their key. In a backlog they are a handful, where the pending rows are the
  whole backlog, so the claim's per-candidate ``NOT EXISTS`` stays cheap whatever the
  statistics say (see :func:`django_idempotency.outbox.store.claim_transaction`).

They are not declared in the model's ``Meta``: MariaDB and MySQL have no partial index, and
Django would build them there as full indexes (and warn, ``models.W037``). On MariaDB the claim
probes ``idem_outbox_key_idx`` by key instead.

On a large outbox table, ``CREATE INDEX`` blocks writes to it while it builds; purge sent rows
first, or create the two indexes by hand with ``CREATE INDEX CONCURRENTLY`` (same names and
predicates) and then run the migration, which skips an index that exists.
"""

from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps

TABLE = "django_idempotency_outboxentry"
INDEXES = {
    "idem_outbox_pending_idx": "(id) WHERE state = 'pending'",
    "idem_outbox_touched_idx": (
        "(ordering_key, id) WHERE NOT (state = 'sent') "
        "AND (state = 'parked' OR available_at IS NOT NULL OR locked_until IS NOT NULL)"
    ),
}


def create(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor not in {"postgresql", "sqlite"}:
        return
    for name, definition in INDEXES.items():
        schema_editor.execute(f"CREATE INDEX IF NOT EXISTS {name} ON {TABLE} {definition}")


def drop(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor not in {"postgresql", "sqlite"}:
        return
    for name in INDEXES:
        schema_editor.execute(f"DROP INDEX IF EXISTS {name}")


class Migration(migrations.Migration):
    dependencies = [("django_idempotency", "0010_record_state_index")]

    operations = [migrations.RunPython(create, drop, elidable=False)]
