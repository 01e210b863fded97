"""``manage.py idempotency_partitions``: the opt-in partitioned ProcessedEvent layout.

Actions: ``status`` (default), ``convert``, ``maintain``, ``revert``. PostgreSQL only.
"""

from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from django_idempotency.conf import PARTITION_INTERVALS, conf
from django_idempotency.retention import partitioning
from django_idempotency.retention.purge import purged_databases


class Command(BaseCommand):
    help = (
        "Range-partition ProcessedEvent by event time on PostgreSQL: show the layout (status), "
        "convert the table in place (convert), create partitions ahead and drop expired ones "
        "(maintain), or go back to the plain table (revert)."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "action",
            nargs="?",
            default="status",
            choices=["status", "convert", "maintain", "revert"],
        )
        parser.add_argument(
            "--interval",
            choices=PARTITION_INTERVALS,
            default=None,
            help='Partition width (default: IDEMPOTENCY["EVENT_PARTITIONS"]).',
        )
        parser.add_argument(
            "--ahead",
            type=int,
            default=None,
            metavar="N",
            help="Partitions to keep ready past the current one "
            f"(default: {partitioning.AHEAD['day']} days or "
            f"{partitioning.AHEAD['month']} months; at most {partitioning.MAX_AHEAD['day']} "
            f"or {partitioning.MAX_AHEAD['month']}).",
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="maintain: say what would change."
        )
        parser.add_argument(
            "--database",
            default=None,
            help='Database alias (default: IDEMPOTENCY["DATABASE"]).',
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            # An alias that is not in DATABASES is refused as idempotency_purge refuses it.
            [alias] = purged_databases(options["database"])
            partitioning.require_postgresql(alias)
            getattr(self, f"_{options['action']}")(alias, options)
        except (ImproperlyConfigured, ValueError) as exc:
            raise CommandError(str(exc)) from exc

    def _status(self, alias: str, options: dict[str, Any]) -> None:
        if not partitioning.is_partitioned(alias):
            self.stdout.write(
                "ProcessedEvent is a plain table (purged row by row by idempotency_purge). "
                "`idempotency_partitions convert --interval month` partitions it."
            )
            return
        self.stdout.write(
            f"ProcessedEvent is range-partitioned on {partitioning.PARTITION_COLUMN} "
            f'(IDEMPOTENCY["EVENT_PARTITIONS"] = {conf.EVENT_PARTITIONS!r}):'
        )
        for partition in partitioning.partitions(alias):
            if partition.is_default:
                bounds = "DEFAULT (late and far-future events)"
            elif partition.start is None or partition.end is None:
                bounds = "MINVALUE .. 1970-01-02 (ids without time)"
            else:
                bounds = f"{partition.start:%Y-%m-%d} .. {partition.end:%Y-%m-%d}"
            self.stdout.write(f"  {partition.name}  {bounds}  ~{partition.approx_rows} rows")

    def _convert(self, alias: str, options: dict[str, Any]) -> None:
        interval = options["interval"] or conf.EVENT_PARTITIONS
        created = partitioning.convert(alias, interval=interval, ahead=options["ahead"])
        self.stdout.write(
            f"Converted ProcessedEvent to {interval}ly partitions: {len(created)} created, "
            "plus the timeless and the default partition."
        )
        if conf.EVENT_PARTITIONS != interval:
            self.stdout.write(
                self.style.WARNING(
                    f'Now set IDEMPOTENCY["EVENT_PARTITIONS"] = {interval!r} and restart: '
                    "until then try_reserve cannot insert into the partitioned table."
                )
            )

    def _maintain(self, alias: str, options: dict[str, Any]) -> None:
        result = partitioning.maintain(
            alias, options["interval"], ahead=options["ahead"], dry_run=options["dry_run"]
        )
        prefix = "would " if result.dry_run else ""
        for name in result.created:
            self.stdout.write(f"{prefix}create {name}")
        for name in result.dropped:
            self.stdout.write(f"{prefix}drop {name}")
        for name, reason in result.kept:
            self.stdout.write(f"keep {name}: {reason}")
        would = "would be " if result.dry_run else ""
        self.stdout.write(
            f"{len(result.created)} partitions {would}created, {len(result.dropped)} "
            f"{would}dropped (~{result.dropped_rows} rows), {len(result.kept)} kept."
        )

    def _revert(self, alias: str, options: dict[str, Any]) -> None:
        copied = partitioning.revert(alias)
        self.stdout.write(f"ProcessedEvent is a plain table again ({copied} rows copied).")
        if conf.EVENT_PARTITIONS is not None:
            self.stdout.write(
                self.style.WARNING('Now remove IDEMPOTENCY["EVENT_PARTITIONS"] and restart.')
            )
