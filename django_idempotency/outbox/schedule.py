"""The SQL of delayed outbox messages: a countdown counted from the commit, and held messages.

A message written with a countdown cannot know its due time: that counts from the COMMIT, which
has not happened yet. It is written with ``available_at`` =
:data:`~django_idempotency.models.OUTBOX_UNSCHEDULED` (no relay claims it, and it holds back the
later messages of its key) and a provisional ``due_at`` of ``created_at + countdown``, which
keeps the countdown. Then:

* the producer's ``on_commit`` hook (:func:`set_due`) sets ``due_at = now + countdown`` from the
  commit it has just seen;
* if the producer died between its COMMIT and that hook, a relay finds the row
  (:func:`unscheduled`) and does the same from the moment it saw it committed: later than the
  commit, never earlier.

Whichever comes first wins: each write is conditional on the row being still unscheduled.
``available_at`` becomes the due time for a transport the relay holds messages for (Kafka,
Dramatiq), and ``NULL`` for one that delivers them late itself (Celery's eta). On PostgreSQL the
write also notifies the relays, as the INSERT did: the relay that woke at the COMMIT found
nothing it could send yet.

:func:`next_due` tells a relay when the next held message is due, so it wakes up then instead
of at its next poll. Both queries read ``idem_outbox_avail_idx`` (migration 0015).

Like :mod:`.store`, this module reads no setting and decides nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db import connections, transaction

from django_idempotency.models import OutboxEntry, outbox_unscheduled
from django_idempotency.outbox.store import NOTIFY_CHANNEL

__all__ = ["Unscheduled", "next_due", "set_due", "unscheduled"]

PENDING = OutboxEntry.State.PENDING


@dataclass(frozen=True, slots=True)
class Unscheduled:
    """A committed message whose countdown nobody has started yet."""

    pk: int
    transport: str
    countdown: float
    """Seconds, as written: the provisional ``due_at`` minus ``created_at``."""


def set_due(using: str, pk: int, due: datetime, hold: bool) -> bool:
    """Start the countdown of message ``pk``: due at ``due``; held by the relay until then when
    ``hold``, else sendable at once. False when it was scheduled already (the other of the hook
    and the relay came first) or is gone."""
    connection = connections[using]
    with transaction.atomic(using=using):
        updated = (
            OutboxEntry.objects.using(using)
            .filter(pk=pk, state=PENDING, available_at=outbox_unscheduled())
            .update(due_at=due, available_at=due if hold else None)
        )
        if updated and connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_notify(%s, '')", [NOTIFY_CHANNEL])
    return bool(updated)


def unscheduled(using: str, limit: int) -> list[Unscheduled]:
    """Up to ``limit`` committed messages whose countdown has not started, oldest first."""
    rows = (
        OutboxEntry.objects.using(using)
        .filter(state=PENDING, available_at=outbox_unscheduled())
        .order_by("available_at")
        .values_list("pk", "transport", "due_at", "created_at")[:limit]
    )
    return [
        Unscheduled(pk, transport, (due - created).total_seconds() if due is not None else 0.0)
        for pk, transport, due, created in rows
    ]


def next_due(using: str, now: datetime) -> datetime | None:
    """When the first pending message that waits for a time (held, or backing off) is due,
    after ``now``; None when none waits."""
    return (
        OutboxEntry.objects.using(using)
        .filter(state=PENDING, available_at__gt=now, available_at__lt=outbox_unscheduled())
        .order_by("available_at")
        .values_list("available_at", flat=True)
        .first()
    )
