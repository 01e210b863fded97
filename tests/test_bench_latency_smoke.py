"""Keeps ``bench/latency.py`` from rotting: a tiny run, with a relay and a Celery worker as real
processes, on a scratch PostgreSQL database and the real Redis. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import connection

from tests.conftest import require_service
from tests.workers import database_url

pytestmark = [
    pytest.mark.slow,
    pytest.mark.broker,
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(300),
]

REPO = Path(__file__).resolve().parent.parent


def test_latency_benchmark_runs_every_row() -> None:
    require_service("redis")
    name = f"idempotency_bench_latency_{os.getpid()}"
    url = database_url({**connection.settings_dict, "NAME": name})
    try:
        done = subprocess.run(
            [sys.executable, "-m", "bench.latency", "--quick", "--database-url", url],
            cwd=REPO, capture_output=True, text=True, timeout=280,
        )  # fmt: skip
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout[: done.stdout.index("\n}\n") + 3])["latency"]
    assert set(figures) == {
        "apply_async_on_commit (steady)",
        "outbox, NOTIFY (steady)",
        "outbox, NOTIFY (isolated)",
        "outbox, NOTIFY, ignore_result (steady)",
        "outbox, 1 s poll only (isolated)",
    }
    for row, values in figures.items():
        assert values["messages"] > 0 and values["p99_ms"] >= values["p50_ms"] > 0, (row, values)
        if row.startswith("outbox"):
            assert values["to_sent_p99_ms"] > 0, (row, values)
