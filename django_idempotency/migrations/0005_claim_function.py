"""PostgreSQL only: the claim as a PL/pgSQL function, so its plan is cached per session.

Sent as one 2.6 kB statement, the claim was parsed and planned again on every request (Django
turns server-side prepared statements off, and PgBouncer in transaction mode cannot keep them).
PL/pgSQL caches the plans of the statements inside a function for the life of the server
session, whichever client transaction calls it, so this works unchanged behind PgBouncer in
transaction pooling mode. The body is the same single statement as before (one snapshot, the
same advisory lock and upsert), see :mod:`django_idempotency.http.store`.

The SQL is frozen here on purpose: a later change to the claim gets a new function (``_v2``) in
a new migration, so that old and new code can run side by side during a deploy.
"""

from django.db import migrations

TABLE = "django_idempotency_idempotencyrecord"

CREATE = f"""
CREATE OR REPLACE FUNCTION django_idempotency_claim_v1(
    p_owner text, p_key text, p_fingerprint text, p_method text, p_path text, p_token uuid,
    p_lease interval, p_ttl interval, p_lock_id bigint
) RETURNS TABLE (
    got boolean, claimed_id bigint, id bigint, fingerprint text, state text, token uuid,
    response_status integer, response_headers jsonb, response_body bytea, expired boolean,
    lease_live boolean
) LANGUAGE plpgsql VOLATILE AS $function$
#variable_conflict use_column
BEGIN
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
           e.lease_live
    FROM (SELECT 1) AS one LEFT JOIN existing AS e ON true;
END
$function$
"""

DROP = (
    "DROP FUNCTION IF EXISTS django_idempotency_claim_v1("
    "text, text, text, text, text, uuid, interval, interval, bigint)"
)


def create_function(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE)


def drop_function(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP)


class Migration(migrations.Migration):
    dependencies = [("django_idempotency", "0004_flows")]

    operations = [migrations.RunPython(create_function, drop_function, elidable=False)]
