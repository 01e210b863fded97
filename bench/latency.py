"""COMMIT to effect through the outbox, end to end: a producer commits, a relay process sends, a
Celery worker over Redis applies the effect.

    python -m bench.latency                                # PostgreSQL + Redis, about 2 minutes
    python -m bench.latency --baseline /tmp/old-tree       # an older relay, side by side
    python -m bench.latency --quick                        # a tiny run, to check it works

The relay (``manage.py idempotency_relay``) and the worker (``celery worker``, prefork) are real
processes. The producer commits one ``outbox.publish(shop.effect, kwargs={"event_id": ...})`` per
transaction, on a fixed schedule, at two paces:

* **steady**: ``--rate`` commits a second (default 25), so a notification often arrives while
  the relay works on the previous batch;
* **isolated**: ``--isolated-rate`` commits a second (default 10), so the relay idles between
  two commits and every message is woken by its own ``NOTIFY``.

Each message's event id is its task's payload; the worker's effect writes its ``Effect`` row
(``created_at``: the worker's clock, the same host) and the relay marks the outbox row sent after
Redis answered (``sent_at``). So each message gives three figures from its COMMIT: to the
effect, to sent (the relay's share), and from sent to the effect (Redis and the worker's share).

Rows take turns in ``--rounds`` rounds (the order rotating, :mod:`bench.rounds`), each round a
share of every row's messages, with a fresh relay per row and round, so that outside load hits
every row alike. The rows: ``apply_async_on_commit`` (no outbox: the floor), the outbox with
``NOTIFY`` at each pace, the same to a consumer with ``ignore_result=True`` (the worker
stores no result: the relay never reads one), the same relay from ``--baseline`` (a tree of an
older version, e.g. ``git archive <commit> | tar -x -C /tmp/old-tree``) at each pace, and
polling alone (one-second poll, isolated pace: its latency is the poll interval whatever the
pace). The worker is one for the whole run, started with ``--concurrency`` and
``--prefetch-multiplier``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.delivery import redis_worker, start_relay, wait_for_effects
from bench.outbox import DEFAULT_DB, REPO, clear, percentile, report, start, table
from bench.rounds import rotation

WARM_UP = 30
"""Messages sent, and not measured, after each relay starts."""


@dataclass(frozen=True)
class Row:
    """One way to get an event from a COMMIT to the worker."""

    label: str
    relay: Path | None
    """The tree whose ``manage.py idempotency_relay`` runs; None: no outbox."""
    notify: bool
    paces: tuple[str, ...]
    task: str = "effect"
    """The consumer in ``testproject.shop.tasks`` (``effect_without_result``: no result)."""


@dataclass
class Sample:
    committed: float
    sent: float | None = None
    applied: float | None = None


def rows_for(vendor: str, baseline: Path | None) -> list[Row]:
    rows = [Row("apply_async_on_commit", None, False, ("steady",))]
    if vendor == "postgresql":
        rows.append(Row("outbox, NOTIFY", REPO, True, ("steady", "isolated")))
        ignoring = "effect_without_result"
        rows.append(Row("outbox, NOTIFY, ignore_result", REPO, True, ("steady",), ignoring))
        if baseline is not None:
            label = f"outbox, NOTIFY, {baseline.name}"
            rows.append(Row(label, baseline, True, ("steady", "isolated")))
    rows.append(Row("outbox, 1 s poll only", REPO, False, ("isolated",)))
    return rows


def produce(row: Row, queue_name: str, count: int, rate: float) -> dict[str, Sample]:
    """``count`` transactions on a fixed schedule of ``rate`` a second; their COMMIT times."""
    from django.db import transaction
    from django.test import override_settings

    from django_idempotency import new_event_id
    from django_idempotency.outbox import core as outbox
    from testproject.shop import tasks

    samples: dict[str, Sample] = {}
    started = time.monotonic()
    with override_settings(IDEMPOTENCY={"OUTBOX_NOTIFY": row.notify}):
        for n in range(count):
            pause = started + n / rate - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            event_id = str(new_event_id())
            committed: list[float] = []
            with transaction.atomic():
                # The COMMIT's moment, taken by the first on_commit hook: before the hook that
                # publishes (apply_async_on_commit), whose worker may apply the task before the
                # block has returned here (a negative latency, seen on a loaded run).
                transaction.on_commit(lambda stamps=committed: stamps.append(time.time()))
                task = getattr(tasks, row.task)
                if row.relay is None:
                    task.apply_async_on_commit(kwargs={"event_id": event_id}, queue=queue_name)
                else:
                    outbox.publish(task, kwargs={"event_id": event_id}, queue=queue_name)
            samples[event_id] = Sample(committed=committed[0])
    return samples


def collect(samples: dict[str, Sample], worker: Any, timeout: float = 120.0) -> None:
    """Wait for every effect (and the relay's record of every send, which may commit after the
    worker's effect); fill in when each was sent and applied."""
    from django_idempotency.models import OutboxEntry
    from testproject.shop.models import Effect

    ids = list(samples)
    unrecorded = OutboxEntry.objects.filter(event_id__in=ids, sent_at__isnull=True)
    wait_for_effects(ids, worker, timeout, pending=unrecorded.exists)
    for event_id, created in Effect.objects.filter(payload__in=ids).values_list(
        "payload", "created_at"
    ):
        samples[event_id].applied = created.timestamp()
    for event_id, sent in OutboxEntry.objects.filter(event_id__in=ids).values_list(
        "event_id", "sent_at"
    ):
        samples[str(event_id)].sent = sent.timestamp() if sent is not None else None


def ms(values: list[float], q: float) -> float | str:
    return round(percentile(values, q) * 1000, 1) if values else "-"


def delays(samples: Sequence[Sample]) -> list[float]:
    return [s.applied - s.committed for s in samples if s.applied is not None]


def summary(samples: Sequence[Sample], rounds: Sequence[Sequence[Sample]]) -> dict[str, Any]:
    """Percentiles over every message of the row; ``p99_by_round_ms``: each round's own p99
    (a burst of outside load shows as one round apart from the others)."""
    total = delays(samples)
    to_sent = [s.sent - s.committed for s in samples if s.sent is not None]
    to_effect = [s.applied - s.sent for s in samples if s.sent is not None and s.applied]
    return {
        "messages": len(samples),
        "p50_ms": ms(total, 50),
        "p95_ms": ms(total, 95),
        "p99_ms": ms(total, 99),
        "max_ms": ms(total, 100),
        "to_sent_p50_ms": ms(to_sent, 50),
        "to_sent_p99_ms": ms(to_sent, 99),
        "sent_to_effect_p99_ms": ms(to_effect, 99),
        "p99_by_round_ms": " ".join(str(ms(delays(values), 99)) for values in rounds),
    }


def latency(
    *,
    count: int,
    rate: float,
    isolated_count: int,
    isolated_rate: float = 10.0,
    rounds: int = 3,
    tmp: Path,
    baseline: Path | None = None,
    concurrency: int = 2,
    prefetch_multiplier: int = 1,
) -> dict[str, Any]:
    from django.conf import settings
    from django.db import connection

    from tests.workers import database_url

    db_url = database_url(settings.DATABASES["default"])
    paces = {"steady": (count, rate), "isolated": (isolated_count, isolated_rate)}
    rows = rows_for(connection.vendor, baseline)
    samples: dict[str, list[list[Sample]]] = {}
    with redis_worker(
        "bench-latency", db_url, tmp, concurrency=concurrency,
        prefetch_multiplier=prefetch_multiplier,
    ) as (name, worker):  # fmt: skip
        for round_no in range(rounds):
            for row in rotation(rows, round_no):
                relay = None
                if row.relay is not None:
                    log = tmp / f"relay-{round_no}-{rows.index(row)}.log"
                    relay = start_relay(db_url, log, tree=row.relay)
                try:
                    # Not measured: the first messages of a process (imports, connections,
                    # the worker's pool children) are slower than any steady state.
                    collect(produce(row, name, WARM_UP, rate), worker)
                    for pace in row.paces:
                        total, per_second = paces[pace]
                        share = max(1, total // rounds)
                        batch = produce(row, name, share, per_second)
                        collect(batch, worker)
                        label = f"{row.label} ({pace})"
                        samples.setdefault(label, []).append(list(batch.values()))
                finally:
                    if relay is not None:
                        relay.stop()
                clear()
    return {
        label: summary([sample for values in rounds_of for sample in values], rounds_of)
        for label, rounds_of in samples.items()
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.latency", description=__doc__)
    parser.add_argument("--database-url", default=DEFAULT_DB)
    parser.add_argument("--messages", type=int, default=500, help="steady pace, per row")
    parser.add_argument(
        "--rate",
        type=float,
        default=25.0,
        help="steady pace: commits a second (at 50, a shared 2-core machine saturates: the "
        "figures then measure the backlog, not the path)",
    )
    parser.add_argument("--isolated-messages", type=int, default=90, help="isolated, per row")
    parser.add_argument("--isolated-rate", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", type=Path, default=None, help="an older tree's relay too")
    parser.add_argument("--concurrency", type=int, default=2, help="the worker's processes")
    parser.add_argument("--prefetch-multiplier", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output", default="", help="also write the JSON document here")
    args = parser.parse_args(argv)
    if args.quick:
        args.messages, args.isolated_messages, args.rounds = 40, 10, 1
    vendor = start(args.database_url)
    with tempfile.TemporaryDirectory(prefix="bench-latency-") as tmp:
        results = latency(
            count=args.messages,
            rate=args.rate,
            isolated_count=args.isolated_messages,
            isolated_rate=args.isolated_rate,
            rounds=args.rounds,
            tmp=Path(tmp),
            baseline=args.baseline.resolve() if args.baseline else None,
            concurrency=args.concurrency,
            prefetch_multiplier=args.prefetch_multiplier,
        )
    document = {"database": vendor, "load": os.getloadavg(), "latency": results}
    report(document, args.output)
    title = (
        f"COMMIT to effect (steady: {args.rate:g}/s, isolated: {args.isolated_rate:g}/s; "
        f"a Celery worker, -c {args.concurrency}) [{vendor}]"
    )
    print(table(title, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
