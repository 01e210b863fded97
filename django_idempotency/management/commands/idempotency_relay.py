"""``manage.py idempotency_relay``: send the outbox until stopped (SIGTERM or SIGINT).

    python manage.py idempotency_relay                  # run under a supervisor
    python manage.py idempotency_relay --once           # send what is due, then exit

SIGTERM and SIGINT stop it gracefully: the batch in flight is sent and recorded, then it exits 0.
Several relays may run at once, on one host or many.
"""

from __future__ import annotations

import json
import signal
from argparse import ArgumentParser, ArgumentTypeError
from types import FrameType
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from django_idempotency.conf import MAX_SECONDS
from django_idempotency.management.arguments import batch_size
from django_idempotency.outbox.relay import BatchResult, Relay
from django_idempotency.outbox.transports import close_transports
from django_idempotency.retention.purge import purged_databases


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ArgumentTypeError(f"must be a number of seconds, not {text!r}") from None
    if not 0 < value <= MAX_SECONDS:  # NaN and infinity fail this too
        raise ArgumentTypeError(f"must be a positive number of seconds, not {text}")
    return value


class Command(BaseCommand):
    help = (
        "Send committed outbox messages through their transports and mark them sent. Runs "
        "until SIGTERM/SIGINT; --once sends what is due and exits."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--once", action="store_true", help="Send what is due, then exit.")
        parser.add_argument(
            "--batch-size", type=batch_size, default=500, metavar="N", help="(default 500)"
        )
        parser.add_argument(
            "--poll-interval",
            type=_positive_seconds,
            default=1.0,
            metavar="S",
            help="Seconds between polls when idle; NOTIFY wakes it sooner on PostgreSQL "
            "(default 1).",
        )
        parser.add_argument(
            "--lease",
            type=_positive_seconds,
            default=60.0,
            metavar="S",
            help="Seconds before another relay may resend a batch this one has not recorded "
            "(default 60).",
        )
        parser.add_argument(
            "--backoff",
            type=_positive_seconds,
            default=1.0,
            metavar="S",
            help="Seconds before the first retry of a failed message; doubles (default 1).",
        )
        parser.add_argument(
            "--max-backoff",
            type=_positive_seconds,
            default=300.0,
            metavar="S",
            help="The longest wait between two attempts (default 300).",
        )
        parser.add_argument("--database", default=None, help='Default: IDEMPOTENCY["DATABASE"].')

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            # An alias that is not in DATABASES is refused as idempotency_purge refuses it.
            [alias] = purged_databases(options["database"])
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        relay = Relay(
            using=alias,
            batch_size=options["batch_size"],
            lease=options["lease"],
            backoff=options["backoff"],
            max_backoff=max(options["max_backoff"], options["backoff"]),
        )
        verbose = options["verbosity"] >= 2

        def stop(signum: int, frame: FrameType | None) -> None:
            relay.stop()

        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            if options["once"]:
                total = relay.drain()
            else:
                if options["verbosity"] >= 1:
                    self.stdout.write(f"outbox relay started on database {relay.using!r}")
                    self.stdout.flush()
                total = relay.serve(
                    options["poll_interval"], on_batch=self._report if verbose else None
                )
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            close_transports()
        if options["verbosity"] >= 1:
            self.stdout.write(json.dumps(total.as_dict()))

    def _report(self, result: BatchResult) -> None:
        self.stdout.write(json.dumps(result.as_dict()))
        self.stdout.flush()
