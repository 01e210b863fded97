"""The Celery app of the poison proofs (tests/test_consumer_poison.py): the worker tests' app
with consumers that fail in every way a message can make a consumer fail.

Each consumer parks after ``max_deliveries=2``. ``EVENTS_VISIBILITY_TIMEOUT`` (seconds) sets
the Redis transport's visibility timeout, so that a message whose whole worker was SIGKILLed
comes back within the test instead of after an hour; ``EVENTS_UNACKED_PREFIX`` then names the
transport's bookkeeping keys.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import django
from django.db import DatabaseError

from tests.worker_app import app

django.setup()  # the consumers below import models: Celery loads this module before Django

from django_idempotency.events.celery import IdempotentConsumer  # noqa: E402
from testproject.shop.models import Effect  # noqa: E402

if os.environ.get("EVENTS_VISIBILITY_TIMEOUT"):
    prefix = os.environ["EVENTS_UNACKED_PREFIX"]
    app.conf.broker_transport_options = {
        "visibility_timeout": float(os.environ["EVENTS_VISIBILITY_TIMEOUT"]),
        # Look for expired messages every second, not every 10 x 10 seconds.
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        # Keys of this test's own: a worker SIGKILLed while it scans keeps the scan's mutex
        # until it expires (300 s by default), which would hold back every other worker on
        # the server; and other tests' unacked messages are none of this test's business.
        "unacked_key": f"{prefix}-unacked",
        "unacked_index_key": f"{prefix}-unacked-index",
        "unacked_mutex_key": f"{prefix}-unacked-mutex",
        "unacked_mutex_expire": 5,
    }


class Boom(Exception):
    """What ``events.poison.raises`` raises every time."""


def _effect(task: IdempotentConsumer, payload: Any = None) -> None:
    text = task.request.event_id if payload is None else str(payload)[:200]
    Effect.objects.create(name=task.name, payload=text)


@app.task(
    base=IdempotentConsumer,
    bind=True,
    name="events.poison.apply",
    max_deliveries=2,
    autoretry_for=(DatabaseError, UnicodeError, ValueError),
    max_retries=10,
    default_retry_delay=0,
)
def apply(self: IdempotentConsumer, event_id: Any = None, payload: Any = None) -> str:
    """A healthy consumer: one Effect per event, holding the payload (cut to 200 characters).

    A payload the database cannot store (a lone surrogate anywhere, a NUL on PostgreSQL) makes
    the write raise; autoretry then delivers it again until it is parked.
    """
    _effect(self, payload)
    return "applied"


@app.task(
    base=IdempotentConsumer,
    bind=True,
    name="events.poison.raises",
    max_deliveries=2,
    autoretry_for=(Boom,),
    max_retries=10,
    default_retry_delay=0,
)
def raises(self: IdempotentConsumer, event_id: str) -> str:
    """Raise every time; autoretry delivers it again until it is parked."""
    _effect(self)
    raise Boom(f"{event_id} always fails")


@app.task(base=IdempotentConsumer, bind=True, name="events.poison.exits", max_deliveries=2)
def exits(self: IdempotentConsumer, event_id: str) -> str:
    """End the pool child mid-transaction, as a segfault or the OOM killer would."""
    _effect(self)
    os._exit(1)


@app.task(
    base=IdempotentConsumer,
    bind=True,
    name="events.poison.hangs",
    max_deliveries=2,
    time_limit=2,
)
def hangs(self: IdempotentConsumer, event_id: str) -> str:
    """Hang past the hard time limit, which kills the pool child."""
    _effect(self)
    time.sleep(60)
    return "unreachable"


@app.task(base=IdempotentConsumer, bind=True, name="events.poison.holds", max_deliveries=2)
def holds(self: IdempotentConsumer, event_id: str, marker_dir: str) -> str:
    """Say which worker runs it (a file named after the worker's pid), then hold until killed."""
    _effect(self)
    Path(marker_dir, f"{os.getppid()}-{time.monotonic_ns()}").touch()
    time.sleep(120)
    return "unreachable"


__all__ = ["app"]
