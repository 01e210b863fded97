"""PostgreSQL only: storing a response as a PL/pgSQL function, so its plan is cached per session.

Sent as SQL text, the ``UPDATE`` that stores a response was parsed and planned again on every
first execution: the function saves about 40 µs of it (``bench/storecost.py``). As for the claim
(``0005_claim_function``), PL/pgSQL keeps the plan for the life of the server session, which
also holds behind PgBouncer in transaction pooling mode.

``django_idempotency_complete_v1`` stores the response only while ``p_token`` still owns the
``in_progress`` record. When it does not (a lease ran out and a retry took the record over), it
raises SQLSTATE ``P0002`` (``no_data_found``), which the caller turns into
:class:`~django_idempotency.exceptions.StaleClaim`. Raising, rather than answering false, is what
lets the caller send ``COMMIT`` in the same round trip (:meth:`~django_idempotency.http.store.
RecordStore.complete`): a lost claim aborts the transaction before that ``COMMIT`` runs, so the
view's writes can never commit without their response. The SQL is frozen here on purpose:
a later change gets a new function (``_v2``) in a new migration, so that old and new code can run
side by side during a deploy.
"""

from django.db import migrations

TABLE = "django_idempotency_idempotencyrecord"

CREATE = f"""
CREATE OR REPLACE FUNCTION django_idempotency_complete_v1(
    p_id bigint, p_token uuid, p_status integer, p_headers jsonb, p_body bytea
) RETURNS void LANGUAGE plpgsql VOLATILE AS $function$
BEGIN
    UPDATE {TABLE} SET state = 'completed', locked_until = NULL, response_status = p_status,
        response_headers = p_headers, response_body = p_body,
        completed_at = statement_timestamp()
    WHERE id = p_id AND token = p_token AND state = 'in_progress';
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'no_data_found',
            MESSAGE = 'idempotency record ' || p_id || ' is no longer held by token ' || p_token;
    END IF;
END
$function$
"""

DROP = (
    "DROP FUNCTION IF EXISTS django_idempotency_complete_v1(bigint, uuid, integer, jsonb, bytea)"
)


def create_function(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE)


def drop_function(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP)


class Migration(migrations.Migration):
    dependencies = [("django_idempotency", "0006_event_functions")]

    operations = [migrations.RunPython(create_function, drop_function, elidable=False)]
