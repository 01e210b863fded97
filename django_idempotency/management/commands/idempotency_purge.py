"""``manage.py idempotency_purge``: delete expired idempotency rows in bounded batches."""

from __future__ import annotations

import json
from argparse import ArgumentParser, ArgumentTypeError
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from django_idempotency.managers import PurgeResult, purge_all


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ArgumentTypeError(f"must be a positive integer, not {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if value < 0:
        raise ArgumentTypeError(f"must be zero (no limit) or more, not {value}")
    return value


class Command(BaseCommand):
    help = (
        "Delete expired idempotency records, processed events and delivery counters, in "
        "batches of one short transaction each. Records held under a live lease are kept."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "--dry-run", action="store_true", help="Count what would be deleted; delete nothing."
        )
        parser.add_argument(
            "--batch-size",
            type=_positive_int,
            default=None,
            metavar="N",
            help='Rows per transaction (default: IDEMPOTENCY["PURGE_BATCH_SIZE"]).',
        )
        parser.add_argument(
            "--max-seconds",
            type=_seconds,
            default=None,
            metavar="S",
            help='Time budget, 0 for none (default: IDEMPOTENCY["PURGE_MAX_SECONDS"]).',
        )
        parser.add_argument(
            "--stats",
            action="store_true",
            help="Print table size, purge backlog, in-progress and parked counts as JSON; "
            "delete nothing.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["stats"]:
            self._stats()
            return
        try:
            results = purge_all(
                batch_size=options["batch_size"],
                max_seconds=options["max_seconds"],
                dry_run=options["dry_run"],
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
        verb = "would delete" if result.dry_run else "deleted"
        text = (
            f"{name}: {verb} {result.deleted} in {result.batches} "
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

    def _stats(self) -> None:
        from django_idempotency.models import (
            EventDelivery,
            IdempotencyRecord,
            OutboxEntry,
            ProcessedEvent,
        )

        stats = [
            model.objects.stats().as_dict()
            for model in (IdempotencyRecord, ProcessedEvent, EventDelivery, OutboxEntry)
        ]
        self.stdout.write(json.dumps(stats, indent=2))
