"""The guides, followed literally: each builds the quickstart's project, adds the guide's own
code blocks, and runs them with a real request and a real worker, relay or consumer process.

A code block whose title is a path is that file (``: add at the end`` appends to it), as in
``tests/test_docs_quickstart.py``. What a test adds that the page does not say is only what a
shared machine needs: a queue of its own on the shared Redis, and the mock Kafka cluster's
address in place of ``kafka-1:9092,kafka-2:9092``. The README's ten lines are sketches with
their imports left out; the test adds those imports, and nothing else.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.conftest import require_service
from tests.services import reachable
from tests.test_docs_quickstart import exchanges, files, free_port, run, send

if TYPE_CHECKING:
    from tests.kafka_cluster import Cluster

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
QUICKSTART = DOCS / "quickstart.md"
PYTHON = sys.executable

#: Each builds its own SQLite project (the testing page also a PostgreSQL one): once is enough,
#: so they run in the SQLite pass only.
pytestmark = [pytest.mark.slow, pytest.mark.sqlite]


def environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "DATABASE_URL"))}


def write_pages(project: Path, *pages: Path) -> None:
    for page in pages:
        for path, append, text in files(page):
            target = project / path
            target.write_text((target.read_text() + "\n" if append else "") + text)


def migrate(project: Path) -> None:
    """``makemigrations orders`` and ``migrate``, in one process (each start costs seconds)."""
    script = (
        "from django.core.management import call_command\n"
        "call_command('makemigrations', 'orders', verbosity=0)\n"
        "call_command('migrate', verbosity=0)\n"
    )
    run([PYTHON, "manage.py", "shell", "-c", script], project, environment())


@pytest.fixture(scope="session")
def quickstart_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The quickstart's project (``startproject``, ``startapp orders``, its files), migrated
    once; each test copies it. ``tests/test_docs_quickstart.py`` builds it from scratch."""
    env = environment()
    base = tmp_path_factory.mktemp("quickstart")
    run([PYTHON, "-m", "django", "startproject", "mysite"], base, env)
    project = base / "mysite"
    run([PYTHON, "manage.py", "startapp", "orders"], project, env)
    write_pages(project, QUICKSTART)
    migrate(project)
    return project


def build(tmp_path: Path, template: Path, *pages: Path) -> Path:
    """A copy of the quickstart's project with every titled block of ``pages`` added."""
    project = tmp_path / "mysite"
    shutil.copytree(template, project, ignore=shutil.ignore_patterns("__pycache__"))
    write_pages(project, *pages)
    return project


def add_setting(project: Path, text: str) -> None:
    settings = project / "mysite" / "settings.py"
    settings.write_text(settings.read_text() + "\n" + text + "\n")


def count(project: Path, table: str) -> int:
    with sqlite3.connect(project / "db.sqlite3") as db:
        return int(db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])


def wait_for(condition: object, what: str, process: subprocess.Popen[str] | None = None) -> None:
    deadline = time.monotonic() + 120  # a guard against a hang: processes start slowly on CI
    while not condition():  # type: ignore[operator]
        if process is not None and process.poll() is not None:
            raise AssertionError(f"{what}: the process exited: {output_of(process)}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@contextmanager
def process(args: list[str], project: Path) -> Iterator[subprocess.Popen[str]]:
    """A long-running process of the project, its output in ``<project>/<pid>.log``; SIGTERM,
    then SIGKILL, when the block ends."""
    log = project / f"process-{uuid.uuid4().hex[:8]}.log"
    with log.open("w") as output:
        child = subprocess.Popen(
            args,
            cwd=project,
            env=environment(),
            stdout=output,
            stderr=subprocess.STDOUT,
            text=True,
        )
        child.log = log  # type: ignore[attr-defined]
        try:
            yield child
        finally:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=20)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def output_of(child: subprocess.Popen[str]) -> str:
    return Path(child.log).read_text()  # type: ignore[attr-defined]


@contextmanager
def server(project: Path) -> Iterator[int]:
    port = free_port()
    args = [PYTHON, "manage.py", "runserver", f"127.0.0.1:{port}", "--noreload"]
    with process(args, project) as child:

        def listening() -> bool:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            except OSError:
                return False
            return True

        wait_for(listening, "runserver", child)
        yield port


def check_exchanges(page: Path, port: int, expected: int) -> None:
    """Send the page's ``curl`` commands, twice each: the answer shown, then its replay."""
    shown = exchanges(page)
    assert len(shown) == expected
    for exchange in shown:
        for replay in (False, True):
            status, headers, body = send(exchange, port)
            assert status == exchange.status, (exchange.command, status, body)
            for name, value in exchange.headers.items():
                assert headers.get(name) == value, (exchange.command, name, headers)
            assert (headers.get("Idempotent-Replayed") == "true") is replay
            assert json.loads(body) == json.loads(exchange.body)


