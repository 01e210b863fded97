"""``manage.py idempotency_status``: one screen of health figures, and an exit code to alert on.

    python manage.py idempotency_status                       # print the figures
    python manage.py idempotency_status --json                # for a script
    python manage.py idempotency_status --max-lag 60 --fail-on-parked   # a cron job or a probe

Exit codes: 0 healthy (or no threshold given), 1 a threshold is exceeded (each one exceeded is
printed), 2 a usage error (a bad option, an unknown database) or a database that cannot be read.
Every figure is read from an index (:mod:`django_idempotency.status`), so a probe every few
seconds costs nothing on tables of ten million rows.
"""

from __future__ import annotations

import json
from argparse import ArgumentParser, ArgumentTypeError
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError

from django_idempotency.management.arguments import seconds
from django_idempotency.retention.purge import purged_databases
from django_idempotency.status import Status, collect

EXCEEDED = 1
"""The exit code when a threshold is exceeded."""
UNUSABLE = 2
"""The exit code of a usage error or a database that cannot be read (argparse's own is 2)."""


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ArgumentTypeError(f"must be a whole number, not {text!r}") from None
    if value < 0:
        raise ArgumentTypeError(f"must be zero or more, not {text}")
    return value


def problems(
    status: Status,
    *,
    max_lag: float | None,
    fail_on_parked: bool,
    max_abandoned: int | None,
) -> list[str]:
    """The thresholds ``status`` exceeds, each as a sentence; empty when healthy."""
    found = []
    lag = status.outbox_oldest_pending_seconds
    if max_lag is not None and lag is not None and lag > max_lag:
        found.append(
            f"outbox lag {lag:.0f}s is over --max-lag {max_lag:g}s: is a relay running, "
            "and keeping up?"
        )
    if fail_on_parked and status.outbox_parked:
        found.append(
            f"{status.outbox_parked} parked outbox message(s): requeue them in the admin once "
            "their transport works"
        )
    if fail_on_parked and status.deliveries_parked:
        found.append(
            f"{status.deliveries_parked} parked event delivery(ies): fix the consumer, then "
            "delete their rows in the admin to let them run again"
        )
    if max_abandoned is not None and status.flows_abandoned > max_abandoned:
        found.append(
            f"{status.flows_abandoned} abandoned flow run(s), over --max-abandoned-flows "
            f"{max_abandoned}: is idempotency_complete running?"
        )
    return found


class Command(BaseCommand):
    help = (
        "Print records in progress, live leases, the outbox backlog and lag, parked messages "
        "and abandoned flow runs. Exits 1 when a threshold given as an option is exceeded."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--json", action="store_true", help="Print one JSON object.")
        parser.add_argument("--database", default=None, help='Default: IDEMPOTENCY["DATABASE"].')
        parser.add_argument(
            "--max-lag",
            type=seconds,
            default=None,
            metavar="SECONDS",
            help="Exit 1 if the oldest pending outbox message is older than this.",
        )
        parser.add_argument(
            "--fail-on-parked",
            action="store_true",
            help="Exit 1 if any outbox message or event delivery is parked.",
        )
        parser.add_argument(
            "--max-abandoned-flows",
            type=_count,
            default=None,
            metavar="N",
            help="Exit 1 if more than N flow runs wait for the completer.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            [alias] = purged_databases(options["database"])
        except ValueError as exc:
            raise CommandError(str(exc), returncode=UNUSABLE) from exc
        try:
            status = collect(alias)
        except DatabaseError as exc:
            raise CommandError(
                f"Could not read the idempotency tables of database {alias!r}: {exc}",
                returncode=UNUSABLE,
            ) from exc
        found = problems(
            status,
            max_lag=options["max_lag"],
            fail_on_parked=options["fail_on_parked"],
            max_abandoned=options["max_abandoned_flows"],
        )
        if options["json"]:
            self.stdout.write(json.dumps({**status.as_dict(), "problems": found}))
        else:
            self._print(status, found)
        if found:
            raise SystemExit(EXCEEDED)

    def _print(self, status: Status, found: list[str]) -> None:
        def figure(name: str) -> str:
            value: int = getattr(status, name)
            return f"~{value}" if name in status.estimated else str(value)

        lag = status.outbox_oldest_pending_seconds
        lines = [
            f"database {status.database!r}",
            f"  records in progress     {figure('records_in_progress')}",
            f"  live leases             {figure('live_leases')}",
            f"  outbox pending          {figure('outbox_pending')}",
            "  outbox oldest pending   "
            + ("none" if lag is None else f"{lag:.0f}s ago ({status.outbox_oldest_pending_at})"),
            f"  outbox parked           {figure('outbox_parked')}",
            f"  deliveries parked       {figure('deliveries_parked')}",
            f"  flow runs abandoned     {figure('flows_abandoned')}",
        ]
        if status.estimated:
            lines.append(f"  (~: over {status.limit}, the planner's estimate)")
        lines.extend(f"PROBLEM: {line}" for line in found)
        if not found:
            lines.append("OK")
        self.stdout.write("\n".join(lines))
