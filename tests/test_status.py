"""``manage.py idempotency_status``: its figures, its output and every exit code."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, transaction
from django.utils import timezone

from django_idempotency.events.core import process_event
from django_idempotency.exceptions import EventParked
from django_idempotency.models import FlowRun, IdempotencyRecord, OutboxEntry
from django_idempotency.outbox import core as outbox
from django_idempotency.status import collect
from tests.workers import REPO, database_url

#: A bound on a real process's run, not a timing: the version-matrix lanes run at nice 19 beside
#: the main pass, and a Django start-up there can take minutes of wall time.
PROCESS_TIMEOUT = 600

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("null_default_transport"),  # topic messages, no Celery task call
]


def status(*args: str) -> tuple[int, str]:
    """Run the command; (exit code, stdout)."""
    out = StringIO()
    try:
        call_command("idempotency_status", *args, stdout=out)
    except SystemExit as exc:
        return int(exc.code or 0), out.getvalue()
    except CommandError as exc:
        return exc.returncode, out.getvalue() + str(exc)
    return 0, out.getvalue()


def record(key: str, *, state: str = "in_progress", lease: timedelta | None = None) -> Any:
    return IdempotencyRecord.objects.create(
        owner="o",
        key=key,
        fingerprint="f",
        method="POST",
        path="/p",
        state=state,
        locked_until=None if lease is None else timezone.now() + lease,
        expires_at=timezone.now() + timedelta(days=1),
    )


def pending(count: int, age: timedelta = timedelta(0)) -> None:
    with transaction.atomic():
        for n in range(count):
            outbox.send("status.topic", {"n": n})
    OutboxEntry.objects.update(created_at=timezone.now() - age)


def test_an_empty_database_is_healthy() -> None:
    code, out = status("--max-lag", "60", "--fail-on-parked", "--max-abandoned-flows", "0")
    assert code == 0
    assert "outbox oldest pending   none" in out
    assert out.rstrip().endswith("OK")


def test_the_figures() -> None:
    record("a")  # in progress, atomic mode: no lease
    record("b", lease=timedelta(minutes=5))  # a live lease
    record("c", lease=timedelta(minutes=-5))  # a lease that ran out
    record("d", state="completed")
    FlowRun.objects.create(record=record("e", lease=timedelta(minutes=-1)), flow="m:f")
    pending(3, age=timedelta(minutes=2))
    OutboxEntry.objects.filter(pk=OutboxEntry.objects.order_by("-id")[0].pk).update(state="parked")
    event = str(uuid.uuid4())
    for _ in range(2):
        with pytest.raises((RuntimeError, EventParked)):
            process_event("c.status", event, _fail, max_deliveries=1)
    figures = collect()
    assert (
        figures.records_in_progress,
        figures.live_leases,
        figures.outbox_pending,
        figures.outbox_parked,
        figures.deliveries_parked,
        figures.flows_abandoned,
    ) == (4, 1, 2, 1, 1, 1)
    assert figures.outbox_oldest_pending_seconds is not None
    assert 110 <= figures.outbox_oldest_pending_seconds < 3600
    assert figures.estimated == ()
    code, out = status("--json")
    assert code == 0
    data = json.loads(out)
    assert data["outbox_pending"] == 2 and data["problems"] == []


def _fail() -> None:
    raise RuntimeError("fails on purpose")


def test_over_the_limit_a_count_is_flagged_as_an_estimate() -> None:
    pending(5)
    figures = collect(limit=2)
    assert figures.outbox_pending >= 3
    assert figures.estimated == ("outbox_pending",)
    assert collect(limit=5).outbox_pending == 5


def test_lag_over_the_threshold_exits_1() -> None:
    pending(1, age=timedelta(minutes=10))
    assert status("--max-lag", "3600")[0] == 0
    code, out = status("--max-lag", "60")
    assert code == 1
    assert "PROBLEM: outbox lag" in out
    code, out = status("--max-lag", "60", "--json")
    assert code == 1 and "--max-lag" in json.loads(out)["problems"][0]


def test_a_parked_outbox_message_exits_1_with_fail_on_parked() -> None:
    pending(1)
    OutboxEntry.objects.update(state="parked")
    assert status()[0] == 0
    code, out = status("--fail-on-parked")
    assert code == 1 and "1 parked outbox message" in out


def test_a_parked_delivery_exits_1_with_fail_on_parked() -> None:
    event = str(uuid.uuid4())
    for _ in range(2):
        with pytest.raises((RuntimeError, EventParked)):
            process_event("c.status", event, _fail, max_deliveries=1)
    code, out = status("--fail-on-parked")
    assert code == 1 and "1 parked event delivery" in out


def test_abandoned_flow_runs_over_the_threshold_exit_1() -> None:
    for key in ("x", "y"):
        FlowRun.objects.create(record=record(key, lease=timedelta(minutes=-1)), flow="m:f")
    assert status("--max-abandoned-flows", "2")[0] == 0
    code, out = status("--max-abandoned-flows", "1")
    assert code == 1 and "2 abandoned flow run(s)" in out


def test_an_unknown_database_exits_2() -> None:
    code, out = status("--database", "nope")
    assert code == 2 and "Unknown database alias 'nope'" in out


@pytest.mark.parametrize(
    "args",
    [
        ["--max-lag", "soon"],
        ["--max-lag", "-1"],
        ["--max-lag", "nan"],
        ["--max-abandoned-flows", "-2"],
    ],
)
def test_a_bad_option_exits_2(args: list[str]) -> None:
    """argparse's own usage error, from a real process: exit code 2 and the option named."""
    done = subprocess.run(
        [sys.executable, "manage.py", "idempotency_status", *args],
        cwd=REPO,
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(REPO),
            "DATABASE_URL": database_url(connection.settings_dict),
        },
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert args[0] in done.stderr


def test_a_real_process_exits_1_on_a_threshold() -> None:
    pending(1, age=timedelta(minutes=10))
    done = subprocess.run(
        [sys.executable, "manage.py", "idempotency_status", "--max-lag", "1", "--json"],
        cwd=REPO,
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(REPO),
            "DATABASE_URL": database_url(connection.settings_dict),
        },
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    assert json.loads(done.stdout)["outbox_pending"] == 1


def test_the_admin_stats_count_in_progress_and_live_leases_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from django_idempotency import managers

    record("a")
    record("b", lease=timedelta(minutes=5))
    assert IdempotencyRecord.objects.stats().counts == {"in_progress": 2, "live_leases": 1}
    monkeypatch.setattr(managers.bounded_count, "__defaults__", (1,))
    counts = IdempotencyRecord.objects.stats().counts
    assert counts["in_progress"] >= 2 and counts["live_leases"] == 1
