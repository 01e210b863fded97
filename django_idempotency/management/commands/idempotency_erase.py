"""``manage.py idempotency_erase --owner OWNER``: erase what an owner's records store."""

from __future__ import annotations

import json
from argparse import ArgumentParser
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from django_idempotency.http.owner import display_owner
from django_idempotency.management.arguments import batch_size
from django_idempotency.management.lost_database import resumable_on_loss
from django_idempotency.protection.core import erase_owner
from django_idempotency.retention.purge import purged_databases


class Command(BaseCommand):
    help = (
        "Erase the stored responses, headers and phased requests of one owner's records (an "
        "erasure request), keeping a tombstone per record: a retry of an erased key is answered "
        "410 (response-erased) until the record expires, and never runs the view again."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "--owner",
            required=True,
            metavar="OWNER",
            help="The owner scope as stored: user:<pk> for a user by default "
            "(the admin's owner column and search show it).",
        )
        parser.add_argument(
            "--batch-size",
            type=batch_size,
            default=None,
            metavar="N",
            help='Records per transaction (default: IDEMPOTENCY["PURGE_BATCH_SIZE"]).',
        )
        parser.add_argument(
            "--database",
            default=None,
            metavar="ALIAS",
            help='The database alias that holds the records (default: IDEMPOTENCY["DATABASE"]).',
        )
        parser.add_argument("--json", action="store_true", help="Print the result as JSON.")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            using = purged_databases(options["database"])[0]
            with resumable_on_loss([using], "erasure"):
                result = erase_owner(
                    options["owner"], using=using, batch_size=options["batch_size"]
                )
        except (ValueError, ImproperlyConfigured) as exc:
            raise CommandError(str(exc)) from exc
        if options["json"]:
            self.stdout.write(json.dumps(result.as_dict()))
            return
        owner = display_owner(result.owner)
        self.stdout.write(
            f"Erased {result.records} record{'s' if result.records != 1 else ''} of {owner} "
            f"({result.seconds:.2f}s); each stays as a tombstone until it expires."
        )
        if result.unfinished:
            self.stdout.write(
                self.style.WARNING(
                    f"{result.unfinished} record{'s' if result.unfinished != 1 else ''} of "
                    f"{owner} still in progress were left as they are: run the erasure again "
                    "once they have ended."
                )
            )
