"""The floor of each consumer path: its SQL alone, sent raw, against the effect alone's.

No Django and no psycopg adaptation in the timed calls: each row sends its queries as text with
libpq's asynchronous calls on one connection (the benchmark database's, in autocommit), and the
rows take turns call by call, so that they meet the same load. What a row costs here is what its
round trips, its WAL flushes and the server's work cost; what Django and the app add on top is
in ``bench.consumer``. The rows:

* ``effect alone``: ``BEGIN``, one ``Effect`` insert, ``COMMIT`` (three round trips);
* ``count apart, then reserve + effect``: the count in autocommit, then ``BEGIN; reserve``, the
  insert, ``COMMIT`` (the decorator on PostgreSQL before the count travelled);
* ``count with the reservation + effect``: ``BEGIN; count; COMMIT; BEGIN; reserve``, the insert,
  ``COMMIT`` (the decorator now), and the same with the count committed asynchronously;
* ``reserve + effect``: ``BEGIN; reserve``, the insert, ``COMMIT`` (``try_reserve``);
* ``duplicate, count alone`` and ``duplicate, count with the reservation + COMMIT``: an event
  processed before, the old way and the new;
* ``SELECT 1`` (a round trip) and ``autocommit insert`` (a round trip and a WAL flush).

Run it against a migrated benchmark database (``bench.benchproject.prepare``)::

    BENCH_DATABASE_URL=postgres://postgres@127.0.0.1:5432/idempotency_bench_app \\
        python -m bench.consumerfloor --calls 800 --rounds 5

It prints one JSON document on stdout: µs per call at the median of each round, and each row's
ratio to the effect alone (the median of the rounds' ratios).
"""

from __future__ import annotations

import argparse
import json
import uuid
from collections.abc import Callable
from typing import Any

from bench.eventcost import time_rows
from bench.micro import _setup

CONSUMER = "bench.consumerfloor"
DUPLICATES = 20_000
"""Events processed before the timed rounds, for the duplicate rows (one per call)."""


class Raw:
    """Queries as text on the connection's libpq handle; raises on the first failed result."""

    def __init__(self, pgconn: Any, ok: tuple[Any, ...]) -> None:
        self.pgconn = pgconn
        self.ok = ok

    def __call__(self, sql: str) -> None:
        self.pgconn.send_query(sql.encode())
        while (result := self.pgconn.get_result()) is not None:
            if result.status not in self.ok:
                raise RuntimeError(result.error_message.decode(errors="replace"))


def _quoted(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def build_rows(duplicates: list[str]) -> dict[str, Callable[[str], None]]:
    import psycopg
    from django.db import connection

    if connection.vendor != "postgresql" or connection.Database.__name__ != "psycopg":
        raise SystemExit("bench.consumerfloor needs PostgreSQL with psycopg 3")
    connection.ensure_connection()
    raw = connection.connection
    raw.autocommit = True
    status = psycopg.pq.ExecStatus
    q = Raw(raw.pgconn, (status.COMMAND_OK, status.TUPLES_OK))
    expiry = "now(), now() + interval '1 day'"

    def count(event: str, asynchronous: bool = False) -> str:
        flag = "true" if asynchronous else "false"
        return (
            f"SELECT * FROM django_idempotency_count_v1({_quoted(CONSUMER)}, {_quoted(event)}, "
            f"'', 1, {expiry}, {flag})"
        )

    def reserve(event: str) -> str:
        return (
            f"SELECT django_idempotency_reserve_v2({_quoted(CONSUMER)}, {_quoted(event)}, '', "
            f"{expiry}, false)"
        )

    def effect(event: str) -> str:
        return (
            "INSERT INTO benchproject_effect (name, payload, amount_cents, created_at) "
            f"VALUES ('consumerfloor', {_quoted(event)}, 1, now())"
        )

    def travelling(event: str, asynchronous: bool = False) -> str:
        return f"BEGIN; {count(event, asynchronous)}; COMMIT; BEGIN; {reserve(event)}"

    for event in duplicates:
        q(f"BEGIN; {reserve(event)}; COMMIT")
    old, new = iter(duplicates), iter(duplicates)

    def effect_alone(e: str) -> None:
        q("BEGIN")
        q(effect(e))
        q("COMMIT")

    def count_apart(e: str) -> None:
        q(count(e))
        q(f"BEGIN; {reserve(e)}")
        q(effect(e))
        q("COMMIT")

    def count_travelling(e: str, asynchronous: bool = False) -> None:
        q(travelling(e, asynchronous))
        q(effect(e))
        q("COMMIT")

    def reserved(e: str) -> None:
        q(f"BEGIN; {reserve(e)}")
        q(effect(e))
        q("COMMIT")

    def duplicate_alone(e: str) -> None:
        q(count(next(old)))

    def duplicate_travelling(e: str) -> None:
        q(travelling(next(new)))
        q("COMMIT")

    rows: dict[str, Callable[[str], None]] = {
        "effect alone": effect_alone,
        "count apart, then reserve + effect": count_apart,
        "count with the reservation + effect": count_travelling,
        "count with the reservation + effect, asynchronous": lambda e: count_travelling(e, True),
        "reserve + effect": reserved,
        "duplicate, count alone": duplicate_alone,
        "duplicate, count with the reservation + COMMIT": duplicate_travelling,
        "SELECT 1": lambda e: q("SELECT 1"),
        "autocommit insert": lambda e: q(effect(e)),
    }
    return rows


def _with_new_id(row: Callable[[str], None]) -> Callable[[], None]:
    """The row called with a new event id each time, as bench.eventcost's rows make their own."""
    return lambda: row(str(uuid.uuid4()))


def run(calls: int, rounds: int) -> dict[str, Any]:
    _setup()
    warm = 20
    duplicates = [str(uuid.uuid4()) for _ in range(min((calls * rounds) + warm, DUPLICATES))]
    rows = {name: _with_new_id(row) for name, row in build_rows(duplicates).items()}
    for handle in rows.values():  # warm-up: plan caches
        for _ in range(warm):
            handle()
    return {"calls_per_round": calls, "rounds": rounds, "rows": time_rows(rows, calls, rounds)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=800, help="calls per row per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if args.calls * args.rounds + 20 > DUPLICATES:
        parser.error(f"--calls x --rounds must stay under {DUPLICATES - 20}")
    print(json.dumps(run(args.calls, args.rounds)))


if __name__ == "__main__":
    main()
