"""Keeps ``bench/outbox.py`` from rotting: a tiny run of its publish and relay sections.

It runs in a subprocess on a scratch SQLite file with the real brokers; no timing is asserted.
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


def test_outbox_benchmark_runs(tmp_path: Path) -> None:
    require_service("redis")
    require_service("rabbitmq")
    done = subprocess.run(
        [
            sys.executable, "-m", "bench.outbox", "--quick", "--only", "publish,relay",
            "--database-url", f"sqlite:///{tmp_path / 'bench.sqlite3'}",
        ],
        cwd=REPO, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout[: done.stdout.index("\n}\n") + 3])
    assert set(figures["publish"]) == {
        "order alone",
        "order + apply_async_on_commit (Redis)",
        "order + outbox.publish",
    }
    assert figures["publish"]["order + outbox.publish"]["statements"] == (
        figures["publish"]["order alone"]["statements"] + 1
    )
    relay = figures["relay"]
    assert all(row["messages"] == 500 for row in relay.values())
    # The old path and the batched one, side by side, for the two paths with a target.
    for path in ("Celery to Redis", "Celery to RabbitMQ, publisher confirms"):
        assert relay[path]["old_per_second"] > 0 and relay[path]["new_per_second"] > 0
        assert relay[path]["met"] in ("yes", "no")
