"""The checkout saga on real Celery workers, SIGKILLed at every step and compensation.

Each saga of ``testproject/shop/checkout_saga.py`` runs across four kinds of task (reserve
stock, charge, ship, compensate). For every step and every compensation that runs, one saga
kills its worker process with SIGKILL there, once: before the step's transaction commits, or
after it commits and before the message is acknowledged (and before the next step is
published). The message is redelivered (``acks_late``, ``reject_on_worker_lost``). In the end
every step and every compensation has taken effect exactly once, and the compensation of the
step that failed (shipping) never ran.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from django_idempotency.models import ProcessedEvent
from testproject.shop.checkout_saga import STEPS
from testproject.shop.models import Effect
from tests.conftest import require_service
from tests.services import BROKER_URLS
from tests.workers import WorkerGroup, database_url, worker_group

pytestmark = [
    pytest.mark.slow,
    pytest.mark.postgres,
    pytest.mark.mysql,
    pytest.mark.timeout(600),  # above the sum of its guards against a hang
    pytest.mark.django_db(transaction=True),
]

DEADLINE = 120.0
WHEN = ("before_commit", "after_commit")
SUCCEEDS = {**{f"saga.{step}": 1 for step in STEPS}, **{f"saga.{s}.compensate": 0 for s in STEPS}}
SHIPPING_FAILS = {
    "saga.reserve_stock": 1,
    "saga.charge": 1,
    "saga.ship": 0,
    "saga.reserve_stock.compensate": 1,
    "saga.charge.compensate": 1,
    "saga.ship.compensate": 0,
}


@pytest.fixture(params=sorted(BROKER_URLS))
def group(
    request: pytest.FixtureRequest, django_db_setup: None, tmp_path: Path
) -> Iterator[WorkerGroup]:
    """One worker (two processes) on Redis and on RabbitMQ; RabbitMQ in the PostgreSQL pass."""
    if connection.vendor == "mysql" and request.param != "redis":
        pytest.skip("MariaDB pass: the saga proof runs on Redis only, as the worker proofs do")
    require_service(request.param)
    require_service("redis")  # the result backend
    with worker_group(
        broker_url=BROKER_URLS[request.param],
        db_url=database_url(connection.settings_dict),
        log_dir=tmp_path,
        label="saga",
        workers=1,
        concurrency=2,
    ) as running:
        yield running


def counts(saga_id: str) -> dict[str, int]:
    return {name: Effect.objects.filter(name=name, payload=saga_id).count() for name in SUCCEEDS}


def finished(saga_id: str, fails: bool) -> bool:
    """Every step and compensation this saga will ever run has committed its reservation."""
    names = [f"saga:checkout:{step}.compensate" for step in STEPS] if fails else []
    names += [] if fails else ["saga:checkout:ship"]
    found = ProcessedEvent.objects.filter(event_id=saga_id, consumer__in=names).count()
    return found == len(names)


def killed(group: WorkerGroup) -> int:
    """Worker processes that died of SIGKILL, as their parent logged it."""
    return sum(w.output().count("exited with 'signal 9 (SIGKILL)'") for w in group.workers)


def test_every_step_and_compensation_runs_once_through_sigkills(
    group: WorkerGroup, tmp_path: Path
) -> None:
    sagas: list[tuple[str, bool, dict[str, Any]]] = []
    points = [(step, False) for step in STEPS]
    points += [(step, True) for step in ("reserve_stock", "charge")]
    points += [(f"{step}.compensate", True) for step in ("reserve_stock", "charge")]
    for point, fails in points:
        for when in WHEN:
            saga_id = str(uuid.uuid4())
            marker = tmp_path / f"{saga_id}.killed"
            crash = {"at": point, "when": when, "marker": str(marker)}
            plan = {"fail_at": "ship" if fails else None, "queue": group.queue, "crash": crash}
            sagas.append((saga_id, fails, plan))
            group.publish("shop.saga.reserve_stock", args=[saga_id, plan])

    deadline = time.monotonic() + DEADLINE
    while not (
        all(finished(saga_id, fails) for saga_id, fails, _ in sagas)
        and killed(group) == len(sagas)  # the parent logs each lost child a moment later
    ):
        assert time.monotonic() < deadline, f"sagas unfinished after {DEADLINE}s\n{group.logs()}"
        time.sleep(0.2)

    for saga_id, fails, plan in sagas:
        assert Path(plan["crash"]["marker"]).exists(), f"no SIGKILL at {plan['crash']}"
        assert counts(saga_id) == (SHIPPING_FAILS if fails else SUCCEEDS), plan["crash"]
    assert killed(group) == len(sagas)
