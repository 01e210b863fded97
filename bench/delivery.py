"""A relay process and a Celery worker over Redis, for the benches that time an event from its
COMMIT to its effect (:mod:`bench.latency`, :mod:`bench.celery_calls`).

The relay is ``manage.py idempotency_relay --poll-interval 1`` with one Celery transport to
:data:`bench.outbox.REDIS`; the worker is ``celery worker`` on a queue of its own; an effect is
the ``Effect`` row whose payload is the event id (``testproject.shop.tasks.effect``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.outbox import REDIS, queue


def start_relay(db_url: str, log: Path, tree: Path | None = None, **options: Any) -> Any:
    """A relay process, once it listens; ``options`` are its Celery transport's. From the tree
    ``tree`` (an older version, its code first on ``PYTHONPATH``) when given, else this one."""
    from tests.outbox_helpers import celery_transports
    from tests.outbox_helpers import start_relay as start_process

    where: dict[str, Any] = {}
    if tree is not None:
        where = {"cwd": tree, "env": {"PYTHONPATH": str(tree)}}
    relay = start_process(
        "--poll-interval", "1", db_url=db_url, transports=celery_transports(REDIS, **options),
        log=log, broker_url=REDIS, **where,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while "outbox relay started" not in relay.output():
        if time.monotonic() > deadline or relay.process.poll() is not None:
            raise RuntimeError(f"relay did not start:\n{relay.output()}")
        time.sleep(0.1)
    time.sleep(0.5)  # LISTEN is issued right after the line above
    return relay


@contextmanager
def redis_worker(label: str, db_url: str, tmp: Path, **options: Any) -> Iterator[tuple[str, Any]]:
    """A Celery worker on a new Redis queue, ready: the queue's name and the worker, stopped
    (and the queue deleted) after. ``options`` go to ``tests.workers.start_worker``."""
    from tests.workers import start_worker, stop_workers, wait_ready

    with queue(REDIS, label) as name:
        worker = start_worker(
            broker_url=REDIS, queue=name, db_url=db_url, name=label, log_dir=tmp, **options
        )
        try:
            wait_ready([worker])
            yield name, worker
        finally:
            stop_workers([worker])


def wait_for_effects(
    ids: Sequence[str],
    worker: Any,
    timeout: float,
    pending: Callable[[], bool] = lambda: False,
) -> None:
    """Wait until every event of ``ids`` has its effect (and ``pending()`` is false)."""
    from testproject.shop.models import Effect

    deadline = time.monotonic() + timeout
    while Effect.objects.filter(payload__in=ids).count() < len(ids) or pending():
        if time.monotonic() > deadline:
            raise RuntimeError(f"effects missing\n{worker.output()[-3000:]}")
        time.sleep(0.2)
