"""Celery calls through the outbox (issue 36): what kombu's types cost ``publish()``, and how late
a delayed message runs against its due time.

    python -m bench.celery_calls                          # PostgreSQL and Redis, a few minutes
    python -m bench.celery_calls --database-url mysql://root@127.0.0.1:3306/idempotency_bench_outbox
    python -m bench.celery_calls --quick                  # a tiny run, to check it works

Two sections, each side by side in one run:

1. **typed**: one transaction that creates an ``Order`` and publishes a call of four keyword
   arguments, as plain JSON (``str(uuid)``, an ISO 8601 string, a decimal string, an int) and
   as kombu's types (``UUID``, ``datetime``, ``Decimal``, an int), to ``shop.probe_call``, and
   the ``Order`` alone. The
   rows take turns transaction by transaction, the order rotating each round
   (:mod:`bench.rounds`); a ratio is the median of the per-round ratios. Microseconds per
   transaction, and the statements each sends.
2. **delayed**: a delayed message's COMMIT to its effect, against its due time: a producer
   commits ``countdown=D`` messages at a steady pace, a relay process and a Celery worker
   (Redis) apply them, and each effect's lateness is ``effect - (COMMIT + D)``. Rows:
   ``apply_async_on_commit(countdown=D)`` (Celery alone: the worker holds the message), the
   outbox with the eta passed on (the relay sends at once, the worker holds it), and the outbox
   with ``hold_until_due`` (the relay holds it, the worker runs it at once). Rows take turns in
   rounds with a fresh relay each. The COMMIT is between two moments measured around it: the
   lateness counts from their middle (so it may be below 0 by half the COMMIT's time), and
   ``early`` counts effects before the earlier one plus the countdown (never due yet).

It uses the test project's settings on its own database (created and migrated here) and prints
a JSON document and tables.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

from bench.delivery import redis_worker, start_relay, wait_for_effects
from bench.outbox import DEFAULT_DB, clear, percentile, report, start, tables
from bench.rounds import median_ratio, rotation

WARM_UP = 20


# --- 1. What kombu's types cost publish() ------------------------------------------------------


def typed_cost(transactions: int, rounds: int) -> dict[str, Any]:
    from django.db import connection, transaction
    from django.test.utils import CaptureQueriesContext

    from django_idempotency.outbox import core as outbox
    from testproject.shop.call_probe import probe_call
    from testproject.shop.models import Order

    at = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)

    def alone() -> None:
        with transaction.atomic():
            Order.objects.create(reference="bench", amount_cents=1)

    def plain() -> None:
        with transaction.atomic():
            Order.objects.create(reference="bench", amount_cents=1)
            kwargs = {
                "event_id": str(uuid.uuid4()),
                "at": at.isoformat(),
                "amount": "12.50",
                "n": 7,
            }
            outbox.publish(probe_call, kwargs=kwargs, queue="bench-typed")

    def typed() -> None:
        with transaction.atomic():
            Order.objects.create(reference="bench", amount_cents=1)
            kwargs = {"event_id": uuid.uuid4(), "at": at, "amount": Decimal("12.50"), "n": 7}
            outbox.publish(probe_call, kwargs=kwargs, queue="bench-typed")

    rows: dict[str, Callable[[], None]] = {
        "order alone": alone,
        "order + publish(), plain JSON arguments": plain,
        "order + publish(), kombu-typed arguments": typed,
    }
    names = list(rows)
    statements: dict[str, int] = {}
    for name, run in rows.items():  # warm-up, and the statement count
        for _ in range(WARM_UP):
            run()
        with CaptureQueriesContext(connection) as captured:
            run()
        statements[name] = len(captured.captured_queries)
    per_round: dict[str, list[float]] = {name: [] for name in names}
    every: dict[str, list[float]] = {name: [] for name in names}
    per = max(1, transactions // rounds)
    for round_no in range(rounds):
        order = rotation(names, round_no)
        spent = dict.fromkeys(names, 0.0)
        for _ in range(per):
            for name in order:  # transaction by transaction, the rows take turns
                started = time.perf_counter()
                rows[name]()
                took = time.perf_counter() - started
                spent[name] += took
                every[name].append(took)
        for name in names:
            per_round[name].append(spent[name] / per * 1e6)
        clear()
    plain_rounds = per_round["order + publish(), plain JSON arguments"]
    alone_rounds = per_round["order alone"]
    return {
        name: {
            "statements": statements[name],
            "us_per_tx": round(statistics.median(per_round[name]), 1),
            "p99_us": round(percentile(every[name], 99) * 1e6),
            "vs_alone": median_ratio(per_round[name], alone_rounds),
            "vs_plain_json": median_ratio(per_round[name], plain_rounds),
            "transactions": len(every[name]),
        }
        for name in names
    }


# --- 2. A delayed message against its due time ------------------------------------------------


@dataclass(frozen=True)
class Row:
    label: str
    outbox: bool
    hold: bool = False


ROWS = (
    Row("apply_async_on_commit(countdown) (the worker holds it)", outbox=False),
    Row("outbox, eta passed on (the worker holds it)", outbox=True),
    Row("outbox, hold_until_due (the relay holds it)", outbox=True, hold=True),
)


def _produce(
    row: Row, queue_name: str, count: int, rate: float, countdown: float
) -> dict[str, tuple[float, float]]:
    """``count`` transactions at ``rate`` a second, each with one delayed message: when each
    is due, by event id: its COMMIT plus the countdown, the COMMIT being between the two
    moments measured around it."""
    from django.db import transaction

    from django_idempotency import new_event_id
    from django_idempotency.outbox import core as outbox
    from testproject.shop.tasks import effect

    due: dict[str, tuple[float, float]] = {}
    started = time.monotonic()
    for n in range(count):
        pause = started + n / rate - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        event_id = str(new_event_id())
        with transaction.atomic():
            if row.outbox:
                outbox.publish(
                    effect, kwargs={"event_id": event_id}, queue=queue_name, countdown=countdown
                )
            else:
                effect.apply_async_on_commit(
                    kwargs={"event_id": event_id}, queue=queue_name, countdown=countdown
                )
            before = time.time()
        after = time.time()
        due[event_id] = (before + countdown, after + countdown)
    return due


def _collect(
    due: dict[str, tuple[float, float]], worker: Any, timeout: float
) -> list[tuple[float, bool]]:
    """Each effect's lateness against its due time (seconds, from the middle of the COMMIT's
    two bounds), and whether it ran before the earliest moment it could be due (early)."""
    from testproject.shop.models import Effect

    ids = list(due)
    wait_for_effects(ids, worker, timeout)
    applied = Effect.objects.filter(payload__in=ids).values_list("payload", "created_at")
    found = []
    for event_id, created in applied:
        earliest, latest = due[event_id]
        ran = created.timestamp()
        found.append((ran - (earliest + latest) / 2, ran < earliest))
    return found


def delayed(
    *, count: int, rate: float, countdown: float, rounds: int, tmp: Path
) -> dict[str, Any]:
    from django.conf import settings

    from tests.workers import database_url

    db_url = database_url(settings.DATABASES["default"])
    late: dict[str, list[list[tuple[float, bool]]]] = {row.label: [] for row in ROWS}
    with redis_worker("bench-delayed", db_url, tmp, concurrency=2) as (name, worker):
        for round_no in range(rounds):
            for row in rotation(ROWS, round_no):
                relay = None
                if row.outbox:
                    log = tmp / f"relay-{round_no}-{ROWS.index(row)}.log"
                    relay = start_relay(db_url, log, hold_until_due=row.hold)
                try:
                    _collect(_produce(row, name, 5, rate, 0.5), worker, 60)  # warm-up
                    share = max(1, count // rounds)
                    batch = _produce(row, name, share, rate, countdown)
                    late[row.label].append(_collect(batch, worker, countdown + 120))
                finally:
                    if relay is not None:
                        relay.stop()
                clear()
    baseline = ROWS[0].label
    results: dict[str, Any] = {}
    for label, rounds_of in late.items():
        values = [v for values in rounds_of for v, _ in values]
        p50_by_round = [statistics.median(v for v, _ in values) for values in rounds_of]
        base_by_round = [statistics.median(v for v, _ in values) for values in late[baseline]]
        results[label] = {
            "messages": len(values),
            "countdown_s": countdown,
            "late_p50_ms": round(percentile(values, 50) * 1000, 1),
            "late_p95_ms": round(percentile(values, 95) * 1000, 1),
            "late_p99_ms": round(percentile(values, 99) * 1000, 1),
            "late_min_ms": round(min(values) * 1000, 1),
            "late_max_ms": round(max(values) * 1000, 1),
            "early": sum(early for values in rounds_of for _, early in values),
            "p50_vs_celery_ms": round(
                statistics.median(a - b for a, b in zip(p50_by_round, base_by_round, strict=True))
                * 1000,
                1,
            ),
        }
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.celery_calls", description=__doc__)
    parser.add_argument("--database-url", default=DEFAULT_DB)
    parser.add_argument("--transactions", type=int, default=3000, help="typed: per row")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--messages", type=int, default=150, help="delayed: per row")
    parser.add_argument("--rate", type=float, default=10.0, help="delayed: commits a second")
    parser.add_argument("--countdown", type=float, default=2.0, help="delayed: seconds")
    parser.add_argument("--only", default="typed,delayed")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output", default="", help="also write the JSON document here")
    args = parser.parse_args(argv)
    if args.quick:
        args.transactions, args.rounds, args.messages = 60, 2, 10
    vendor = start(args.database_url)
    sections = args.only.split(",")
    results: dict[str, Any] = {"database": vendor, "load": os.getloadavg()}
    if "typed" in sections:
        results["typed"] = typed_cost(args.transactions, args.rounds)
    if "delayed" in sections:
        with tempfile.TemporaryDirectory(prefix="bench-delayed-") as tmp:
            results["delayed"] = delayed(
                count=args.messages,
                rate=args.rate,
                countdown=args.countdown,
                rounds=min(args.rounds, 3),
                tmp=Path(tmp),
            )
    report(results, args.output)
    titles = {
        "typed": "publish() with kombu's types against plain JSON (one Order, one call)",
        "delayed": (
            f"A delayed message's COMMIT to effect, against its due time (countdown "
            f"{args.countdown:g} s, {args.rate:g} commits/s, a Celery worker on Redis)"
        ),
    }
    tables(titles, results, vendor)
    return 0


if __name__ == "__main__":
    sys.exit(main())
