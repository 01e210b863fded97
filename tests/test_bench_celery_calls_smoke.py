"""Keeps ``bench/celery_calls.py`` from rotting: a tiny run of both its sections.

It runs in a subprocess on a scratch SQLite file with the real Redis and a real worker and
relay; no timing is asserted, only that every row ran and nothing ran before it was due.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import require_service

pytestmark = [pytest.mark.slow, pytest.mark.broker, pytest.mark.sqlite, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parent.parent


def test_celery_calls_benchmark_runs(tmp_path: Path) -> None:
    require_service("redis")
    done = subprocess.run(
        [
            sys.executable, "-m", "bench.celery_calls", "--quick",
            "--database-url", f"sqlite:///{tmp_path / 'bench.sqlite3'}",
        ],
        cwd=REPO, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout[: done.stdout.index("\n}\n") + 3])
    typed = figures["typed"]
    assert set(typed) == {
        "order alone",
        "order + publish(), plain JSON arguments",
        "order + publish(), kombu-typed arguments",
    }
    assert typed["order + publish(), kombu-typed arguments"]["statements"] == (
        typed["order alone"]["statements"] + 1
    )
    delayed = figures["delayed"]
    assert len(delayed) == 3
    assert all(row["messages"] == 10 and row["early"] == 0 for row in delayed.values())
