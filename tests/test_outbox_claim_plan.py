"""The relay's claim has a plan that does not depend on luck (issue 28).

Statistics taken while nothing was pending are the normal quiet state. With them, PostgreSQL
ran the claim's ``NOT EXISTS`` as one loop per candidate, each reading every pending row:
2.7 s per batch at 5,000 pending rows on the test machine, and a 100,000-row backlog did not
finish one batch in ten minutes. The claim now walks ``idem_outbox_pending_idx`` in id order
and, per candidate, probes ``idem_outbox_touched_idx`` (the few rows of its key that a relay has
leased, delayed or parked), with the planner's other choices turned off for the claim's own
transaction. These tests read the plan (``EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)``) after the
table was analyzed empty and then filled: its shape, and the rows and buffers it read. They
never assert a duration.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_idempotency.models import OutboxEntry
from django_idempotency.outbox import store

pytestmark = pytest.mark.django_db(transaction=True)

TABLE = OutboxEntry._meta.db_table
BATCH = 500


def nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)


def fill(rows: int, keys: int) -> None:
    """Analyze the table empty, then add ``rows`` pending rows over ``keys`` keys."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            # Statistics stay those of the empty table, as when autovacuum is slow or off.
            cursor.execute(f"ALTER TABLE {TABLE} SET (autovacuum_enabled = false)")
            # The plan this replaced ran for minutes at this size: fail instead of waiting.
            cursor.execute("SET statement_timeout = '60s'")
            cursor.execute(f"ANALYZE {TABLE}")
            series = f"generate_series(1, {rows}) AS s(g)"
        else:
            cursor.execute(f"ANALYZE TABLE {TABLE}")
            series = f"(SELECT seq AS g FROM seq_1_to_{rows}) AS s"  # the Sequence engine
        key = f"CONCAT('k', MOD(g, {keys}))"
        cursor.execute(
            f"INSERT INTO {TABLE} (event_id, destination, transport, payload, headers, "
            "ordering_key, state, attempts, last_error, created_at) "
            f"SELECT CONCAT('e', g), 'd', 'default', '{{}}', '{{}}', {key}, 'pending', 0, '', "
            f"CURRENT_TIMESTAMP FROM {series}"
        )
        # A few touched rows, as in a working outbox: parked heads and leased rows.
        cursor.execute(f"UPDATE {TABLE} SET state = 'parked' WHERE MOD(id, 997) = 0")
        cursor.execute(
            f"UPDATE {TABLE} SET locked_until = %s WHERE MOD(id, 991) = 0",
            [timezone.now() + timezone.timedelta(hours=1)],
        )


@pytest.fixture(autouse=True)
def _reset_session() -> Iterator[None]:
    yield
    connection.close()  # drops the session's statement_timeout


def claim_sql() -> str:
    with CaptureQueriesContext(connection) as queries, store.claim_transaction(connection):
        found = store.candidates(connection.alias, timezone.now(), BATCH)
    assert len(found) == BATCH
    (sql,) = [q["sql"] for q in queries.captured_queries if "FOR UPDATE" in q["sql"]]
    return sql


def explain_in_claim(sql: str, options: str) -> dict[str, Any]:
    """The plan of ``sql``, explained (with ``options``) inside the claim's transaction."""
    with store.claim_transaction(connection), connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN ({options}) {sql}")
        [[explained]] = cursor.fetchall()
    if isinstance(explained, str):
        explained = json.loads(explained)
    plan: dict[str, Any] = explained[0]["Plan"]
    return plan


