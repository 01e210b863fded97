"""The health figures ``idempotency_status`` prints and the telemetry gauges report.

Each figure is read from an index, never from a scan, so the command answers in well under a
second on ten million records and a million pending outbox messages:

* records in progress and live leases: the ``(state, locked_until)`` index;
* pending and parked outbox messages, and the oldest pending one that is due: the
  ``(state, id)`` index (a delayed message that is not due yet is skipped: the walk reads the
  held rows before the oldest due one);
* parked event deliveries: the ``parked_at`` index;
* abandoned flow runs: the ``(state, updated_at)`` index, joined to their records by key.

A count reads at most :data:`~django_idempotency.managers.STATS_COUNT_LIMIT` index entries;
past that it is the planner's estimate (PostgreSQL, MySQL/MariaDB), flagged as such, which is
what an alert needs: "more than ten thousand" is already the answer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from django.db.models import Q, QuerySet
from django.utils import timezone

from django_idempotency.clock import DatabaseNow
from django_idempotency.conf import conf
from django_idempotency.managers import STATS_COUNT_LIMIT, bounded_count
from django_idempotency.models import EventDelivery, FlowRun, IdempotencyRecord, OutboxEntry

__all__ = ["Status", "collect"]

COUNTS = (
    "records_in_progress",
    "live_leases",
    "outbox_pending",
    "outbox_parked",
    "deliveries_parked",
    "flows_abandoned",
)


@dataclass(frozen=True)
class Status:
    """One reading of the tables of one database."""

    database: str
    records_in_progress: int
    live_leases: int
    outbox_pending: int
    outbox_oldest_pending_at: datetime | None
    outbox_oldest_pending_seconds: float | None
    """Age of the oldest pending message that is due (the relay's lag), counted from when it
    became due for a delayed one; None when nothing due is pending."""
    outbox_parked: int
    deliveries_parked: int
    flows_abandoned: int
    limit: int = STATS_COUNT_LIMIT
    estimated: tuple[str, ...] = field(default=())
    """The counts above ``limit``: planner estimates, not exact figures."""

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        at = self.outbox_oldest_pending_at
        data["outbox_oldest_pending_at"] = None if at is None else at.isoformat()
        data["estimated"] = list(self.estimated)
        return data


def collect(using: str | None = None, limit: int = STATS_COUNT_LIMIT) -> Status:
    """Read the figures of database ``using`` (default ``IDEMPOTENCY["DATABASE"]``)."""
    alias = using or conf.DATABASE
    records = IdempotencyRecord.objects.using(alias)
    outbox = OutboxEntry.objects.using(alias)
    in_progress = records.filter(state=IdempotencyRecord.State.IN_PROGRESS)
    counts: dict[str, QuerySet[Any]] = {
        "records_in_progress": in_progress,
        "live_leases": records.filter(records.live_lease_condition()),
        "outbox_pending": outbox.filter(state=OutboxEntry.State.PENDING),
        "outbox_parked": outbox.filter(state=OutboxEntry.State.PARKED),
        "deliveries_parked": EventDelivery.objects.using(alias).filter(parked_at__isnull=False),
        # As the completer picks them (flows.completer.abandoned): running (or failed, its
        # answer not stored yet), lease run out.
        "flows_abandoned": FlowRun.objects.using(alias).filter(
            state__in=[FlowRun.State.RUNNING, FlowRun.State.FAILED],
            record__state=IdempotencyRecord.State.IN_PROGRESS,
            record__locked_until__lte=DatabaseNow(),
        ),
    }
    figures = {name: bounded_count(queryset, limit) for name, queryset in counts.items()}
    now = timezone.now()
    first = (
        outbox.filter(state=OutboxEntry.State.PENDING)
        .filter(Q(due_at__isnull=True) | Q(due_at__lte=now))
        .order_by("id")
        .values_list("created_at", "due_at")
        .first()
    )
    oldest = None if first is None else max(moment for moment in first if moment is not None)
    age = None if oldest is None else max((now - oldest).total_seconds(), 0.0)
    return Status(
        database=alias,
        outbox_oldest_pending_at=oldest,
        outbox_oldest_pending_seconds=age,
        limit=limit,
        estimated=tuple(name for name in COUNTS if figures[name] > limit),
        **figures,
    )
