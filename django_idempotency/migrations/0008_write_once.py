"""PostgreSQL only: a new key's record is written once, with its response.

Until now an atomic-mode request inserted its ``in_progress`` record with the claim, then updated
it with the response: two row versions (the second a dead tuple for VACUUM) and two sets of
writes for every first execution. But in atomic mode the claim's row is never seen by anyone
else: it is uncommitted until the response is stored in the same transaction. What keeps a
concurrent duplicate out is the advisory lock, not the row.

``django_idempotency_claim_v2`` first reads the key's record. A completed one that has not
expired (a replay) is answered from that read, without the statement below.

It does not insert when the key has no record at all, the transaction runs at ``READ
COMMITTED`` (PostgreSQL's and Django's default) and the request is in atomic mode (``p_lease``
is null). It takes the advisory lock, then looks for the record again: in a new statement, so
with a new snapshot, which sees a record that the lock's previous holder committed between the
first read and the lock. Still nothing there: it answers ``deferred`` and writes nothing. The lock stays
held until the transaction ends, and every other claim of the key tries it first, so no other
request can write this key meanwhile.

Anything else (a record is there, expired or not; a lease; a stricter isolation level, whose
snapshot would not see a record committed a moment ago) runs the statement of
``django_idempotency_claim_v1`` unchanged: a takeover still swaps the token at once, which fences
a lease holder that outlived its lease.

``django_idempotency_insert_completed_v1`` then writes the record, completed, with its response.
Should a row be there after all, it raises SQLSTATE ``P0002`` (``no_data_found``) as
``django_idempotency_complete_v1`` does for a lost claim, so the ``COMMIT`` that travels with it
never runs and the view's writes roll back.

``created_at`` of such a record is the transaction's start (``transaction_timestamp()``: the claim
opens the transaction, its ``BEGIN`` travelling with it), and ``expires_at`` counts from it.

The SQL is frozen here, as in ``0005`` and ``0007``: the ``_v1`` functions stay, so that old and
new code can run side by side during a deploy.
"""

from django.db import migrations

TABLE = "django_idempotency_idempotencyrecord"