def celery_worker(queue: str) -> list[str]:
    return [
        *(PYTHON, "-m", "celery", "-A", "mysite", "worker", "-Q", queue, "--pool", "solo"),
        *("--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "info"),
    ]


def test_the_outbox_guide_publishes_through_a_relay_to_a_worker(
    tmp_path: Path, quickstart_project: Path
) -> None:
    require_service("redis")
    project = build(tmp_path, quickstart_project, DOCS / "outbox.md")
    queue = f"docs-outbox-{uuid.uuid4().hex[:8]}"
    add_setting(project, f"CELERY_TASK_DEFAULT_QUEUE = {queue!r}")
    migrate(project)
    env = environment()
    confirm = (
        "from orders.models import Order\n"
        "from orders.services import confirm\n"
        "confirm(Order.objects.create(reference='A-1', amount_cents=1250))\n"
    )
    run([PYTHON, "manage.py", "shell", "-c", confirm], project, env)
    assert count(project, "django_idempotency_outboxentry") == 1
    assert count(project, "orders_ledgerentry") == 0  # nothing left before the relay ran
    run([PYTHON, "manage.py", "idempotency_relay", "--once"], project, env)
    with process(celery_worker(queue), project) as worker:
        wait_for(lambda: count(project, "orders_ledgerentry") == 1, "the ledger entry", worker)
    with sqlite3.connect(project / "db.sqlite3") as db:
        state, event_id = db.execute(
            "SELECT state, event_id FROM django_idempotency_outboxentry"
        ).fetchone()
        (ledger_event,) = db.execute("SELECT event_id FROM orders_ledgerentry").fetchone()
    assert (state, ledger_event) == ("sent", event_id)


def test_the_migrating_guide_moves_delay_on_commit_to_the_outbox(
    tmp_path: Path, quickstart_project: Path
) -> None:
    """docs/migrating.md, "From delay / delay_on_commit to the outbox": its tasks and services
    in the quickstart's project; ``delay_in_outbox`` and ``apply_in_outbox`` write outbox rows,
    a relay sends them, a worker applies both, the late fee no earlier than its countdown after
    the commit."""
    require_service("redis")
    project = build(tmp_path, quickstart_project, DOCS / "migrating.md")
    queue = f"docs-migrating-{uuid.uuid4().hex[:8]}"
    add_setting(project, f"CELERY_TASK_DEFAULT_QUEUE = {queue!r}")
    env = environment()
    calls = (
        "import time\n"
        "from datetime import timedelta\n"
        "from orders.models import Order\n"
        "from orders.services import confirm, schedule_late_fee\n"
        "order = Order.objects.create(reference='A-1', amount_cents=1250)\n"
        "confirm(order)\n"
        "schedule_late_fee(order, after=timedelta(seconds=3))\n"
        "print(time.time())\n"
    )
    committed = float(run([PYTHON, "manage.py", "shell", "-c", calls], project, env).split()[-1])
    assert count(project, "django_idempotency_outboxentry") == 2
    run([PYTHON, "manage.py", "idempotency_relay", "--once"], project, env)
    with sqlite3.connect(project / "db.sqlite3") as db:
        states = db.execute("SELECT state FROM django_idempotency_outboxentry").fetchall()
    assert states == [("sent",), ("sent",)]  # Celery holds the late fee: it has its eta
    with process(celery_worker(queue), project) as worker:
        wait_for(lambda: count(project, "orders_ledgerentry") >= 1, "the ledger entry", worker)
        wait_for(lambda: count(project, "orders_ledgerentry") == 2, "the late fee", worker)
        applied = time.time()
    with sqlite3.connect(project / "db.sqlite3") as db:
        amounts = sorted(a for (a,) in db.execute("SELECT amount_cents FROM orders_ledgerentry"))
    assert amounts == [500, 1250]
    assert applied >= committed + 3


def test_the_flows_guide_answers_and_replays_the_ride(
    tmp_path: Path, quickstart_project: Path
) -> None:
    project = build(tmp_path, quickstart_project, DOCS / "flows.md")
    migrate(project)
    with server(project) as port:
        check_exchanges(DOCS / "flows.md", port, expected=1)
    assert count(project, "orders_ride") == 1
    assert count(project, "orders_receipt") == 1
    assert count(project, "django_idempotency_flowrun") == 1


def test_the_http_guide_ninja_section_replays_the_order(
    tmp_path: Path, quickstart_project: Path
) -> None:
    """docs/http.md's django-ninja section: its files in the quickstart project, its request
    sent twice to runserver (the answer shown, then its replay)."""
    pytest.importorskip("ninja")
    page = DOCS / "http.md"
    project = build(tmp_path, quickstart_project, page)
    text = page.read_text()
    start = text.index("## django-ninja")
    section = tmp_path / "ninja.md"
    section.write_text(text[start : text.index("\n## ", start)])
    local = exchanges(section)
    assert len(local) == 1
    with server(project) as port:
        for replay in (False, True):
            status, headers, body = send(local[0], port)
            assert status == local[0].status, body
            assert headers["Content-Type"] == local[0].headers["Content-Type"]
            assert (headers.get("Idempotent-Replayed") == "true") is replay
            assert json.loads(body) == json.loads(local[0].body)
    assert count(project, "orders_order") == 1


def test_the_dramatiq_guide_relays_to_a_real_worker_once(
    tmp_path: Path, quickstart_project: Path
) -> None:
    """docs/dramatiq.md in the quickstart project: the relay sends the confirmed order's event
    through DramatiqTransport, and ``dramatiq orders.actors`` applies it once."""
    pytest.importorskip("dramatiq")
    require_service("redis")
    page = DOCS / "dramatiq.md"
    project = build(tmp_path, quickstart_project, page)
    queue = f"docs-dramatiq-{uuid.uuid4().hex[:8]}"  # a queue of its own on the shared Redis
    for name in ("orders/actors.py", "orders/dramatiq_services.py"):
        path = project / name
        path.write_text(path.read_text().replace('"billing"', repr(queue)))
    migrate(project)
    env = environment()
    confirm = (
        "from orders.models import Order\n"
        "from orders.dramatiq_services import confirm\n"
        "print(confirm(Order.objects.create(reference='D-1', amount_cents=700)))\n"
    )
    run([PYTHON, "manage.py", "shell", "-c", confirm], project, env)
    run([PYTHON, "manage.py", "idempotency_relay", "--once"], project, env)
    with sqlite3.connect(project / "db.sqlite3") as db:
        state, event_id = db.execute(
            "SELECT state, event_id FROM django_idempotency_outboxentry"
        ).fetchone()
    assert state == "sent"
    worker = [PYTHON, "-m", "dramatiq", "orders.actors", "--processes", "1", "--threads", "1"]
    with process([*worker, "--queues", queue], project) as child:
        wait_for(lambda: count(project, "orders_ledgerentry") == 1, "the ledger entry", child)
    with sqlite3.connect(project / "db.sqlite3") as db:
        (ledger_event,) = db.execute("SELECT event_id FROM orders_ledgerentry").fetchone()
    assert ledger_event == event_id
    assert count(project, "orders_ledgerentry") == 1


def test_the_django_tasks_guide_enqueues_once_for_a_db_worker(
    tmp_path: Path, quickstart_project: Path
) -> None:
    pytest.importorskip("django_tasks_db")
    project = build(tmp_path, quickstart_project, DOCS / "django-tasks.md")
    migrate(project)
    with server(project) as port:
        check_exchanges(DOCS / "django-tasks.md", port, expected=1)
    assert count(project, "django_tasks_database_dbtaskresult") == 1  # the replay enqueued none
    run(
        [PYTHON, "manage.py", "db_worker", "--batch", "--no-reload", "--no-startup-delay"],
        project,
        environment(),
    )
    assert count(project, "orders_ledgerentry") == 1


def test_the_kafka_guide_relays_to_the_consumer(
    tmp_path: Path, quickstart_project: Path, kafka_cluster: Cluster
) -> None:
    project = build(tmp_path, quickstart_project, DOCS / "kafka.md")
    settings = project / "mysite" / "settings.py"
    text = settings.read_text()
    assert text.count("kafka-1:9092,kafka-2:9092") == 2
    settings.write_text(text.replace("kafka-1:9092,kafka-2:9092", kafka_cluster.bootstrap))
    migrate(project)
    env = environment()
    confirm = (
        "from orders.models import Order\n"
        "from orders.kafka_events import confirm\n"
        "print(confirm(Order.objects.create(reference='K-1', amount_cents=500)))\n"
    )
    event_id = run([PYTHON, "manage.py", "shell", "-c", confirm], project, env).split()[-1]
    run([PYTHON, "manage.py", "idempotency_relay", "--once"], project, env)
    args = [PYTHON, "manage.py", "idempotency_consume", "billing.ledger"]
    with process(args, project) as consumer:
        wait_for(lambda: count(project, "orders_ledgerentry") == 1, "the ledger entry", consumer)
    with sqlite3.connect(project / "db.sqlite3") as db:
        (ledger_event,) = db.execute("SELECT event_id FROM orders_ledgerentry").fetchone()
    assert ledger_event == event_id


@pytest.mark.parametrize("database", ["sqlite", "postgres"])
def test_the_testing_guide_tests_pass_in_the_quickstart_project(
    tmp_path: Path, quickstart_project: Path, database: str
) -> None:
    project = build(tmp_path, quickstart_project, DOCS / "testing.md")
    if database == "postgres":
        if not reachable("postgres"):
            pytest.skip("PostgreSQL does not answer")
        suffix = os.environ.get("TEST_DB_SUFFIX", "")
        add_setting(
            project,
            "DATABASES = {'default': {'ENGINE': 'django.db.backends.postgresql', "
            "'NAME': 'postgres', 'USER': 'postgres', 'HOST': '127.0.0.1', "
            f"'TEST': {{'NAME': 'test_docs_guide{suffix}'}}}}}}",
        )
    args = [PYTHON, "-m", "pytest", "orders/tests.py", "--ds=mysite.settings", "-p"]
    done = subprocess.run(
        [*args, "no:cacheprovider", "-rs", "--create-db"],
        cwd=project,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    passed = 5 if database == "postgres" else 4
    assert f"{passed} passed" in done.stdout, done.stdout


README = ROOT / "README.md"
#: What the README's sketch leaves out: the imports, the models, the Celery app.
README_IMPORTS = {
    "views.py": "from django.http import JsonResponse\n"
    "from django.views.decorators.csrf import csrf_exempt\n"
    "from orders.models import Payment\n",
    "tasks.py": "from mysite.celery import app\nfrom orders.models import LedgerEntry\n",
}
README_MODELS = """from django.db import models


class Payment(models.Model):
    amount_cents = models.PositiveIntegerField()


class LedgerEntry(models.Model):
    payment = models.ForeignKey(Payment, on_delete=models.CASCADE)
"""


def readme_sections() -> dict[str, str]:
    """The README's ten lines, split at their ``# file.py`` comments."""
    block = re.search(r"## Ten lines\n\n```python\n(.*?)^```", README.read_text(), re.S | re.M)
    assert block
    sections = re.split(r"^# (\S+\.py)\n", block[1], flags=re.M)
    return dict(zip(sections[1::2], sections[2::2], strict=True))


def test_the_readme_ten_lines_run(tmp_path: Path, quickstart_project: Path) -> None:
    require_service("redis")
    sections = readme_sections()
    assert sections["settings.py"].strip() == 'INSTALLED_APPS = [..., "django_idempotency"]'
    project = build(tmp_path, quickstart_project)  # its Celery app, orders app and settings
    (project / "orders" / "models.py").write_text(README_MODELS)
    (project / "orders" / "migrations" / "0001_initial.py").unlink()
    (project / "db.sqlite3").unlink()
    for name in ("views.py", "tasks.py"):
        (project / "orders" / name).write_text(README_IMPORTS[name] + sections[name])
    (project / "orders" / "api.py").unlink()  # the quickstart's DRF view of its own models
    (project / "mysite" / "urls.py").write_text(
        "from django.urls import path\n\nfrom orders.views import create_payment\n\n"
        'urlpatterns = [path("payments/", create_payment)]\n'
    )
    queue = f"docs-readme-{uuid.uuid4().hex[:8]}"
    add_setting(project, f"CELERY_TASK_DEFAULT_QUEUE = {queue!r}")
    migrate(project)
    with server(project) as port:
        for replay in (False, True):
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/payments/",
                data=b"amount_cents=1250",
                headers={"Idempotency-Key": "pay-1"},
                method="POST",
            )
            with urllib.request.urlopen(request, timeout=30) as response:
                assert response.status == 201
                assert json.loads(response.read()) == {"id": 1}
                assert (response.headers.get("Idempotent-Replayed") == "true") is replay
    assert count(project, "orders_payment") == 1
    deliver_twice = (
        "from orders.tasks import apply_payment\n"
        "for _ in range(2):\n"
        "    apply_payment.apply_async(kwargs={'event_id': 'payment-1', 'payment_id': 1})\n"
    )
    run([PYTHON, "manage.py", "shell", "-c", deliver_twice], project, environment())
    with process(celery_worker(queue), project) as worker:
        wait_for(lambda: "duplicate ignored" in output_of(worker), "the redelivery", worker)
    assert count(project, "orders_ledgerentry") == 1
    assert count(project, "django_idempotency_processedevent") == 1
