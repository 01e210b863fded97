"""Purge benchmark: batched DELETE against partition DROP, and what each costs concurrent inserts.

On PostgreSQL, in a database of its own (``idempotency_bench_purge``, created and dropped here):

1. **Batched purge** of the plain ``ProcessedEvent`` table: seed ``--rows`` expired and
   ``--rows`` live rows, then run ``ProcessedEvent.objects.delete_expired()`` (batches of
   ``--batch-size``, one transaction each) to the end.
2. **Partition drop**: convert the table to daily partitions, seed the same rows (the expired ones
   in partitions whose range ended ``EVENT_TTL`` ago), then run
   ``partitioning.drop_expired_partitions()``.

Meanwhile ``--inserters`` threads insert new events at a steady ``--insert-rate`` each, every
insert being the statement ``try_reserve`` runs (``INSERT ... ON CONFLICT DO NOTHING``) in its own
transaction. Insert latency is measured for a quiet baseline and during each operation. Every
live row is checked to be there afterwards.

Usage::

    .venv/bin/python bench/purge.py [--rows N] [--quick] [--keep]

``BENCH_PG_URL`` (default ``postgres://postgres@127.0.0.1:5432/postgres``) names the server and a
database to connect to for ``CREATE DATABASE``. Prints a table and writes
``bench/results/purge.json``. ``main(argv) -> dict`` is what ``bench/run.py`` calls.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DATABASE = "idempotency_bench_purge"
RESULTS = REPO / "bench" / "results" / "purge.json"
TABLE = "django_idempotency_processedevent"
BASELINE_SECONDS = 5.0


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- the database ------------------------------------------------------------------------------


def database_url(server_url: str, name: str) -> str:
    parts = urlsplit(server_url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, parts.fragment))


def psycopg_dsn(url: str) -> str:
    return url.replace("postgres://", "postgresql://", 1)


def recreate_database(server_url: str, name: str, drop_only: bool = False) -> None:
    import psycopg

    with psycopg.connect(psycopg_dsn(server_url), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        if not drop_only:
            conn.execute(f'CREATE DATABASE "{name}"')


def setup_django(url: str) -> None:
    import django
    import environ
    from django.conf import settings

    if settings.configured:
        raise RuntimeError("bench/purge.py configures Django itself: run it in its own process.")
    settings.configure(
        DATABASES={"default": environ.Env.db_url_config(url)},
        INSTALLED_APPS=["django.contrib.contenttypes", "django_idempotency"],
        USE_TZ=True,
        TIME_ZONE="UTC",
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        IDEMPOTENCY={},
        LOGGING_CONFIG=None,
    )
    django.setup()


def execute(sql: str, params: Sequence[Any] | None = None) -> Any:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall() if cursor.description else cursor.rowcount


def scalar(sql: str, params: Sequence[Any] | None = None) -> Any:
    return execute(sql, params)[0][0]


def vacuum_analyze() -> None:
    from django.db import connection

    connection.ensure_connection()
    autocommit = connection.get_autocommit()
    connection.set_autocommit(True)
    try:
        execute(f"VACUUM ANALYZE {TABLE}")
    finally:
        connection.set_autocommit(autocommit)


def table_bytes() -> int:
    from django_idempotency.models import ProcessedEvent

    size = ProcessedEvent.objects.stats().size_bytes
    return int(size or 0)


# -- seeding -------------------------------------------------------------------------------------

# A UUIDv7 string for the time ``ts`` (random bits from md5 of the row number).
_UUID7_SQL = (
    "substr(h, 1, 8) || '-' || substr(h, 9, 4) || '-7' || substr(r, 1, 3) || '-8' "
    "|| substr(r, 4, 3) || '-' || substr(r, 7, 12)"
)


def seed(rows: int, partitioned: bool) -> float:
    """``rows`` expired rows (events of 40 to 10 days ago) and ``rows`` live ones (last 5 days).

    Returns the seconds it took.
    """
    started = time.perf_counter()
    extra_column = ", occurred_at" if partitioned else ""
    extra_value = ", timestamptz 'epoch' + ms * interval '1 millisecond'" if partitioned else ""
    for label, start, span in (("expired", "40 days", "30 days"), ("live", "5 days", "5 days")):
        execute(
            f"INSERT INTO {TABLE} (consumer, event_id, topic, processed_at, expires_at"
            f"{extra_column}) "
            f"SELECT 'bench', {_UUID7_SQL}, '', ts, ts + interval '7 days'{extra_value} FROM ("
            "  SELECT ts, ms, lpad(to_hex(ms), 12, '0') AS h, md5(%s || g::text) AS r FROM ("
            "    SELECT g, ts, (extract(epoch FROM ts) * 1000)::bigint AS ms FROM ("
            f"      SELECT g, now() - interval '{start}'"
            f"        + (g::double precision / %s) * interval '{span}' - interval '1 minute' AS ts"
            "      FROM generate_series(1, %s) g) a) b) c",
            [label, rows, rows],
        )
    vacuum_analyze()
    return time.perf_counter() - started


# -- concurrent inserts ------------------------------------------------------------------------


class Inserters:
    """Threads inserting new events at a steady rate; every latency is kept with its start."""

    def __init__(self, url: str, threads: int, rate: float, partitioned: bool) -> None:
        self.url = psycopg_dsn(url)
        self.threads = threads
        self.interval = 1.0 / rate
        self.partitioned = partitioned
        self.samples: list[tuple[float, float]] = []  # (start, seconds)
        self.errors: list[BaseException] = []
        self.inserted: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._workers: list[threading.Thread] = []

    def _run(self, index: int) -> None:
        import psycopg

        from django_idempotency.events.core import new_event_id
        from django_idempotency.retention.partitioning import partition_time

        if self.partitioned:
            sql = (
                f"INSERT INTO {TABLE} (consumer, event_id, topic, processed_at, expires_at, "
                "occurred_at) VALUES ('bench.live', %s, '', now(), now() + interval '7 days', %s) "
                "ON CONFLICT (consumer, event_id, occurred_at) DO NOTHING"
            )
        else:
            sql = (
                f"INSERT INTO {TABLE} (consumer, event_id, topic, processed_at, expires_at) "
                "VALUES ('bench.live', %s, '', now(), now() + interval '7 days') "
                "ON CONFLICT (consumer, event_id) DO NOTHING"
            )
        samples: list[tuple[float, float]] = []
        inserted: list[str] = []
        try:
            with psycopg.connect(self.url) as conn:
                next_at = time.perf_counter() + index * self.interval / self.threads
                while not self._stop.is_set():
                    delay = next_at - time.perf_counter()
                    if delay > 0:
                        time.sleep(delay)
                    next_at += self.interval
                    event_id = str(new_event_id())
                    params: tuple[Any, ...] = (event_id,)
                    if self.partitioned:
                        params = (event_id, partition_time(event_id))
                    started = time.perf_counter()
                    with conn.cursor() as cursor:
                        cursor.execute(sql, params)
                    conn.commit()
                    samples.append((started, time.perf_counter() - started))
                    inserted.append(event_id)
        except BaseException as exc:  # noqa: BLE001  (raised again by stop())
            self.errors.append(exc)
        finally:
            with self._lock:
                self.samples.extend(samples)
                self.inserted.extend(inserted)

    @contextmanager
    def running(self) -> Iterator[Inserters]:
        self._stop.clear()
        self._workers = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(self.threads)
        ]
        for worker in self._workers:
            worker.start()
        try:
            yield self
        finally:
            self._stop.set()
            for worker in self._workers:
                worker.join(30)
            if self.errors:
                raise RuntimeError(f"an inserter failed: {self.errors[0]!r}") from self.errors[0]

    def window(self, start: float, end: float) -> list[float]:
        """Latencies (seconds) of the inserts that started between ``start`` and ``end``."""
        return [seconds for began, seconds in self.samples if start <= began <= end]


def latency(samples: list[float]) -> dict[str, Any]:
    if not samples:
        return {"inserts": 0}
    ordered = sorted(samples)

    def pct(p: float) -> float:
        return round(ordered[max(0, math.ceil(p * len(ordered)) - 1)] * 1000, 2)

    return {
        "inserts": len(ordered),
        "p50_ms": pct(0.50),
        "p99_ms": pct(0.99),
        "max_ms": round(ordered[-1] * 1000, 2),
        "mean_ms": round(statistics.fmean(ordered) * 1000, 2),
    }


def measured(
    inserters: Inserters, operation: Callable[[], Any]
) -> tuple[Any, float, dict[str, Any], dict[str, Any]]:
    """Run a quiet baseline, then ``operation`` with the inserters going; return both."""
    with inserters.running():
        time.sleep(0.5)  # connections open, rate settled
        base_start = time.perf_counter()
        time.sleep(BASELINE_SECONDS)
        base_end = op_start = time.perf_counter()
        result = operation()
        op_end = time.perf_counter()
        time.sleep(0.2)
    return (
        result,
        op_end - op_start,
        latency(inserters.window(base_start, base_end)),
        latency(inserters.window(op_start, op_end)),
    )


def check_live(rows: int, inserters: Inserters) -> None:
    """Every seeded live row and every concurrent insert is still there."""
    from django_idempotency.models import ProcessedEvent

    seeded = ProcessedEvent.objects.filter(consumer="bench").count()
    if seeded != rows:
        raise AssertionError(f"{rows - seeded} seeded live rows lost")
    present = set(
        ProcessedEvent.objects.filter(consumer="bench.live").values_list("event_id", flat=True)
    )
    missing = set(inserters.inserted) - present
    if missing:
        raise AssertionError(f"{len(missing)} concurrently inserted rows lost")


# -- the two sections ----------------------------------------------------------------------------


def bench_delete(url: str, args: argparse.Namespace) -> dict[str, Any]:
    from django_idempotency.models import ProcessedEvent

    execute(f"TRUNCATE {TABLE}")
    log(f"   seeding {args.rows:,} expired + {args.rows:,} live rows (plain table)")
    seed_seconds = seed(args.rows, partitioned=False)
    size_before = table_bytes()
    inserters = Inserters(url, args.inserters, args.insert_rate, partitioned=False)
    log(f"   purging in batches of {args.batch_size} while {args.inserters} threads insert")
    result, seconds, baseline, during = measured(
        inserters,
        lambda: ProcessedEvent.objects.delete_expired(batch_size=args.batch_size, max_seconds=0),
    )
    if result.deleted != args.rows:
        raise AssertionError(f"deleted {result.deleted} rows, expected {args.rows}")
    check_live(args.rows, inserters)
    return {
        "rows_deleted": result.deleted,
        "batches": result.batches,
        "batch_size": args.batch_size,
        "seconds": round(seconds, 2),
        "rows_per_second": round(result.deleted / seconds),
        "seed_seconds": round(seed_seconds, 1),
        "table_bytes_before": size_before,
        "table_bytes_after": table_bytes(),
        "inserts_baseline": baseline,
        "inserts_during": during,
    }


def bench_drop(url: str, args: argparse.Namespace) -> dict[str, Any]:
    from django_idempotency.retention import partitioning

    execute(f"TRUNCATE {TABLE}")
    partitioning.convert("default", "day")
    now = partitioning.database_now("default")
    partitioning.ensure_partitions("default", "day", now=now, since=now - timedelta(days=41))
    log(f"   seeding {args.rows:,} expired + {args.rows:,} live rows (daily partitions)")
    seed_seconds = seed(args.rows, partitioned=True)
    cutoff = now - timedelta(days=7)
    droppable = [
        p
        for p in partitioning.partitions("default")
        if p.is_range and p.end is not None and p.end <= cutoff
    ]
    expired_rows = scalar(f"SELECT count(*) FROM {TABLE} WHERE expires_at < now()")
    size_before = table_bytes()
    inserters = Inserters(url, args.inserters, args.insert_rate, partitioned=True)
    log(f"   dropping {len(droppable)} expired partitions while {args.inserters} threads insert")
    result, seconds, baseline, during = measured(
        inserters, lambda: partitioning.drop_expired_partitions("default")
    )
    left = scalar(f"SELECT count(*) FROM {TABLE} WHERE expires_at < now()")
    if left or len(result.dropped) != len(droppable) or result.kept:
        raise AssertionError(f"drop left {left} expired rows: {result}")
    check_live(args.rows, inserters)
    return {
        "rows_dropped": expired_rows,
        "partitions_dropped": len(result.dropped),
        "seconds": round(seconds, 4),
        "rows_per_second": round(expired_rows / seconds),
        "seed_seconds": round(seed_seconds, 1),
        "table_bytes_before": size_before,
        "table_bytes_after": table_bytes(),
        "inserts_baseline": baseline,
        "inserts_during": during,
    }


# -- report ---------------------------------------------------------------------------------


def table(results: dict[str, Any]) -> str:
    rows = [
        ("batched DELETE", results["delete"]),
        ("partition DROP", results["drop"]),
    ]
    head = (
        f"{'operation':<16} {'rows':>10} {'seconds':>9} {'rows/s':>12} "
        f"{'p99 quiet':>10} {'p99 during':>11} {'max during':>11} {'inserts':>8}"
    )
    lines = [head, "-" * len(head)]
    for name, data in rows:
        removed = data.get("rows_deleted", data.get("rows_dropped"))
        base, during = data["inserts_baseline"], data["inserts_during"]
        lines.append(
            f"{name:<16} {removed:>10,} {data['seconds']:>9} {data['rows_per_second']:>12,} "
            f"{base.get('p99_ms', '-'):>8}ms {during.get('p99_ms', '-'):>9}ms "
            f"{during.get('max_ms', '-'):>9}ms {during['inserts']:>8}"
        )
    return "\n".join(lines)


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="expired rows, and live rows")
    parser.add_argument("--quick", action="store_true", help="100,000 rows: a quick check")
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--inserters", type=int, default=2, help="inserting threads")
    parser.add_argument(
        "--insert-rate", type=float, default=200.0, help="inserts per second per thread"
    )
    parser.add_argument("--keep", action="store_true", help="keep the database afterwards")
    parser.add_argument("--json", type=Path, default=RESULTS, help="where to write the results")
    args = parser.parse_args(list(argv))
    if args.quick:
        args.rows = min(args.rows, 100_000)
    if args.rows < 1 or args.batch_size < 1 or args.inserters < 1 or args.insert_rate <= 0:
        parser.error("--rows, --batch-size, --inserters and --insert-rate must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse(sys.argv[1:] if argv is None else argv)
    server = os.environ.get("BENCH_PG_URL", "postgres://postgres@127.0.0.1:5432/postgres")
    url = database_url(server, DATABASE)
    log(f"== purge benchmark on {DATABASE}: {args.rows:,} expired + {args.rows:,} live rows")
    recreate_database(server, DATABASE)
    try:
        setup_django(url)
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        version = scalar("SHOW server_version")
        log("== batched DELETE (ProcessedEvent.objects.delete_expired)")
        delete = bench_delete(url, args)
        log("== partition DROP (partitioning.drop_expired_partitions)")
        drop = bench_drop(url, args)
    finally:
        from django.db import connections

        connections.close_all()
        if not args.keep:
            recreate_database(server, DATABASE, drop_only=True)
    results: dict[str, Any] = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "postgresql": version,
        "rows_expired": args.rows,
        "rows_live": args.rows,
        "inserters": args.inserters,
        "insert_rate_per_thread": args.insert_rate,
        "baseline_seconds": BASELINE_SECONDS,
        "delete": delete,
        "drop": drop,
        "run_id": uuid.uuid4().hex[:8],
    }
    print(table(results))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    log(f"== wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
