"""PostgreSQL only: a consumer's reservation and its delivery count as PL/pgSQL functions.

Sent as SQL text, each statement was parsed and planned again on every event; for the count's
long upsert that was about 120 µs of about 600 (``bench/eventcost.py``). PL/pgSQL caches the
plans of a function's statements for the life of the server session, whichever client
transaction calls it, so this holds unchanged behind PgBouncer in transaction pooling mode, as
``0005_claim_function`` does for the HTTP claim. The reservation's short insert costs the same
either way; its function exists for a first delivery, whose look at the counter it adds to the
same call.

* ``django_idempotency_reserve_v1``: :func:`~django_idempotency.events.core.try_reserve`'s insert,
  and, for a delivery the broker marks as its first (``redelivered=False``), the look at the
  event's delivery counter that the skipped count would have made: a parked event is refused
  (the caller rolls the insert back), and the error an earlier failed delivery left is cleared
  in the same transaction.
* ``django_idempotency_count_v1``: the delivery count, counted only while the event is not
  processed, optionally committing without waiting on its WAL flush (``ASYNC_DELIVERY_COUNT``).

Both serve the default layout only: the partitioned one (``EVENT_PARTITIONS``) adds a partition
column to the key, and keeps sending its SQL. The SQL is frozen here on purpose: a later change
gets a new function (``_v2``) in a new migration, so that old and new code can run side by side
during a deploy.
"""

from django.db import migrations

EVENTS = "django_idempotency_processedevent"
DELIVERIES = "django_idempotency_eventdelivery"

RESERVE = f"""
CREATE OR REPLACE FUNCTION django_idempotency_reserve_v1(
    p_consumer text, p_event_id text, p_topic text, p_processed_at timestamptz,
    p_expires_at timestamptz, p_first_delivery boolean
) RETURNS text LANGUAGE plpgsql VOLATILE AS $function$
DECLARE
    v_parked boolean;
    v_failed boolean;
BEGIN
    INSERT INTO {EVENTS} (consumer, event_id, topic, processed_at, expires_at)
    VALUES (p_consumer, p_event_id, p_topic, p_processed_at, p_expires_at)
    ON CONFLICT (consumer, event_id) DO NOTHING;
    IF NOT FOUND THEN
        RETURN 'processed';
    END IF;
    IF p_first_delivery THEN
        -- Read after the insert, which waited for any delivery that held the event: a failed
        -- delivery records its error while holding it (events._fail_first_delivery).
        SELECT d.parked_at IS NOT NULL, d.last_error <> '' INTO v_parked, v_failed
        FROM {DELIVERIES} AS d WHERE d.consumer = p_consumer AND d.event_id = p_event_id;
        IF v_parked THEN
            RETURN 'parked';  -- the caller rolls the reservation back
        END IF;
        IF v_failed THEN
            UPDATE {DELIVERIES} SET last_error = ''
            WHERE consumer = p_consumer AND event_id = p_event_id;
        END IF;
    END IF;
    RETURN 'reserved';
END
$function$
"""

COUNT = f"""
CREATE OR REPLACE FUNCTION django_idempotency_count_v1(
    p_consumer text, p_event_id text, p_topic text, p_deliveries integer,
    p_delivered_at timestamptz, p_expires_at timestamptz, p_asynchronous boolean
) RETURNS TABLE (deliveries integer, parked boolean)
LANGUAGE plpgsql VOLATILE AS $function$
#variable_conflict use_column
BEGIN
    IF p_asynchronous THEN
        -- Local to the caller's autocommit statement: its commit skips the WAL flush wait.
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    RETURN QUERY
    INSERT INTO {DELIVERIES} AS d (consumer, event_id, topic, deliveries, first_delivered_at,
                                   last_delivered_at, last_error, expires_at)
    SELECT p_consumer, p_event_id, p_topic, p_deliveries, p_delivered_at, p_delivered_at, '',
           p_expires_at
    WHERE NOT EXISTS (
        SELECT 1 FROM {EVENTS} AS e WHERE e.consumer = p_consumer AND e.event_id = p_event_id
    )
    ON CONFLICT (consumer, event_id) DO UPDATE SET
        deliveries = d.deliveries + 1, last_delivered_at = EXCLUDED.last_delivered_at,
        expires_at = EXCLUDED.expires_at
    RETURNING d.deliveries::integer, d.parked_at IS NOT NULL;
END
$function$
"""

DROP = (
    "DROP FUNCTION IF EXISTS django_idempotency_reserve_v1("
    "text, text, text, timestamptz, timestamptz, boolean)",
    "DROP FUNCTION IF EXISTS django_idempotency_count_v1("
    "text, text, text, integer, timestamptz, timestamptz, boolean)",
)


def create_functions(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(RESERVE)
        schema_editor.execute(COUNT)


def drop_functions(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        for statement in DROP:
            schema_editor.execute(statement)


class Migration(migrations.Migration):
    dependencies = [("django_idempotency", "0005_claim_function")]

    operations = [migrations.RunPython(create_functions, drop_functions, elidable=False)]
