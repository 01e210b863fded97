"""Django tasks of the poison proof (tests/test_django_tasks_poison.py): consumers that fail in
the ways a message can make one fail. Each parks after ``max_deliveries=2``; the failing ones
run only in a ``db_worker``."""

from __future__ import annotations

import os
from typing import Any

from django_idempotency.events.django_tasks import idempotent_task
from testproject.shop.models import Effect

try:
    from django.tasks.base import task  # Django 6.0+
except ImportError:  # Django 5.2 with the django-tasks backport
    from django_tasks.base import task


class Boom(Exception):
    """What ``raises`` raises on every run."""


@task()
@idempotent_task("events.tasks.apply", max_deliveries=2)
def apply(event_id: Any = None, payload: Any = None) -> str:
    """A healthy consumer: one Effect per event, holding the payload (cut to 200 characters)."""
    Effect.objects.create(
        name="events.tasks.apply", payload=event_id if payload is None else str(payload)[:200]
    )
    return "applied"


@task()
@idempotent_task("events.tasks.raises", max_deliveries=2)
def raises(event_id: str) -> str:
    Effect.objects.create(name="events.tasks.raises", payload=event_id)
    raise Boom(f"{event_id} always fails")


@task()
@idempotent_task("events.tasks.exits", max_deliveries=2)
def exits(event_id: str) -> str:
    """End the worker mid-transaction, as a segfault or the OOM killer would."""
    Effect.objects.create(name="events.tasks.exits", payload=event_id)
    os._exit(1)
