"""A consumer's statements as SQL text against their PL/pgSQL functions, call by call.

Migration ``0006_event_functions`` turned the reservation and the delivery count into
functions whose plans PostgreSQL keeps per session. The SQL text they replaced is still what the
partitioned layout (and MariaDB, SQLite) sends, so both can run in one process, on one
connection, taking turns call by call, so that both meet the same load:

* ``reserve + effect``: ``transaction.atomic``, the reservation, one ``Effect`` insert (the
  same values, computed the same way, sent as the statement or as the call);
* ``count``: the guarded delivery count of a new event, in autocommit (a WAL flush each);
* ``effect alone``: the transaction with the insert only, the ratios' base.

Run it against a migrated benchmark database (``bench.benchproject.prepare``)::

    BENCH_DATABASE_URL=postgres://postgres@127.0.0.1:5432/idempotency_bench_app \\
        python -m bench.eventcost --calls 800 --rounds 7

It prints one JSON document on stdout: µs per call at the median of each round, and each row's
ratio to the effect alone (the median of the rounds' ratios).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from bench.micro import _setup
from bench.rounds import rotation

CONSUMER = "bench.eventcost"
DAY = timedelta(days=1)


def build_rows() -> dict[str, Callable[[], Any]]:
    from django.db import connection, transaction
    from django.utils import timezone

    from bench.benchproject.models import Effect
    from django_idempotency.events import store as event_store
    from django_idempotency.models import ProcessedEvent

    if connection.vendor != "postgresql":
        raise SystemExit("bench.eventcost compares PostgreSQL functions: use a PostgreSQL URL")

    def effect(event: str) -> None:
        Effect.objects.create(name="eventcost", payload=event, amount_cents=1)

    def effect_alone() -> None:
        with transaction.atomic():
            effect(str(uuid.uuid4()))

    def reservation(event: str) -> dict[str, Any]:
        now = timezone.now()
        return {
            "consumer": CONSUMER,
            "event_id": event,
            "topic": "",
            "processed_at": now,
            "expires_at": now + DAY,
        }

    def reserve_text() -> None:
        event = str(uuid.uuid4())
        with transaction.atomic():
            row = reservation(event)
            unique = ("consumer", "event_id")
            if event_store.insert_new(connection, ProcessedEvent, row, unique=unique):
                effect(event)

    def reserve_function() -> None:
        event = str(uuid.uuid4())
        with transaction.atomic():
            row = reservation(event)
            state = event_store.reserve(
                connection, CONSUMER, event, "", row["processed_at"], row["expires_at"]
            )
            if state == event_store.RESERVED:
                effect(event)

    def count_text() -> None:
        event = str(uuid.uuid4())
        guard = {"consumer": CONSUMER, "event_id": event}
        values = event_store.delivery_values(CONSUMER, event, "", DAY)
        event_store.count(connection, values, guard=guard)

    def count_function() -> None:
        event_store.call_count(connection, CONSUMER, str(uuid.uuid4()), "", DAY, 1, False)

    return {
        "effect alone": effect_alone,
        "reserve + effect, SQL text": reserve_text,
        "reserve + effect, function": reserve_function,
        "count, SQL text": count_text,
        "count, function": count_function,
    }


def run(calls: int, rounds: int) -> dict[str, Any]:
    _setup()
    rows = build_rows()
    for handle in rows.values():  # warm-up: the connection, imports, plan caches
        for _ in range(50):
            handle()
    return {"calls_per_round": calls, "rounds": rounds, "rows": time_rows(rows, calls, rounds)}


def time_rows(
    rows: dict[str, Callable[[], Any]], calls: int, rounds: int, base: str = "effect alone"
) -> list[dict[str, Any]]:
    """Time every row call by call, the rows taking turns (their order rotating each round):
    µs per call at the median of each round, and each row's ratio to ``base`` (the median of the
    rounds' ratios)."""
    names = list(rows)
    per_round: dict[str, list[float]] = {name: [] for name in names}
    for round_no in range(rounds):
        order = rotation(names, round_no)
        latencies: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(calls):
            for name in order:
                began = time.perf_counter()
                rows[name]()
                latencies[name].append(time.perf_counter() - began)
        for name in names:
            per_round[name].append(statistics.median(latencies[name]) * 1e6)
    out = []
    for name in names:
        ratios = [a / b for a, b in zip(per_round[name], per_round[base], strict=True)]
        out.append(
            {
                "row": name,
                "us_per_call": round(statistics.median(per_round[name]), 1),
                "rounds_us": [round(v, 1) for v in per_round[name]],
                "ratio_to_effect_alone": round(statistics.median(ratios), 3),
            }
        )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=800, help="calls per row per round")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    print(json.dumps(run(args.calls, args.rounds)))


if __name__ == "__main__":
    main()
