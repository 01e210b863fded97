"""Poison messages against a real Celery worker on Redis: the loop goes on.

One parametrised proof feeds the worker, between healthy messages, a message that raises on
every delivery, one that ends its pool child (``os._exit``), one that hangs past its hard time
limit, huge ones, a deeply nested one, and ones with a lone surrogate or a NUL in the event id
or the payload. Each healthy message is applied exactly once; each poison message is parked
(where the admin lists parked deliveries) after at most ``max_deliveries`` runs, with nothing
of it applied. The consumers live in ``tests/poison_worker_app.py``; each parks after
``max_deliveries=2``.

A second proof SIGKILLs the whole worker (not a pool child) mid-task, twice, on Redis with a
short visibility timeout: kombu restores the message and flags it redelivered, so its count
goes on although the broker vouched for its first delivery, and a third worker parks it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from django.db import connection

from django_idempotency import new_event_id
from django_idempotency.events.core import MISSING_ID_PREFIX
from django_idempotency.models import EventDelivery, ProcessedEvent
from testproject.shop.models import Effect
from tests.conftest import require_service
from tests.services import BROKER_URLS
from tests.workers import (
    RESULT_BACKEND,
    Worker,
    delete_queue,
    new_queue_name,
    spawn,
    stop_workers,
    wait_ready,
)

pytestmark = [
    pytest.mark.slow,
    # Real workers on a real broker: the core they run parks the same way on every backend
    # (the per-backend SQL of counting and parking is proven in tests/test_delivery_count.py).
    # MariaDB's pass has the room: PostgreSQL's carries most of the PostgreSQL-only proofs.
    pytest.mark.mysql,
    pytest.mark.timeout(300),
    pytest.mark.django_db(transaction=True),
]

MAX_DELIVERIES = 2  # every consumer of tests/poison_worker_app.py
OUTCOME_TIMEOUT = 90.0


def start(queue: str, log_dir: Path, name: str, env: dict[str, str] | None = None) -> Worker:
    """One ``celery worker`` of the poison app (prefork, 2 children) on ``queue``."""
    command = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "tests.poison_worker_app",
        "worker",
        "-P",
        "prefork",
        "-c",
        "2",
        "-Q",
        queue,
        "-n",
        f"{name}@%h",
        "--prefetch-multiplier",
        "1",
        "--without-heartbeat",
        "--without-gossip",
        "--without-mingle",
        "-l",
        "INFO",
    ]
    environ = {
        "CELERY_BROKER_URL": BROKER_URLS["redis"],
        "CELERY_RESULT_BACKEND": RESULT_BACKEND,
        "CELERY_TASK_ALWAYS_EAGER": "false",
        **(env or {}),
    }
    db_url = _database_url()
    log = log_dir / f"{name}.log"
    return Worker(name, spawn(command, db_url=db_url, log=log, env=environ), log)


def _database_url() -> str:
    from tests.workers import database_url

    return database_url(connection.settings_dict)


@contextmanager
def publisher() -> Iterator[Celery]:
    app = Celery("poison-publisher", broker=BROKER_URLS["redis"], set_as_current=False)
    app.conf.update(task_create_missing_queues=True, broker_connection_retry=False)
    try:
        yield app
    finally:
        app.close()


def wait_for(what: str, condition: Callable[[], bool], workers: list[Worker]) -> None:
    deadline = time.monotonic() + OUTCOME_TIMEOUT
    while not condition():
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {w.name} ---\n{w.output()[-6000:]}" for w in workers)
            pytest.fail(f"{what} not within {OUTCOME_TIMEOUT}s\n{logs}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def poison_worker(
    django_db_setup: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Worker, str]]:
    require_service("redis")
    queue = new_queue_name("events-poison")
    worker = start(queue, tmp_path_factory.mktemp("poison"), f"poison-{uuid.uuid4().hex[:6]}")
    try:
        wait_ready([worker])
        yield worker, queue
    finally:
        stop_workers([worker])
        delete_queue(BROKER_URLS["redis"], queue)


def nested(depth: int) -> Any:
    value: Any = "bottom"
    for _ in range(depth):
        value = [value]
    return value


PARKED, NO_ID, APPLIED = "parked", "parked without an id", "applied once"

NESTED_LIMIT = """A message nested about 500 levels deep kills the prefork worker's main process:
billiard pickles the task's arguments for the pool child and raises RecursionError, the worker
shuts down and restores the message, and the next worker dies on it too. No consumer code has
run by then, so the consumer cannot park it; the producer has to refuse such a payload."""

# kind: (task, kwargs but the event id, the event id or None, outcome)
POISON: dict[str, tuple[str, dict[str, Any], str | None, str]] = {
    "raises": ("events.poison.raises", {}, "", PARKED),
    "exits": ("events.poison.exits", {}, "", PARKED),
    "hangs": ("events.poison.hangs", {}, "", PARKED),
    "huge-without-id": ("events.poison.apply", {"payload": "x" * 4_000_000}, None, NO_ID),
    "huge": ("events.poison.apply", {"payload": ["y" * 1000] * 4000}, "", APPLIED),
    # 100 levels. At 500 the worker's main process dies pickling the arguments for its pool
    # child (RecursionError in billiard), before any consumer code runs: see NESTED_LIMIT.
    "nested": ("events.poison.apply", {"payload": nested(100)}, "", APPLIED),
    "surrogate-id": ("events.poison.apply", {}, "\ud800", NO_ID),
    "nul-id": ("events.poison.apply", {}, "\x00", NO_ID),
    "surrogate-payload": ("events.poison.apply", {"payload": "\udfff-payload"}, "", PARKED),
    # PostgreSQL refuses a NUL in text; MariaDB and SQLite store it.
    "nul-payload": ("events.poison.apply", {"payload": "nul\x00payload"}, "", "nul"),
}


@pytest.mark.parametrize("kind", sorted(POISON))
def test_a_poison_message_is_parked_and_the_healthy_ones_are_applied_once(
    poison_worker: tuple[Worker, str], kind: str
) -> None:
    worker, queue = poison_worker
    task, kwargs, suffix, outcome = POISON[kind]
    if outcome == "nul":
        outcome = PARKED if connection.vendor == "postgresql" else APPLIED
    base = str(new_event_id())
    event_id = None if suffix is None else base + suffix
    healthy = [str(new_event_id()) for _ in range(2)]
    with publisher() as app:
        app.send_task("events.poison.apply", kwargs={"event_id": healthy[0]}, queue=queue)
        message_kwargs = dict(kwargs) if event_id is None else {**kwargs, "event_id": event_id}
        sent = app.send_task(task, kwargs=message_kwargs, queue=queue)
        app.send_task("events.poison.apply", kwargs={"event_id": healthy[1]}, queue=queue)

    def applied(event: str) -> bool:
        return ProcessedEvent.objects.filter(consumer=task, event_id=event).exists()

    consumer = task
    parked_id = event_id if outcome == PARKED else f"{MISSING_ID_PREFIX}{sent.id}"

    def parked() -> bool:
        return EventDelivery.objects.filter(
            consumer=consumer, event_id=parked_id, parked_at__isnull=False
        ).exists()

    def settled() -> bool:
        healthy_done = all(
            ProcessedEvent.objects.filter(consumer="events.poison.apply", event_id=h).exists()
            for h in healthy
        )
        poison_done = applied(str(event_id)) if outcome == APPLIED else parked()
        return healthy_done and poison_done

    wait_for(f"{kind}: the healthy messages and the poison's outcome", settled, [worker])

    for event in healthy:
        assert Effect.objects.filter(name="events.poison.apply", payload=event).count() == 1
    if outcome == APPLIED:
        stored = str(kwargs["payload"])[:200]
        assert Effect.objects.filter(name=task, payload=stored).count() == 1
        assert ProcessedEvent.objects.filter(consumer=task, event_id=event_id).count() == 1
        assert not EventDelivery.objects.filter(consumer=task, parked_at__isnull=False).exists()
    else:
        delivery = EventDelivery.objects.get(consumer=consumer, event_id=parked_id)
        assert delivery.parked_at is not None
        # Parked within its limit, the autoretrying consumer too: its retry (countdown 0) is
        # published only after the failed delivery has counted, so the worker's other pool
        # child never runs it alongside (tests/test_celery_worker.py races it).
        assert delivery.deliveries <= MAX_DELIVERIES + 1
        if event_id is not None and outcome == PARKED:
            assert not ProcessedEvent.objects.filter(consumer=task, event_id=event_id).exists()
        if outcome == NO_ID:
            assert "EventId" in delivery.last_error  # MissingEventId or InvalidEventId
            assert len(delivery.last_error) <= 2000  # a huge message's preview is cut
    assert worker.process.poll() is None  # the loop went on
    # The poison's rows are the only ones of its kind: nothing applied it behind our back.
    if outcome == PARKED and "payload" not in kwargs:
        assert not Effect.objects.filter(name=task, payload=event_id).exists()


def test_a_message_whose_whole_worker_is_sigkilled_twice_on_redis_is_parked(
    django_db_setup: None, tmp_path: Path
) -> None:
    """Redis vouches for a first delivery (no count), so parking relies on kombu flagging the
    restored copies: each SIGKILL of the whole worker leaves the message unacked, the next
    worker restores it after the visibility timeout with ``redelivered`` set, and it counts."""
    require_service("redis")
    queue = new_queue_name("events-sigkill")
    markers = tmp_path / "markers"
    markers.mkdir()
    env = {"EVENTS_VISIBILITY_TIMEOUT": "2", "EVENTS_UNACKED_PREFIX": queue}
    event_id = str(new_event_id())
    started: list[Worker] = []

    def new_worker() -> Worker:
        worker = start(queue, tmp_path, f"sigkill{len(started)}-{uuid.uuid4().hex[:6]}", env)
        started.append(worker)
        wait_ready([worker])
        return worker

    try:
        worker = new_worker()
        with publisher() as app:
            app.send_task(
                "events.poison.holds",
                kwargs={"event_id": event_id, "marker_dir": str(markers)},
                queue=queue,
            )
        for death in (1, 2):
            wait_for(
                f"delivery {death} running",
                lambda death=death: len(list(markers.iterdir())) >= death,  # type: ignore[misc]
                started,
            )
            os.killpg(worker.process.pid, signal.SIGKILL)  # the worker and its pool children
            worker.process.wait(10)
            worker = new_worker()

        def parked() -> bool:
            return EventDelivery.objects.filter(
                consumer="events.poison.holds", event_id=event_id, parked_at__isnull=False
            ).exists()

        wait_for("the event parked by the third worker", parked, started)
        delivery = EventDelivery.objects.get(consumer="events.poison.holds", event_id=event_id)
        # First delivery vouched for (no count), the second counted for both, the third parked.
        assert delivery.deliveries == MAX_DELIVERIES + 1
        assert len(list(markers.iterdir())) == MAX_DELIVERIES  # the body ran twice, no more
        assert not ProcessedEvent.objects.filter(consumer="events.poison.holds").exists()
        assert not Effect.objects.filter(name="events.poison.holds").exists()

        healthy = str(new_event_id())
        with publisher() as app:
            app.send_task("events.poison.apply", kwargs={"event_id": healthy}, queue=queue)
        wait_for(
            "a healthy message after the parking",
            lambda: Effect.objects.filter(payload=healthy).exists(),
            started,
        )
        assert worker.process.poll() is None
    finally:
        with suppress(Exception):
            stop_workers(started)
        delete_queue(BROKER_URLS["redis"], queue)
