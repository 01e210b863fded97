"""``manage.py idempotency_purge``: delete expired idempotency rows in bounded batches."""

from __future__ import annotations

import json
from argparse import ArgumentParser
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from django_idempotency.conf import conf
from django_idempotency.management.arguments import add_batch_arguments
from django_idempotency.management.lost_database import resumable_on_loss
from django_idempotency.retention.purge import purge_all, purged_databases
from django_idempotency.retention.reports import PurgeResult


class Command(BaseCommand):
    help = (
        "Delete expired idempotency records, processed events and delivery counters, in "
        "batches of one short transaction each. Records held under a live lease are kept."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "--dry-run", action="store_true", help="Count what would be deleted; delete nothing."
        )
        add_batch_arguments(
            parser,
            seconds_default=None,
            seconds_help='Time budget, 0 for none (default: IDEMPOTENCY["PURGE_MAX_SECONDS"]).',
        )
        parser.add_argument(
            "--database",
            action="append",
            dest="databases",
            metavar="ALIAS",
            help="A database alias to purge; repeat it for several "
            '(default: IDEMPOTENCY["DATABASE"]). List every alias that consumers write to '
            "with using=... or a task's database option.",
        )
        parser.add_argument(
            "--stats",
            action="store_true",
            help="Print table size, purge backlog, in-progress and parked counts as JSON; "
            "delete nothing.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["stats"]:
            try:
                aliases = purged_databases(options["databases"])
            except ValueError as exc:
                raise CommandError(str(exc)) from exc
            self._stats(aliases)
            return
        try:
            with resumable_on_loss(purged_databases(options["databases"]), "purge"):
                results = purge_all(
                    batch_size=options["batch_size"],
                    max_seconds=options["max_seconds"],
                    dry_run=options["dry_run"],
                    databases=options["databases"],
                )
        except (ValueError, ImproperlyConfigured) as exc:
            raise CommandError(str(exc)) from exc
        for result in results:
            self.stdout.write(self._line(result))
        if not all(result.finished for result in results):
            self.stdout.write(
                self.style.WARNING(
                    "The time budget ran out before every expired row was deleted; "
                    "the next run goes on."
                )
            )

    def _line(self, result: PurgeResult) -> str:
        from django.apps import apps

        name = apps.get_model(result.label)._meta.verbose_name_plural
        if result.label == "django_idempotency.FlowRun":
            name = f"{name} without a record"  # the orphans: a record's runs go with it
        verb = "would delete" if result.dry_run else "deleted"
        where = "" if result.database in (None, conf.DATABASE) else f"[{result.database}] "
        text = (
            f"{where}{name}: {verb} {result.deleted} in {result.batches} "
            f"batch{'es' if result.batches != 1 else ''} ({result.seconds:.2f}s)"
        )
        if not result.finished:
            text += ", stopped at the time budget"
        partitions = result.partitions
        if partitions is not None:
            verb_create = "would create" if partitions.dry_run else "created"
            verb_drop = "would drop" if partitions.dry_run else "dropped"
            text += (
                f"; partitions: {verb_create} {len(partitions.created)}, {verb_drop} "
                f"{len(partitions.dropped)} (~{partitions.dropped_rows} rows)"
            )
            for name_kept, reason in partitions.kept:
                text += f"; kept {name_kept}: {reason}"
        return text

    def _stats(self, aliases: list[str]) -> None:
        from django_idempotency.models import (
            EventDelivery,
            IdempotencyRecord,
            OutboxEntry,
            ProcessedEvent,
        )

        stats = [
            {"database": alias, **model.objects.using(alias).stats().as_dict()}
            for alias in aliases
            for model in (IdempotencyRecord, ProcessedEvent, EventDelivery, OutboxEntry)
        ]
        self.stdout.write(json.dumps(stats, indent=2))
