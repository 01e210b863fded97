"""Keeps ``bench/growth.py`` from rotting: its ``--quick`` run, every section, on PostgreSQL.

It runs in a subprocess, in a database of its own that the bench creates and drops; no timing
is asserted, only that each section measured what it says and that the bound table is there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from django.db import connection

from tests.workers import database_url

pytestmark = [
    pytest.mark.slow,
    pytest.mark.postgres,
    pytest.mark.django_db,
    pytest.mark.timeout(300),
]

REPO = Path(__file__).resolve().parent.parent


def test_growth_benchmark_runs(tmp_path: Path) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("bench/growth.py seeds with generate_series: PostgreSQL only")
    server = database_url(connection.settings_dict).rsplit("/", 1)[0] + "/postgres"
    name = f"idem_bench_growth_{uuid.uuid4().hex[:8]}"
    out = tmp_path / "growth.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.growth", "--quick", "--database", name, "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=280,
        env={**os.environ, "BENCH_PG_URL": server},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(out.read_text())
    big = figures["big"]
    for key in ("claim_stale", "claim"):
        assert big[key]["rows_per_batch"] == 500
        assert set(big[key]["parts_p50"]) == {"query", "ordering check", "lease"}
    assert big["http"]["first"]["n"] == big["http"]["replay"]["n"] == 20
    assert {page["name"] for page in big["admin"]} >= {"outbox: expired", "records: expired"}
    assert all(page["queries"] <= 7 for page in big["admin"])
    for table in ("sent outbox messages", "records", "processed events", "event deliveries"):
        assert big["purge"][table]["deleted"] > 0
    assert "claim query, fresh stats" in done.stdout  # the table of bounds
    with connection.cursor() as cursor:  # dropped afterwards
        cursor.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name])
        assert cursor.fetchone() is None
