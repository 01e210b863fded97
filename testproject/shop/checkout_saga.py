"""A three-step checkout saga across Celery tasks: reserve stock, charge, ship.

Each step is a task that runs its effect through :class:`~django_idempotency.flows.sagas.Saga`,
keyed
by ``(saga id, step)``, then publishes the next step. When a step fails for good, the task
publishes the compensations of every step up to the failed one, newest first; each
compensation is a task of its own, just as idempotent, and does nothing for a step that did not
happen (the failed step's own compensation shows that).

The effects are :class:`~testproject.shop.models.Effect` rows named ``saga.<step>`` and
``saga.<step>.compensate``, with the saga id as payload, so the tests can count them.

``plan`` travels with every message: ``{"fail_at": step or None, "queue": name or None,
"crash": {"at": step or "<step>.compensate", "when": "before_commit" | "after_commit",
"marker": path} or None}``. A crash SIGKILLs the worker process once (the marker file remembers
it); the killing tasks refuse to run eagerly.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from celery import Task, shared_task
from django.db import transaction

from django_idempotency.flows.sagas import CANCELLED, Saga
from testproject.shop.models import Effect

SAGA = "checkout"
STEPS = ("reserve_stock", "charge", "ship")
TASK_OPTIONS: dict[str, Any] = {"bind": True, "acks_late": True, "reject_on_worker_lost": True}


class StepFailed(Exception):
    """A step failed for good (no stock, card declined, no courier)."""


def _crash(task: Task[Any, Any], plan: dict[str, Any], point: str) -> None:
    crash = plan.get("crash") or {}
    if crash.get("at") != point:
        return
    if task.request.is_eager or task.request.called_directly:
        raise RuntimeError("the crash points kill their worker process; never eagerly")

    def kill() -> None:
        try:
            Path(crash["marker"]).touch(exist_ok=False)
        except FileExistsError:
            return
        os.kill(os.getpid(), signal.SIGKILL)

    if crash["when"] == "before_commit":
        kill()
    else:
        transaction.on_commit(kill)


def _publish(task: Any, args: list[Any], plan: dict[str, Any]) -> None:
    task.apply_async(args=args, queue=plan.get("queue"))


# --8<-- [start:saga]
def _run_step(task: Task[Any, Any], saga_id: str, step: str, plan: dict[str, Any]) -> str:
    saga = Saga(SAGA, saga_id)

    def effect() -> None:
        if plan.get("fail_at") == step:
            raise StepFailed(f"{step} failed for saga {saga_id}")
        Effect.objects.create(name=f"saga.{step}", payload=saga_id)
        _crash(task, plan, step)

    try:
        outcome = saga.step(step, effect)
    except StepFailed:
        for done in reversed(STEPS[: STEPS.index(step) + 1]):
            _publish(compensate, [saga_id, done, plan], plan)
        return "failed"
    if outcome.status == CANCELLED:
        return "cancelled"
    # Publish the next step on a duplicate too: a worker may have died after the commit and
    # before publishing. The next step is keyed, so publishing it twice is harmless.
    index = STEPS.index(step)
    if index + 1 < len(STEPS):
        _publish(STEP_TASKS[STEPS[index + 1]], [saga_id, plan], plan)
    return outcome.status


@shared_task(name="shop.saga.reserve_stock", **TASK_OPTIONS)
def reserve_stock(self: Task[Any, Any], saga_id: str, plan: dict[str, Any]) -> str:
    return _run_step(self, saga_id, "reserve_stock", plan)


@shared_task(name="shop.saga.charge", **TASK_OPTIONS)
def charge(self: Task[Any, Any], saga_id: str, plan: dict[str, Any]) -> str:
    return _run_step(self, saga_id, "charge", plan)


@shared_task(name="shop.saga.ship", **TASK_OPTIONS)
def ship(self: Task[Any, Any], saga_id: str, plan: dict[str, Any]) -> str:
    return _run_step(self, saga_id, "ship", plan)


@shared_task(name="shop.saga.compensate", **TASK_OPTIONS)
def compensate(self: Task[Any, Any], saga_id: str, step: str, plan: dict[str, Any]) -> str:
    def undo() -> None:
        Effect.objects.create(name=f"saga.{step}.compensate", payload=saga_id)
        _crash(self, plan, f"{step}.compensate")

    return Saga(SAGA, saga_id).compensate(step, undo).status


# --8<-- [end:saga]


STEP_TASKS = {"reserve_stock": reserve_stock, "charge": charge, "ship": ship}


def start(saga_id: str, plan: dict[str, Any]) -> None:
    """Start a checkout saga: publish its first step."""
    _publish(reserve_stock, [saga_id, plan], plan)
