"""What the purge, the partition maintenance and the stats report: plain, JSON-friendly results.

A leaf module, so that the managers, the partitioning and the purge can all return them without
importing one another.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

__all__ = ["MaintenanceResult", "PurgeResult", "TableStats"]


@dataclass(frozen=True)
class MaintenanceResult:
    created: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    dropped_rows: int = 0
    """The planner's estimate of the rows the dropped partitions held."""
    kept: tuple[tuple[str, str], ...] = ()
    """Partitions old enough to drop that were kept, with the reason."""
    dry_run: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "created": list(self.created),
            "dropped": list(self.dropped),
            "dropped_rows": self.dropped_rows,
            "kept": [list(item) for item in self.kept],
            "dry_run": self.dry_run,
        }


@dataclass(frozen=True)
class PurgeResult:
    """What one ``delete_expired`` call did to one table."""

    label: str
    """The model label, for example ``django_idempotency.IdempotencyRecord``."""
    deleted: int
    """Rows deleted; in a dry run, the rows that would be deleted."""
    batches: int
    """Transactions it took (in a dry run: would take)."""
    seconds: float
    finished: bool
    """False when the time budget ran out first: run it again to go on."""
    dry_run: bool = False
    partitions: MaintenanceResult | None = None
    """Partitions created and dropped, when the table is range-partitioned."""
    database: str | None = None
    """The database alias purged (set by :func:`~django_idempotency.retention.purge.purge_all`)."""

    def as_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict (the Celery task's return value)."""
        data = asdict(self)
        data["seconds"] = round(self.seconds, 3)
        data["partitions"] = None if self.partitions is None else self.partitions.as_dict()
        return data


@dataclass(frozen=True)
class TableStats:
    """Monitoring figures for one table; every figure is cheap (an index or the catalog)."""

    label: str
    table: str
    size_bytes: int | None
    """Table plus indexes (all partitions) on PostgreSQL and MySQL; None on SQLite."""
    approx_rows: int | None
    """The planner's estimate (PostgreSQL, MySQL) or an exact count (SQLite)."""
    expired: int
    """Rows past ``expires_at`` that the purge may delete now: its backlog."""
    oldest_expires_at: datetime | None
    """The smallest ``expires_at``: far in the past means the purge is not keeping up."""
    counts: dict[str, int] = field(default_factory=dict)
    """Per-table figures: ``in_progress`` and ``live_leases`` for records, ``parked`` for
    deliveries."""

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["oldest_expires_at"] = (
            None if self.oldest_expires_at is None else self.oldest_expires_at.isoformat()
        )
        return data