@pytest.mark.postgres
def test_postgresql_claim_walks_the_partial_indexes_after_an_empty_analyze() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's plan")
    fill(100_000, 1_000)
    sql = claim_sql()
    plan = explain_in_claim(sql, "ANALYZE, BUFFERS, FORMAT JSON")
    types = [node["Node Type"] for node in nodes(plan)]
    assert "Seq Scan" not in types and "Sort" not in types, types
    assert not any(t.startswith("Bitmap") or t == "Hash Join" for t in types), types
    scans = {
        node["Index Name"]: node
        for node in nodes(plan)
        if node["Node Type"] in {"Index Scan", "Index Only Scan"}
    }
    # The walk: pending rows in id order, stopped by the LIMIT after about one batch.
    walk = scans["idem_outbox_pending_idx"]
    assert walk["Actual Rows"] * walk["Actual Loops"] <= 2 * BATCH
    # The probe: per candidate, its key's touched rows (about none), not its pending ones.
    probe = scans["idem_outbox_touched_idx"]
    assert probe["Actual Loops"] <= 2 * BATCH
    assert probe["Actual Rows"] <= 1
    assert set(scans) == {"idem_outbox_pending_idx", "idem_outbox_touched_idx"}
    # What the whole claim read: a few buffers per row claimed (the bad plan read about
    # 110,000 for one batch at this size).
    read = plan["Shared Hit Blocks"] + plan["Shared Read Blocks"]
    assert read <= 8 * BATCH, read


@pytest.mark.postgres
def test_postgresql_planner_switches_do_not_outlive_a_nested_claim() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's settings")
    from django.db import transaction

    with transaction.atomic(), connection.cursor() as cursor:
        with store.claim_transaction(connection):
            cursor.execute("SHOW enable_seqscan")
            assert cursor.fetchone() == ("off",)
        cursor.execute("SHOW enable_seqscan")
        assert cursor.fetchone() == ("on",)


@pytest.mark.mysql
def test_mariadb_claim_probes_the_key_index_after_an_empty_analyze() -> None:
    """MariaDB has no partial index: its ``NOT EXISTS`` probes ``idem_outbox_key_idx`` by key
    (a ``ref`` access), never a scan of every pending row per candidate."""
    if connection.vendor != "mysql":
        pytest.skip("MariaDB's plan")
    fill(20_000, 1_000)
    sql = claim_sql()
    with store.claim_transaction(connection), connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN {sql}")
        columns = [column[0] for column in cursor.description]
        rows = [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]
    sub = [row for row in rows if "SUBQUERY" in str(row["select_type"])]
    assert sub, rows
    assert all(row["key"] == "idem_outbox_key_idx" and row["type"] == "ref" for row in sub), rows


@pytest.mark.postgres
def test_postgresql_ordering_check_reads_the_key_index_not_the_sent_rows() -> None:
    """The relay's ordering check (``store.unsent_of_keys``) runs inside the claim's
    transaction, where sorts are turned off. With ``ORDER BY id`` the one plan left walked the
    primary key over every row up to the batch's last id, sent rows included: 36 ms per
    ``Relay._claim`` with no sent row, 270 ms with a million (bench/growth.py, issue 28). It
    reads an index of unsent rows now, and the rows come back in id order all the same."""
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's plan")
    sent = 20_000
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {TABLE} (event_id, destination, transport, payload, headers, "
            "ordering_key, state, attempts, last_error, created_at, sent_at, expires_at) "
            "SELECT CONCAT('s', g), 'd', 'default', '{}', '{}', CONCAT('k', MOD(g, 100)), "
            "'sent', 1, '', now(), now(), now() + interval '7 days' "
            f"FROM generate_series(1, {sent}) AS s(g)"
        )
    fill(1_000, 100)  # pending after the sent rows, as they are in a working outbox
    with CaptureQueriesContext(connection) as queries, store.claim_transaction(connection):
        found = store.candidates(connection.alias, timezone.now(), BATCH)
        keys = {row.ordering_key for row in found if row.ordering_key is not None}
        unsent = store.unsent_of_keys(connection.alias, keys, max(row.pk for row in found))
    assert len(found) == BATCH
    assert unsent == sorted(unsent) and len(unsent) >= BATCH
    (sql,) = [q["sql"] for q in queries.captured_queries if 'ordering_key" IN (' in q["sql"]]
    plan = explain_in_claim(sql, "ANALYZE, FORMAT JSON")
    scanned = {node.get("Index Name") for node in nodes(plan)} - {None}
    # An index of unsent rows by key, or by state: either reads no sent row.
    assert len(scanned) == 1 and scanned <= {"idem_outbox_key_idx", "idem_outbox_state_idx"}, (
        scanned
    )
    removed = sum(node.get("Rows Removed by Filter", 0) for node in nodes(plan))
    assert removed <= BATCH, removed  # the sent rows were all read and thrown away before
