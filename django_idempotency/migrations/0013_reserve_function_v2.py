"""PostgreSQL only: ``django_idempotency_reserve_v2``, a first delivery's reservation that is
right at every isolation level.

``django_idempotency_reserve_v1`` (``0006_event_functions``) reads a first delivery's counter
after its insert, which waits for any delivery that holds the event, so under ``READ COMMITTED``
the read sees what that delivery recorded: a parked event is refused, an error is cleared. Under
``REPEATABLE READ`` and ``SERIALIZABLE`` the read sees the transaction's snapshot instead, taken
before the wait (at the transaction's first statement): a counter that a failed delivery
created or parked while it held the event is not in it, and the parked event ran.

v2 is v1 with one step more at those two levels, before the read: an insert of the event's
counter, ``ON CONFLICT DO NOTHING``. It conflicts with any counter there is. A counter committed
after the snapshot (inserted, or updated: parked, its error recorded) makes PostgreSQL raise a
serialization failure (``40001``) rather than skip it, and the transaction rolls back with
nothing applied. A counter in the snapshot is the latest one, so the read that follows is right.
No counter: the insert makes one, which the function deletes again at once, so no row is left
that ``READ COMMITTED`` would not leave. Under ``READ COMMITTED`` (and ``READ UNCOMMITTED``,
which PostgreSQL runs as it) v2 does what v1 does, plus a look at ``transaction_isolation``.

v1 stays: code of the release before this one calls it during a deploy. The SQL is frozen here
on purpose, as in ``0006``: a later change gets ``_v3`` in a new migration.
"""

from django.db import migrations

EVENTS = "django_idempotency_processedevent"
DELIVERIES = "django_idempotency_eventdelivery"

RESERVE = f"""
CREATE OR REPLACE FUNCTION django_idempotency_reserve_v2(
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
    IF NOT p_first_delivery THEN
        RETURN 'reserved';
    END IF;
    IF current_setting('transaction_isolation') IN ('repeatable read', 'serializable') THEN
        -- The read below would see the snapshot, taken before the insert waited. This insert
        -- meets the latest counter instead: one committed after the snapshot raises 40001.
        INSERT INTO {DELIVERIES} (consumer, event_id, topic, deliveries, first_delivered_at,
                                  last_delivered_at, last_error, expires_at)
        VALUES (p_consumer, p_event_id, p_topic, 1, p_processed_at, p_processed_at, '',
                p_expires_at)
        ON CONFLICT (consumer, event_id) DO NOTHING;
        IF FOUND THEN  -- there was no counter: none is left either
            DELETE FROM {DELIVERIES} WHERE consumer = p_consumer AND event_id = p_event_id;
            RETURN 'reserved';
        END IF;
    END IF;
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
    RETURN 'reserved';
END
$function$
"""

DROP = (
    "DROP FUNCTION IF EXISTS django_idempotency_reserve_v2("
    "text, text, text, timestamptz, timestamptz, boolean)"
)


def create_function(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(RESERVE)


def drop_function(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP)


class Migration(migrations.Migration):
    dependencies = [("django_idempotency", "0012_outbox_external_state")]

    operations = [migrations.RunPython(create_function, drop_function, elidable=False)]
