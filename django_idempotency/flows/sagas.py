"""Saga steps and compensations that take effect once, across messages and workers.

A saga is a business transaction split into steps that run in different messages (Celery tasks,
Kafka events), each with a compensation that undoes it. Every step is keyed by
``(saga id, step name)`` and every compensation by ``(saga id, step name + ".compensate")``; each
reserves its key with :func:`~django_idempotency.events.core.try_reserve` **in the same
transaction as
its effect**, so a redelivered message never applies a step or a compensation twice, and a
process that dies mid-step leaves no reservation behind.

A compensation never runs for a step that did not happen. Before it runs, it tries to reserve
the *step's* key itself:

* if that succeeds, the step never committed: the reservation now stands in for it (a
  tombstone, told apart by its topic, ``"<saga name> (cancelled)"``), so a late or redelivered
  step message finds it taken and is skipped as ``cancelled``, and the compensation's body
  does not run;
* if the step's key is taken, the step happened (or is committing: the insert waits for that
  transaction and sees its outcome), and the compensation runs once.

.. code-block:: python

    saga = Saga("checkout", order.saga_id)
    outcome = saga.step("charge", lambda: Payment.objects.create(...))
    ...
    saga.compensate("charge", lambda: Refund.objects.create(...))
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Generic, TypeVar

from django.db import transaction

from django_idempotency.conf import conf
from django_idempotency.events.core import EventId, normalize_event_id, try_reserve
from django_idempotency.exceptions import log_text
from django_idempotency.models import ProcessedEvent

__all__ = ["Saga", "StepOutcome"]

logger = logging.getLogger("django_idempotency")

T = TypeVar("T")

APPLIED = "applied"
DUPLICATE = "duplicate"
CANCELLED = "cancelled"
NOT_NEEDED = "not_needed"


@dataclass(frozen=True)
class StepOutcome(Generic[T]):
    """What a step or a compensation did."""

    status: str
    """``applied`` (the body ran and committed), ``duplicate`` (it had run before),
    ``cancelled`` (a step whose compensation came first: it will never run), or
    ``not_needed`` (a compensation of a step that did not happen)."""
    result: T | None = None

    @property
    def applied(self) -> bool:
        return self.status == APPLIED


class Saga:
    """The steps of one saga instance, keyed by its id.

    :param name: the saga's stable name (``"checkout"``); part of every consumer name, so it
        must not change while sagas are in flight.
    :param saga_id: this instance's id, a ``str`` or :class:`uuid.UUID`, carried by every
        message of the saga.
    :param using: the database alias of the business data; default ``DATABASE``.
    :param ttl: how long reservations are kept; default ``EVENT_TTL``. It must outlast the
        longest time a message of the saga can still arrive.
    """

    def __init__(
        self,
        name: str,
        saga_id: EventId,
        *,
        using: str | None = None,
        ttl: timedelta | None = None,
    ) -> None:
        if not isinstance(name, str) or not name.strip() or ":" in name:
            raise ValueError(f"A saga name is a non-empty string without ':', not {name!r}.")
        self.name = name
        self.saga_id = normalize_event_id(saga_id)
        self.using = using or conf.DATABASE
        self.ttl = ttl

    def consumer(self, step: str) -> str:
        """The consumer name that reserves ``step`` (``saga:<name>:<step>``)."""
        if not isinstance(step, str) or not step.strip():
            raise ValueError(f"A step name is a non-empty string, not {step!r}.")
        return f"saga:{self.name}:{step}"

    def step(self, step: str, body: Callable[[], T]) -> StepOutcome[T]:
        """Run ``body`` once for ``(saga id, step)``, in one transaction with its reservation."""
        with transaction.atomic(using=self.using):
            if self._reserve(step):
                return StepOutcome(APPLIED, body())
            cancelled = not self.happened(step)  # its key is its compensation's tombstone
        status = CANCELLED if cancelled else DUPLICATE
        logger.info(
            "saga %s %s: step %s %s",
            log_text(self.name),
            log_text(self.saga_id),
            log_text(step),
            status,
        )
        return StepOutcome(status)

    def compensate(self, step: str, body: Callable[[], T]) -> StepOutcome[T]:
        """Undo ``step`` once, and only if it happened; see the module notes."""
        with transaction.atomic(using=self.using):
            if not self._reserve(f"{step}.compensate"):
                status = DUPLICATE
            elif self._reserve(step, tombstone=True):
                status = NOT_NEEDED  # the step never ran; its key is now a tombstone
            else:
                return StepOutcome(APPLIED, body())
        logger.info(
            "saga %s %s: compensation of %s %s",
            log_text(self.name),
            log_text(self.saga_id),
            log_text(step),
            status,
        )
        return StepOutcome(status)

    def happened(self, step: str) -> bool:
        """True if ``step`` committed (not merely tombstoned by its compensation)."""
        return (
            ProcessedEvent.objects.using(self.using)
            .filter(consumer=self.consumer(step), event_id=self.saga_id)
            .exclude(topic=self._tombstone_topic)
            .exists()
        )

    @property
    def _tombstone_topic(self) -> str:
        return f"{self.name} (cancelled)"

    def _reserve(self, step: str, *, tombstone: bool = False) -> bool:
        topic = self._tombstone_topic if tombstone else self.name
        return try_reserve(
            self.saga_id, self.consumer(step), topic=topic, ttl=self.ttl, using=self.using
        )