CLAIM = f"""
CREATE OR REPLACE FUNCTION django_idempotency_claim_v2(
    p_owner text, p_key text, p_fingerprint text, p_method text, p_path text, p_token uuid,
    p_lease interval, p_ttl interval, p_lock_id bigint
) RETURNS TABLE (
    got boolean, claimed_id bigint, id bigint, fingerprint text, state text, token uuid,
    response_status integer, response_headers jsonb, response_body bytea, expired boolean,
    lease_live boolean, deferred boolean
) LANGUAGE plpgsql VOLATILE AS $function$
DECLARE
    found_record boolean;
    known record;
BEGIN
    SELECT t.id, t.fingerprint, t.state, t.token, t.response_status, t.response_headers,
           t.response_body, t.expires_at <= statement_timestamp() AS expired,
           (t.state = 'in_progress' AND t.locked_until > statement_timestamp()) AS lease_live
    INTO known FROM {TABLE} AS t WHERE t.owner = p_owner AND t."key" = p_key;
    found_record := FOUND;
    IF found_record AND known.state = 'completed' AND NOT known.expired THEN
        -- A replay: what v1's statement answers for it, without its lock and insert.
        RETURN QUERY SELECT NULL::boolean, NULL::bigint, known.id::bigint,
            known.fingerprint::text, known.state::text, known.token,
            known.response_status::integer, known.response_headers, known.response_body,
            known.expired, known.lease_live, false;
        RETURN;
    END IF;
    IF NOT found_record AND p_lease IS NULL
       AND current_setting('transaction_isolation') = 'read committed'
    THEN
        IF NOT pg_try_advisory_xact_lock(p_lock_id) THEN
            RETURN QUERY SELECT false, NULL::bigint, NULL::bigint, NULL::text, NULL::text,
                NULL::uuid, NULL::integer, NULL::jsonb, NULL::bytea, NULL::boolean,
                NULL::boolean, false;
            RETURN;
        END IF;
        IF NOT EXISTS (SELECT 1 FROM {TABLE} AS t WHERE t.owner = p_owner AND t."key" = p_key)
        THEN
            RETURN QUERY SELECT true, NULL::bigint, NULL::bigint, NULL::text, NULL::text,
                NULL::uuid, NULL::integer, NULL::jsonb, NULL::bytea, NULL::boolean,
                NULL::boolean, true;
            RETURN;
        END IF;
        -- Committed while the lock was held elsewhere: claim as v1 does (the lock is ours
        -- already; taking it again in the same transaction succeeds).
    END IF;
    RETURN QUERY
    WITH existing AS (
        SELECT r.id, r.fingerprint, r.state, r.token, r.response_status, r.response_headers,
               r.response_body,
               r.expires_at <= statement_timestamp() AS expired,
               (r.state = 'in_progress' AND r.locked_until > statement_timestamp())
                   AS lease_live
        FROM {TABLE} AS r WHERE r.owner = p_owner AND r."key" = p_key
    ),
    lock AS (
        SELECT pg_try_advisory_xact_lock(p_lock_id) AS got
        WHERE NOT EXISTS (
            SELECT 1 FROM existing AS e WHERE e.state = 'completed' AND NOT e.expired
        )
    ),
    claimed AS (
        INSERT INTO {TABLE} AS t (owner, "key", fingerprint, method, path, state, token,
                                  locked_until, response_headers, created_at, expires_at)
        SELECT p_owner, p_key, p_fingerprint, p_method, p_path, 'in_progress', p_token,
               statement_timestamp() + p_lease, '{{}}'::jsonb,
               statement_timestamp(), statement_timestamp() + p_ttl
        FROM lock WHERE lock.got
        ON CONFLICT (owner, "key") DO UPDATE SET
            fingerprint = EXCLUDED.fingerprint, method = EXCLUDED.method,
            path = EXCLUDED.path, state = EXCLUDED.state, token = EXCLUDED.token,
            locked_until = EXCLUDED.locked_until, response_status = NULL,
            response_headers = EXCLUDED.response_headers, response_body = NULL,
            created_at = EXCLUDED.created_at, completed_at = NULL,
            expires_at = EXCLUDED.expires_at
        WHERE NOT (t.state = 'in_progress' AND t.locked_until > EXCLUDED.created_at)
          AND (t.expires_at <= EXCLUDED.created_at
               OR (t.state = 'in_progress' AND t.fingerprint = EXCLUDED.fingerprint))
        RETURNING t.id
    )
    SELECT (SELECT l.got FROM lock AS l), (SELECT c.id FROM claimed AS c)::bigint,
           e.id::bigint, e.fingerprint::text, e.state::text, e.token,
           e.response_status::integer, e.response_headers, e.response_body, e.expired,
           e.lease_live, false
    FROM (SELECT 1) AS one LEFT JOIN existing AS e ON true;
END
$function$
"""

INSERT_COMPLETED = f"""
CREATE OR REPLACE FUNCTION django_idempotency_insert_completed_v1(
    p_owner text, p_key text, p_fingerprint text, p_method text, p_path text, p_token uuid,
    p_ttl interval, p_status integer, p_headers jsonb, p_body bytea
) RETURNS bigint LANGUAGE plpgsql VOLATILE AS $function$
DECLARE
    v_id bigint;
BEGIN
    INSERT INTO {TABLE} (owner, "key", fingerprint, method, path, state, token, locked_until,
                         response_status, response_headers, response_body, created_at,
                         completed_at, expires_at)
    VALUES (p_owner, p_key, p_fingerprint, p_method, p_path, 'completed', p_token, NULL,
            p_status, p_headers, p_body, transaction_timestamp(), statement_timestamp(),
            transaction_timestamp() + p_ttl)
    ON CONFLICT (owner, "key") DO NOTHING
    RETURNING id INTO v_id;
    IF v_id IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'no_data_found',
            MESSAGE = 'idempotency key ' || p_key || ' got a record while token ' || p_token
                || ' held its claim';
    END IF;
    RETURN v_id;
END
$function$
"""

DROP = (
    "DROP FUNCTION IF EXISTS django_idempotency_claim_v2("
    "text, text, text, text, text, uuid, interval, interval, bigint)",
    "DROP FUNCTION IF EXISTS django_idempotency_insert_completed_v1("
    "text, text, text, text, text, uuid, interval, integer, jsonb, bytea)",
)


def create_functions(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CLAIM)
        schema_editor.execute(INSERT_COMPLETED)


def drop_functions(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        for statement in DROP:
            schema_editor.execute(statement)


class Migration(migrations.Migration):
    dependencies = [("django_idempotency", "0007_complete_function")]

    operations = [migrations.RunPython(create_functions, drop_functions, elidable=False)]
