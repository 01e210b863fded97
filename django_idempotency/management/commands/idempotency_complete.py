"""``manage.py idempotency_complete``: finish multi-step requests abandoned mid-flow."""

from __future__ import annotations

import json
from argparse import ArgumentParser, ArgumentTypeError
from typing import Any

from django.core.management.base import BaseCommand

from django_idempotency.conf import conf
from django_idempotency.exceptions import log_text
from django_idempotency.flows.completer import (
    DEFAULT_LIMIT,
    DEFAULT_MAX_ATTEMPTS,
    MAX_LIMIT,
    abandoned,
    complete_abandoned,
)
from django_idempotency.management.lost_database import resumable_on_loss


def _whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ArgumentTypeError(f"must be a whole number, not {text!r}") from None


def _limit(text: str) -> int:
    value = _whole_number(text)
    if not 1 <= value <= MAX_LIMIT:
        raise ArgumentTypeError(f"must be from 1 to {MAX_LIMIT}, not {text}")
    return value


def _positive_int(text: str) -> int:
    value = _whole_number(text)
    if value < 1:
        raise ArgumentTypeError(f"must be a positive integer, not {value}")
    return value


class Command(BaseCommand):
    help = (
        "Resume phased requests (@idempotent(phases=True)) whose lease ran out before they "
        "finished, and store their final response for a late retry. Runs that failed "
        "--max-attempts times are rolled forward to failure, with their compensations."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "--limit", type=_limit, default=DEFAULT_LIMIT, metavar="N",
            help=f"Runs to complete at most, up to {MAX_LIMIT} (default {DEFAULT_LIMIT}).",
        )  # fmt: skip
        parser.add_argument(
            "--max-attempts", type=_positive_int, default=DEFAULT_MAX_ATTEMPTS, metavar="N",
            help="Failed runs after which a flow is rolled forward to failure "
            f"(default {DEFAULT_MAX_ATTEMPTS}).",
        )  # fmt: skip
        parser.add_argument(
            "--dry-run", action="store_true", help="List the abandoned runs; change nothing."
        )
        parser.add_argument(
            "--json", action="store_true", help="Print one JSON line per run (listed or handled)."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["dry_run"]:
            for run in abandoned()[: options["limit"]]:
                listed = {
                    "record": run.record_id,
                    "key": run.record.key,
                    "flow": run.flow,
                    "recovery_point": run.recovery_point or None,
                    "attempts": run.attempts,
                }
                if options["json"]:
                    self.stdout.write(json.dumps(listed))
                else:
                    self.stdout.write(
                        f"record {run.record_id} key={log_text(run.record.key)} "
                        f"flow={log_text(run.flow)} at={log_text(run.recovery_point or '-')} "
                        f"attempts={run.attempts}"
                    )
            return
        with resumable_on_loss([conf.DATABASE], "completer"):
            completions = complete_abandoned(
                limit=options["limit"], max_attempts=options["max_attempts"]
            )
        for done in completions:
            if options["json"]:
                self.stdout.write(json.dumps(done.as_dict()))
            else:
                detail = f" ({done.detail})" if done.detail else ""
                self.stdout.write(
                    f"record {done.record} key={log_text(done.key)} flow={log_text(done.flow)}: "
                    f"{done.outcome} "
                    f"{done.status or ''}{detail}".rstrip()
                )
        if not options["json"]:
            self.stdout.write(f"{len(completions)} abandoned run(s) handled.")
