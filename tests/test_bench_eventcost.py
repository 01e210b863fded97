"""Keeps bench/eventcost.py, bench/storecost.py and bench/consumerfloor.py from rotting: they run
on a scratch PostgreSQL database, in seconds.

No timing is asserted; the figures are for docs/benchmarks.md (``python -m bench.eventcost``,
``python -m bench.storecost``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.db import connection

from tests.workers import database_url

REPO = Path(__file__).resolve().parent.parent

# Each test builds a benchmark database and runs a benchmark in a subprocess: slow.
pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def scratch_url() -> Iterator[str]:
    name = f"idempotency_bench_smoke_{os.getpid()}"
    with connection.cursor() as cursor:
        cursor.execute(f'DROP DATABASE IF EXISTS "{name}"')
        cursor.execute(f'CREATE DATABASE "{name}"')
    try:
        yield database_url({**connection.settings_dict, "NAME": name})
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def run_python(args: list[str], url: str) -> str:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "bench.benchproject.settings",
        "BENCH_VARIANT": "app",
        "BENCH_DATABASE_URL": url,
        "PYTHONPATH": str(REPO),
    }
    done = subprocess.run(
        [sys.executable, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_event_cost_benchmark_runs_every_row(scratch_url: str) -> None:
    run_python(["-m", "bench.benchproject.prepare"], scratch_url)

    out = run_python(["-m", "bench.eventcost", "--calls", "3", "--rounds", "2"], scratch_url)

    result = json.loads(out.splitlines()[-1])
    rows = {row["row"]: row for row in result["rows"]}
    assert set(rows) == {
        "effect alone",
        "reserve + effect, SQL text",
        "reserve + effect, function",
        "count, SQL text",
        "count, function",
    }
    assert rows["effect alone"]["ratio_to_effect_alone"] == 1.0
    for name, row in rows.items():
        assert len(row["rounds_us"]) == 2 and row["us_per_call"] > 0, (name, row)


def test_store_cost_benchmark_runs_every_row(scratch_url: str) -> None:
    """``bench/storecost.py`` compares two versions of the store; here the current one twice."""
    run_python(["-m", "bench.benchproject.prepare"], scratch_url)
    store = str(REPO / "django_idempotency" / "http" / "store.py")

    out = run_python(["-m", "bench.storecost", store, "--calls", "3"], scratch_url)

    rows = {row["row"] for row in json.loads(out.splitlines()[-1])["rows"]}
    paths = (
        "first execution (claim + store)",
        "first execution, committed (claim + store + COMMIT)",
        "replay (claim)",
    )
    assert rows == {f"{path} {version}" for path in paths for version in ("before", "after")}


def test_consumer_floor_benchmark_runs_every_row(scratch_url: str) -> None:
    run_python(["-m", "bench.benchproject.prepare"], scratch_url)

    out = run_python(["-m", "bench.consumerfloor", "--calls", "3", "--rounds", "2"], scratch_url)

    rows = {row["row"]: row for row in json.loads(out.splitlines()[-1])["rows"]}
    assert len(rows) == 9 and rows["effect alone"]["ratio_to_effect_alone"] == 1.0
    for name, row in rows.items():
        assert len(row["rounds_us"]) == 2 and row["us_per_call"] > 0, (name, row)
