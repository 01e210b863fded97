"""A settings module without URLs (``testproject/settings_worker.py``): the commands still run.

Workers (Celery, the outbox relay, the Kafka runner) often get a settings module of their own
with no ``ROOT_URLCONF``. The HTTP checks walked the URLconf there and raised
``AttributeError`` from every command that runs system checks. Each command runs here as a real
``manage.py`` subprocess on a SQLite database of its own.
"""

from __future__ import annotations

import sqlite3
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.kafka_cluster import manage_env, run_manage

WORKER_SETTINGS = "testproject.settings_worker"

pytestmark = [
    # Each subprocess has its own SQLite file: one pass is enough.
    pytest.mark.sqlite,
    pytest.mark.timeout(240),
]


@pytest.fixture
def worker_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a manage.py under the URL-less settings, on a migrated database."""
    env = manage_env(
        f"sqlite:///{tmp_path / 'worker.sqlite3'}", DJANGO_SETTINGS_MODULE=WORKER_SETTINGS
    )
    env.pop("SHOP_KAFKA_BOOTSTRAP", None)
    migrated = _manage(env, "migrate", "--no-input")
    assert "Applying django_idempotency" in migrated.stdout
    return env


def _manage(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    try:
        return run_manage(env, *args)
    except subprocess.CalledProcessError as exc:
        raise AssertionError(f"manage.py {' '.join(args)} failed:\n{exc.stderr}") from exc


def test_the_settings_have_no_urls(worker_env: dict[str, str]) -> None:
    shown = _manage(worker_env, "shell", "-c", "from django.conf import settings; print(settings)")
    assert WORKER_SETTINGS in shown.stdout
    probe = "from django.conf import settings; print(hasattr(settings, 'ROOT_URLCONF'))"
    assert _manage(worker_env, "shell", "-c", probe).stdout.splitlines()[-1] == "False"


def test_check_and_migrate_run_without_urls(worker_env: dict[str, str]) -> None:
    checked = _manage(worker_env, "check")
    assert "System check identified no issues" in checked.stdout
    assert "No migrations to apply" in _manage(worker_env, "migrate", "--no-input").stdout


def test_the_relay_runs_without_urls(worker_env: dict[str, str]) -> None:
    relayed = _manage(worker_env, "idempotency_relay", "--once")
    assert "Traceback" not in relayed.stderr, relayed.stderr


@pytest.mark.slow
def test_the_kafka_runner_consumes_without_urls(
    worker_env: dict[str, str], tmp_path: Path
) -> None:
    pytest.importorskip("confluent_kafka")
    from tests.kafka_cluster import Cluster, start_consumer

    cluster = Cluster()
    try:
        topic = cluster.new_topic("worker-settings")
        event_id = str(uuid.uuid4())
        cluster.produce(topic, [{"event_id": event_id}])
        consumer = start_consumer(
            cluster,
            topic=topic,
            group=f"group-{uuid.uuid4().hex[:8]}",
            db_url=worker_env["DATABASE_URL"],
            log_dir=tmp_path,
            name="worker-settings",
            extra_env={"DJANGO_SETTINGS_MODULE": WORKER_SETTINGS},
        )
        try:
            database = worker_env["DATABASE_URL"].removeprefix("sqlite:///")
            deadline = time.monotonic() + 90
            while _effects(database, event_id) == 0:
                if consumer.process.poll() is not None:
                    raise AssertionError(f"the runner exited:\n{consumer.output()}")
                assert time.monotonic() < deadline, consumer.output()
                time.sleep(0.2)
            assert _effects(database, event_id) == 1
            assert consumer.terminate() == 0, consumer.output()
        finally:
            if consumer.process.poll() is None:
                consumer.kill()
    finally:
        cluster.close()


def _effects(database: str, event_id: str) -> int:
    with sqlite3.connect(database, timeout=20) as db:
        (count,) = db.execute(
            "SELECT COUNT(*) FROM shop_effect WHERE name = 'kafka' AND payload = ?", [event_id]
        ).fetchone()
    return int(count)
