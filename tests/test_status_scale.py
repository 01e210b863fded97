"""``idempotency_status`` on big tables: every query it runs reads an index, none scans a table.

A throwaway PostgreSQL database of its own (dropped afterwards) is migrated, then filled with
``generate_series``: records (1% in progress, half of those under a live lease), pending, sent
and parked outbox messages, parked deliveries and flow runs. A subprocess then runs the status
collection with every query captured, and ``EXPLAIN``s each one: no plan may hold a
``Seq Scan`` on the records or the outbox. The command's answer is checked against the rows
made, and its wall time is printed (never asserted: the machine is shared).

The default size is 1,000,000 records and 100,000 pending messages, which builds in about a
minute on two shared cores; ``STATUS_SCALE_RECORDS`` and ``STATUS_SCALE_PENDING`` raise it (the
documented run used 10,000,000 and 1,000,000; docs/operations.md has the figures).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator

import pytest
from django.db import connection

from tests.workers import REPO, database_url

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.timeout(3600)]

RECORDS = int(os.environ.get("STATUS_SCALE_RECORDS", "1000000"))
PENDING = int(os.environ.get("STATUS_SCALE_PENDING", "100000"))

FILL = """
INSERT INTO django_idempotency_idempotencyrecord
    (owner, key, fingerprint, method, path, state, token, locked_until, response_status,
     response_headers, response_body, created_at, completed_at, expires_at)
SELECT 'user:' || mod(n, 5000), 'key-' || n, md5(n::text), 'POST', '/api/orders/',
    CASE WHEN mod(n, 100) = 0 THEN 'in_progress' ELSE 'completed' END,
    md5(n::text)::uuid,
    CASE WHEN mod(n, 200) = 0 THEN now() + interval '1 hour'
         WHEN mod(n, 100) = 0 THEN now() - interval '1 hour' END,
    CASE WHEN mod(n, 100) = 0 THEN NULL ELSE 201 END,
    '{}'::jsonb, NULL, now() - interval '1 hour', NULL, now() + interval '1 day'
FROM generate_series(1, %(records)s) AS n;

INSERT INTO django_idempotency_outboxentry
    (event_id, destination, transport, payload, headers, ordering_key, state, attempts,
     available_at, locked_until, last_error, created_at, sent_at, expires_at)
SELECT md5(n::text)::uuid::text, 'orders.confirmed', 'default', '{"n": 1}'::jsonb, '{}'::jsonb,
    NULL,
    CASE WHEN n <= %(pending)s THEN 'pending' WHEN n <= %(pending)s + 50 THEN 'parked'
         ELSE 'sent' END,
    0, NULL, NULL, '', now() - interval '1 minute' * (%(pending)s * 2 - n) / 1000, NULL,
    CASE WHEN n > %(pending)s + 50 THEN now() + interval '7 days' END
FROM generate_series(1, %(pending)s * 2) AS n;

INSERT INTO django_idempotency_eventdelivery
    (consumer, event_id, topic, deliveries, first_delivered_at, last_delivered_at, parked_at,
     last_error, expires_at)
SELECT 'billing', 'event-' || n, '', 6, now(), now(),
    CASE WHEN mod(n, 1000) = 0 THEN now() END, '', now() + interval '7 days'
FROM generate_series(1, 100000) AS n;

INSERT INTO django_idempotency_flowrun
    (record_id, flow, fingerprint, state, recovery_point, results, started, request, attempts,
     last_error, created_at, updated_at)
SELECT id, 'shop.rides:checkout', fingerprint, 'running', '', '{}'::jsonb, '', '{}'::jsonb, 0,
    '', now(), now()
FROM django_idempotency_idempotencyrecord WHERE state = 'in_progress' AND mod(id, 20) = 0;

VACUUM ANALYZE;
"""

PROBE = textwrap.dedent(
    """
    import json, sys, time
    import django
    django.setup()
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from django_idempotency.status import collect

    with CaptureQueriesContext(connection) as captured:
        started = time.perf_counter()
        figures = collect()
        seconds = time.perf_counter() - started
    plans = []
    with connection.cursor() as cursor:
        for query in captured.captured_queries:
            sql = query["sql"]
            if sql.startswith("EXPLAIN"):
                continue
            cursor.execute("EXPLAIN " + sql)
            plans.append({"sql": sql, "plan": "\\n".join(row[0] for row in cursor.fetchall())})
    print(json.dumps({"figures": figures.as_dict(), "seconds": seconds, "plans": plans}))
    """
)


@pytest.fixture
def big_database() -> Iterator[str]:
    if connection.vendor != "postgresql":
        pytest.skip("the scale proof runs on PostgreSQL")
    import psycopg

    name = f"idem_status_scale_{uuid.uuid4().hex[:8]}"
    base = database_url(connection.settings_dict)
    admin_url = base.rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = base.rsplit("/", 1)[0] + f"/{name}"
    try:
        yield url
    finally:
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def manage(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=REPO,
        env={**os.environ, "DATABASE_URL": url, "DJANGO_SETTINGS_MODULE": "testproject.settings"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_status_reads_indexes_only_on_big_tables(big_database: str) -> None:
    import psycopg

    migrated = manage(big_database, "migrate", "django_idempotency", "--verbosity", "0")
    assert migrated.returncode == 0, migrated.stderr
    started = time.monotonic()
    with psycopg.connect(big_database, autocommit=True) as db:
        for statement in FILL.split(";\n"):
            if statement.strip():
                params = {"records": RECORDS, "pending": PENDING} if "%(" in statement else None
                db.execute(statement, params)  # type: ignore[arg-type]
    built = time.monotonic() - started
    print(f"built {RECORDS} records and {PENDING} pending messages in {built:.0f}s")

    probe = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=REPO,
        env={
            **os.environ,
            "DATABASE_URL": big_database,
            "DJANGO_SETTINGS_MODULE": "testproject.settings",
        },
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert probe.returncode == 0, probe.stderr
    result = json.loads(probe.stdout.strip().splitlines()[-1])
    for query in result["plans"]:
        plan = query["plan"]
        for table in ("django_idempotency_idempotencyrecord", "django_idempotency_outboxentry"):
            assert f"Seq Scan on {table}" not in plan, query
    figures = result["figures"]
    in_progress = RECORDS // 100
    if RECORDS // 200 <= 10_000:
        assert figures["live_leases"] == RECORDS // 200
    assert figures["outbox_parked"] == 50
    assert figures["deliveries_parked"] == 100
    # Past 10,000 a count is the planner's estimate, flagged as such.
    assert ("records_in_progress" in figures["estimated"]) == (in_progress > 10_000)
    assert "outbox_pending" in figures["estimated"]
    assert figures["outbox_pending"] > 10_000
    assert figures["outbox_oldest_pending_seconds"] > 60
    print(f"status collection: {result['seconds']:.3f}s")

    # The command itself: an answer, and exit 1 for the lag (the oldest pending is old).
    started = time.monotonic()
    done = manage(big_database, "idempotency_status", "--json", "--max-lag", "60")
    print(f"idempotency_status (a whole process): {time.monotonic() - started:.2f}s")
    assert done.returncode == 1, done.stderr
    assert json.loads(done.stdout)["outbox_parked"] == 50
