"""Growth: the claim, the purge, the admin and ``idempotency_status`` with ten million rows.

    python -m bench.growth                    # 10,000,000 rows per table (about half an hour)
    python -m bench.growth --rows 1000000     # a million: a few minutes
    python -m bench.growth --quick            # 20,000 rows: checks that it works
    python -m bench.growth --claim-only --batches 60   # the claim and its parts, outbox alone

Sent outbox messages, records, processed events and delivery counters accumulate until the purge
deletes them (issue 28). PostgreSQL only, in a database of its own (``idempotency_bench_growth``
on ``BENCH_PG_URL``, default ``postgres://postgres@127.0.0.1:5432/postgres``), created here,
migrated with the test project's settings and dropped afterwards (``--keep`` keeps it).

1. **Small tables first**, as the baseline measured in the same run: 100,000 pending outbox
   messages over 1,000 keys in an otherwise empty database, the relay's claim (``Relay._claim``,
   batches of 500, each batch then marked sent), the HTTP core's first execution and replay, and
   ``idempotency_status``.
2. **Seeding** with ``generate_series``: ``--rows`` records (1% in progress), processed events,
   event deliveries and sent outbox messages, each table spanning its TTL and a tenth more, so a
   tenth of each is expired (what the purge has to do); ``ANALYZE``; the outbox's statistics are
   taken while it holds no pending row and autovacuum is off for it (the quiet state of
   tests/test_outbox_claim_plan.py). Then 100,000 pending messages over 1,000 keys.
3. **Big tables**: the claim with those stale statistics, and again after ``ANALYZE``; the HTTP
   core; ``idempotency_status``; every admin list page (a superuser through Django's test
   client: wall time and queries); the purge of each table in bounded batches (the batches
   ``idempotency_purge`` runs, ``PURGE_BATCH_SIZE`` rows each) for ``--purge-seconds`` each,
   while a relay-like load publishes and marks sent ``--load-rate`` messages a second.

Each figure is printed beside its bound (docs/operations.md, docs/admin.md, docs/outbox.md) with
whether it was met, and the whole document is written as JSON (``--json``).

Why this module is long: five measurements, the seeding they share, a relay-like load and the
report of their bounds; each part is short, and they are read together.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.purge import database_url, execute, psycopg_dsn, recreate_database, scalar

REPO = Path(__file__).resolve().parent.parent
DATABASE = "idempotency_bench_growth"
RESULTS = REPO / "bench" / "results" / "growth.json"
OUTBOX = "django_idempotency_outboxentry"
BATCH = 500
PENDING, KEYS = 100_000, 1_000

# The bounds, from the issue and the documentation.
CLAIM_MS = 10.0  # the relay's claim per batch of 500 (issue 28)
HTTP_MS = 10.0  # "a few milliseconds" for the claim plus the store (docs/operations.md)
PURGE_BATCH_MS = 1000.0  # one purge batch is one short transaction
OUTBOX_RATE, MARGIN = 5000, 2  # sent messages a second the purge must keep up with, and margin
GROWTH = 1.5  # what does not depend on a table's size: big tables / small tables, at most
ADMIN_MS = 1000.0  # an admin list page
STATUS_S = 1.0  # idempotency_status's figures (0.83 s at 10M in docs/operations.md)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def timed_ms(call: Callable[[], Any]) -> float:
    started = time.perf_counter()
    call()
    return (time.perf_counter() - started) * 1000


def spread(samples: Sequence[float]) -> dict[str, float]:
    from bench.outbox import percentile

    return {
        "n": len(samples),
        "p50": round(statistics.median(samples), 2),
        "p99": round(percentile(samples, 99), 2),
        "max": round(max(samples), 2),
    }


# --- Seeding --------------------------------------------------------------------------------

DELIVERIES_SQL = """
INSERT INTO django_idempotency_eventdelivery
    (consumer, event_id, topic, deliveries, first_delivered_at, last_delivered_at, parked_at,
     last_error, expires_at)
SELECT 'billing', md5(i::text)::uuid::text, 'orders', 1 + mod(i, 3),
    now() - make_interval(secs => i * %(step)s), now() - make_interval(secs => i * %(step)s),
    CASE WHEN mod(i, 100000) = 0 THEN now() END, '',
    now() - make_interval(secs => i * %(step)s) + %(ttl)s::interval
FROM generate_series(1, %(rows)s) AS i
"""

# Sent messages, the oldest first (lowest ids), as the relay leaves them.
SENT_SQL = """
INSERT INTO django_idempotency_outboxentry
    (event_id, destination, transport, payload, headers, ordering_key, state, attempts,
     available_at, locked_until, last_error, created_at, sent_at, expires_at)
SELECT md5(i::text)::uuid::text, 'shop.effect', 'default',
    jsonb_build_object('args', '[]'::jsonb, 'kwargs', jsonb_build_object('n', i)), '{}'::jsonb,
    'k' || mod(i, %(keys)s), 'sent', 1, NULL, NULL, '',
    now() - make_interval(secs => i * %(step)s), now() - make_interval(secs => i * %(step)s),
    now() - make_interval(secs => i * %(step)s) + %(ttl)s::interval
FROM generate_series(%(rows)s, 1, -1) AS i
"""

# Pending messages over KEYS keys, and a few parked heads, as in a working outbox.
PENDING_SQL = """
INSERT INTO django_idempotency_outboxentry
    (event_id, destination, transport, payload, headers, ordering_key, state, attempts,
     last_error, created_at)
SELECT 'pending-' || %(label)s || '-' || i, 'shop.effect', 'default',
    '{"args": [], "kwargs": {}}'::jsonb, '{}'::jsonb, 'k' || mod(i, %(keys)s),
    CASE WHEN mod(i, 2000) = 1 THEN 'parked' ELSE 'pending' END, 0, '', now()
FROM generate_series(1, %(rows)s) AS i
"""


def seed(rows: int) -> dict[str, float]:
    """``rows`` rows in each of the four tables, a tenth of each expired; seconds per table."""
    from bench.admin import EVENTS_SQL, RECORDS_SQL

    seconds: dict[str, float] = {}
    # Each table spans 1.1 times its TTL: the oldest tenth is past its expiry.
    tables = (
        ("records", RECORDS_SQL, 86400),
        ("processed events", EVENTS_SQL, 7 * 86400),
        ("event deliveries", DELIVERIES_SQL, 7 * 86400),
        ("sent outbox messages", SENT_SQL, 7 * 86400),
    )
    for name, sql, ttl in tables:
        step = 1.1 * ttl / rows
        log(f"   {name}: {rows:,} rows")
        seconds[name] = round(
            timed_ms(
                lambda sql=sql, step=step, ttl=ttl: execute(
                    sql, {"rows": rows, "step": step, "ttl": f"{ttl} seconds", "keys": KEYS}
                )
            )
            / 1000,
            1,
        )
    started = time.perf_counter()
    with autocommit():
        execute("VACUUM ANALYZE")
    seconds["vacuum analyze"] = round(time.perf_counter() - started, 1)
    return seconds


@contextmanager
def autocommit() -> Iterator[None]:
    from django.db import connection

    connection.ensure_connection()
    before = connection.get_autocommit()
    connection.set_autocommit(True)
    try:
        yield
    finally:
        connection.set_autocommit(before)


def add_pending(label: str) -> None:
    execute(PENDING_SQL, {"rows": PENDING, "keys": KEYS, "label": label})


def analyze_outbox_quiet() -> None:
    """Statistics of an outbox with nothing pending, kept (autovacuum off for the table)."""
    execute(f"ALTER TABLE {OUTBOX} SET (autovacuum_enabled = false)")
    execute(f"ANALYZE {OUTBOX}")


# --- 1. The relay's claim -------------------------------------------------------------------


def relay_claim(batches: int) -> dict[str, Any]:
    """``Relay._claim`` (candidates, the ordering check, the lease) per batch of 500, each
    batch then marked sent as the relay does: the whole claim is timed, and its query
    (:func:`~django_idempotency.outbox.store.candidates`) apart."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    from bench.outbox import NullTransport
    from django_idempotency.outbox import store
    from django_idempotency.outbox.relay import Relay

    relay = Relay(batch_size=BATCH, transports={"default": NullTransport()})
    samples: list[float] = []
    parts: dict[str, list[float]] = {"query": [], "ordering check": [], "lease": []}
    claimed = 0
    for _ in range(batches):
        with CaptureQueriesContext(connection) as captured:
            started = time.perf_counter()
            rows = relay._claim()
            samples.append((time.perf_counter() - started) * 1000)
        claimed += len(rows)
        # Each statement as the driver timed it: the claim's own query (store.candidates), the
        # ordering check (store.unsent_of_keys) and the lease (store.lease).
        for q in captured.captured_queries:
            part = _claim_part(q["sql"])
            if part:
                parts[part].append(float(q["time"]) * 1000)
        now = timezone.now()
        with store.record_transaction("default"):
            store.mark_sent("default", [row.pk for row in rows], now, now + relay_ttl())
    return {
        "query": spread(parts["query"]),
        "whole": spread(samples),
        "parts_p50": {name: round(statistics.median(v), 1) for name, v in parts.items() if v},
        "rows_per_batch": round(claimed / batches),
        "queries": len(captured.captured_queries),
        "buffers": claim_buffers(),
    }


def _claim_part(sql: str) -> str:
    if "SKIP LOCKED" in sql:
        return "query"
    if '"ordering_key" IN (' in sql:
        return "ordering check"
    if sql.startswith("UPDATE"):
        return "lease"
    return ""


def relay_ttl() -> Any:
    from django_idempotency.conf import conf

    return conf.OUTBOX_TTL


def claim_buffers() -> int:
    """Shared buffers one claim's candidates query reads (``EXPLAIN (ANALYZE, BUFFERS)``)."""
    from django.db import connection, transaction
    from django.utils import timezone

    from django_idempotency.outbox import store

    now = timezone.now()
    with transaction.atomic():
        with store.claim_transaction(connection), connection.cursor() as cursor:
            cursor.execute(
                "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + store._pg_claim_sql(connection),
                [now, now, now, now, BATCH],
            )
            plan = cursor.fetchone()[0]
        transaction.set_rollback(True)  # the locks it took
    if isinstance(plan, str):
        plan = json.loads(plan)
    top = plan[0]["Plan"]
    return int(top["Shared Hit Blocks"] + top["Shared Read Blocks"])


# --- 2. The HTTP core -----------------------------------------------------------------------


def http_claim(requests: int, user: Any, label: str) -> dict[str, Any]:
    """A first execution on a new key and a replay of one key, through ``@idempotent``, each
    timed; the records they make are part of the table afterwards."""
    from django.http import JsonResponse
    from django.test import RequestFactory

    from django_idempotency import idempotent

    @idempotent
    def view(request: Any) -> JsonResponse:
        return JsonResponse({"ok": True}, status=201)

    factory = RequestFactory()

    def call(key: str) -> int:
        request = factory.post(
            "/orders/", b'{"amount_cents": 1}', content_type="application/json",
            HTTP_IDEMPOTENCY_KEY=key,
        )  # fmt: skip
        request.user = user
        return int(view(request).status_code)

    call(f"{label}-warm")
    first = [timed_ms(lambda i=i: call(f"{label}-{i}")) for i in range(requests)]
    replay = [timed_ms(lambda: call(f"{label}-warm")) for _ in range(requests)]
    return {"first": spread(first), "replay": spread(replay)}


# --- 3. idempotency_status ------------------------------------------------------------------


def status() -> dict[str, Any]:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from django_idempotency.status import collect

    collect()  # warm
    samples = []
    for _ in range(3):
        with CaptureQueriesContext(connection) as captured:
            started = time.perf_counter()
            collect()
            samples.append(time.perf_counter() - started)
    return {
        "seconds": round(statistics.median(samples), 3),
        "queries": len(captured.captured_queries),
    }


def status_command() -> float:
    """``call_command("idempotency_status", "--json")``: seconds, in this process."""
    import io

    from django.core.management import call_command

    started = time.perf_counter()
    call_command("idempotency_status", "--json", stdout=io.StringIO())
    return round(time.perf_counter() - started, 3)


# --- 4. The admin -----------------------------------------------------------------------------

OUTBOX_PAGES = "/admin/django_idempotency/outboxentry/"
DELIVERY_PAGES = "/admin/django_idempotency/eventdelivery/"
PAGES = [
    ("outbox: first page", OUTBOX_PAGES),
    ("outbox: page 50", OUTBOX_PAGES + "?p=50"),
    ("outbox: pending", OUTBOX_PAGES + "?state__exact=pending"),
    ("outbox: sent", OUTBOX_PAGES + "?state__exact=sent"),
    ("outbox: parked", OUTBOX_PAGES + "?state__exact=parked"),
    ("outbox: expired", OUTBOX_PAGES + "?expired=yes"),
    ("outbox: search key", OUTBOX_PAGES + "?q=k777"),
    ("deliveries: first page", DELIVERY_PAGES),
    ("deliveries: parked", DELIVERY_PAGES + "?parked=yes"),
    ("deliveries: expired", DELIVERY_PAGES + "?expired=yes"),
    ("deliveries: search id", DELIVERY_PAGES + "?q=c4ca4238-a0b9-2382-0dcc-509a6f75849b"),
]


# The record search matches the key or the owner, and no index leads with the owner: a scan,
# as docs/admin.md says (it suggests an index of the project's own where operators need it).
SCANS = ("records: search key", "records: search owner")


def admin_pages(client: Any, repeat: int) -> list[dict[str, Any]]:
    from bench.admin import PAGES as RECORD_AND_EVENT_PAGES
    from bench.admin import measure

    figures = []
    for name, url in [*RECORD_AND_EVENT_PAGES, *PAGES]:
        fig = measure(client, name, url, repeat)
        if fig.status != 200:
            raise AssertionError(f"{name}: {url} answered {fig.status}")
        figures.append(fig.__dict__)
    return figures


# --- 5. The purge ---------------------------------------------------------------------------


class RelayLoad:
    """A relay-like load beside the purge: every 0.1 s, one transaction publishes a tenth of
    ``rate`` messages and another marks them sent (with ``expires_at``), as a relay does."""

    def __init__(self, url: str, rate: int) -> None:
        self.url = psycopg_dsn(url)
        self.per_tick = max(1, rate // 10)
        self.written = 0
        self.late_ticks = 0
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import psycopg

        try:
            with psycopg.connect(self.url) as conn:
                tick = time.perf_counter()
                while not self._stop.is_set():
                    with conn.transaction():
                        ids = [
                            row[0]
                            for row in conn.execute(
                                PENDING_SQL.replace("'parked'", "'pending'") + " RETURNING id",
                                {"rows": self.per_tick, "keys": KEYS, "label": "load"},
                            )
                        ]
                    with conn.transaction():
                        conn.execute(
                            f"UPDATE {OUTBOX} SET state = 'sent', sent_at = now(), "
                            "expires_at = now() + interval '7 days', attempts = 1 "
                            "WHERE id = ANY(%s)",
                            [ids],
                        )
                    self.written += len(ids)
                    tick += 0.1
                    delay = tick - time.perf_counter()
                    if delay > 0:
                        time.sleep(delay)
                    else:
                        self.late_ticks += 1
        except BaseException as exc:  # noqa: BLE001  (raised again by running())
            self.errors.append(exc)

    @contextmanager
    def running(self) -> Iterator[RelayLoad]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join(30)
            if self.errors:
                raise RuntimeError(f"the relay-like load failed: {self.errors[0]!r}")


def purge_table(model: Any, seconds: float) -> dict[str, Any]:
    """``model``'s purge batches (``PURGE_BATCH_SIZE`` rows each, as ``idempotency_purge``
    runs them) for ``seconds``: each batch timed, and rows a second."""
    from django_idempotency.conf import conf

    queryset = model.objects.using("default")
    size = conf.PURGE_BATCH_SIZE
    samples: list[float] = []
    deleted = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        t0 = time.perf_counter()
        selected, removed = queryset._delete_batch("default", size)
        samples.append((time.perf_counter() - t0) * 1000)
        deleted += removed
        if selected < size:
            break
    elapsed = time.perf_counter() - started
    return {
        "deleted": deleted,
        "seconds": round(elapsed, 2),
        "rows_per_second": round(deleted / elapsed),
        "batch_ms": spread(samples),
        "finished": selected < size,
    }


def purge(url: str, seconds: float, load_rate: int) -> dict[str, Any]:
    from django_idempotency.models import (
        EventDelivery,
        IdempotencyRecord,
        OutboxEntry,
        ProcessedEvent,
    )

    results: dict[str, Any] = {}
    load = RelayLoad(url, load_rate)
    with load.running():
        started = time.perf_counter()
        for name, model in (
            ("sent outbox messages", OutboxEntry),
            ("records", IdempotencyRecord),
            ("processed events", ProcessedEvent),
            ("event deliveries", EventDelivery),
        ):
            log(f"   purging {name} for up to {seconds:g} s")
            results[name] = purge_table(model, seconds)
        elapsed = time.perf_counter() - started
    results["load"] = {
        "target_per_second": load_rate,
        "written_per_second": round(load.written / elapsed),
        "late_ticks": load.late_ticks,
    }
    return results


# --- The report -----------------------------------------------------------------------------


def verdicts(results: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """(measure, small tables, big tables, bound, met) rows."""
    small, big = results["small"], results["big"]
    rows: list[tuple[str, str, str, str, str]] = []

    def ms(fig: dict[str, float]) -> str:
        return f"p50 {fig['p50']:.1f} / p99 {fig['p99']:.1f} ms"

    def met(ok: bool) -> str:
        return "yes" if ok else "NO"

    for label, key in (("stale stats", "claim_stale"), ("fresh stats", "claim")):
        fig = big[key]
        rows.append(
            (
                f"claim query, {label}",
                ms(small["claim"]["query"]) if key == "claim_stale" else "",
                f"{ms(fig['query'])}, {fig['buffers']} buffers",
                f"p99 <= {CLAIM_MS:g} ms",
                met(fig["query"]["p99"] <= CLAIM_MS),
            )
        )
        base = small["claim"]["whole"]["p50"]
        rows.append(
            (
                f"Relay._claim, {label}",
                ms(small["claim"]["whole"]) if key == "claim_stale" else "",
                ms(fig["whole"]),
                f"p50 <= {GROWTH:g} x small",
                met(fig["whole"]["p50"] <= GROWTH * base),
            )
        )
    for kind in ("first", "replay"):
        fig = big["http"][kind]
        rows.append(
            (
                f"HTTP {kind} execution",
                ms(small["http"][kind]),
                ms(fig),
                f"p99 <= {HTTP_MS:g} ms",
                met(fig["p99"] <= HTTP_MS),
            )
        )
    for name, fig in big["purge"].items():
        if name == "load":
            continue
        bound = f"batch p99 <= {PURGE_BATCH_MS:g} ms"
        ok = fig["batch_ms"]["p99"] <= PURGE_BATCH_MS
        if name == "sent outbox messages":
            bound += f", >= {OUTBOX_RATE * MARGIN:,} rows/s"
            ok = ok and fig["rows_per_second"] >= OUTBOX_RATE * MARGIN
        rows.append(
            (
                f"purge: {name}",
                "",
                f"{fig['rows_per_second']:,} rows/s, batch {ms(fig['batch_ms'])}",
                bound,
                met(ok),
            )
        )
    for page in big["admin"]:
        bound = f"<= {ADMIN_MS:g} ms, <= 7 queries"
        if page["name"] in SCANS:
            bound = "a scan (docs/admin.md), <= 7 queries"
        ok = page["queries"] <= 7 and (page["worst_ms"] <= ADMIN_MS or page["name"] in SCANS)
        rows.append(
            (
                f"admin: {page['name']}",
                "",
                f"{page['median_ms']:.0f} ms (worst {page['worst_ms']:.0f}), "
                f"{page['queries']} queries",
                bound,
                met(ok),
            )
        )
    for label, key in (("idempotency_status: figures", "status"),):
        rows.append(
            (
                label,
                f"{small[key]['seconds']:.3f} s",
                f"{big[key]['seconds']:.3f} s, {big[key]['queries']} queries",
                f"<= {STATUS_S:g} s",
                met(big[key]["seconds"] <= STATUS_S),
            )
        )
    rows.append(
        (
            "idempotency_status: command",
            f"{small['status_command']:.3f} s",
            f"{big['status_command']:.3f} s",
            f"<= {STATUS_S:g} s",
            met(big["status_command"] <= STATUS_S),
        )
    )
    return rows


def table(results: dict[str, Any]) -> str:
    head = ("measure", "small tables", f"{results['rows']:,} rows per table", "bound", "met")
    rows = [head, *verdicts(results)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
             for row in rows]  # fmt: skip
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


# --- The run ----------------------------------------------------------------------------------


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.growth", description=__doc__)
    parser.add_argument("--rows", type=int, default=10_000_000, help="rows in each table")
    parser.add_argument("--quick", action="store_true", help="20,000 rows: a check that it runs")
    parser.add_argument("--batches", type=int, default=40, help="claims timed per measurement")
    parser.add_argument("--requests", type=int, default=200, help="HTTP calls timed per kind")
    parser.add_argument("--repeat", type=int, default=3, help="loads per admin page")
    parser.add_argument("--purge-seconds", type=float, default=15.0, help="per table")
    parser.add_argument(
        "--load-rate", type=int, default=OUTBOX_RATE, help="relay-like messages a second"
    )
    parser.add_argument(
        "--claim-only",
        action="store_true",
        help="only the relay's claim and its parts, beside --rows sent messages alone",
    )
    parser.add_argument("--database", default=DATABASE, help="the database to create and drop")
    parser.add_argument("--keep", action="store_true", help="keep the database afterwards")
    parser.add_argument("--json", type=Path, default=RESULTS, help="where to write the results")
    args = parser.parse_args(list(argv))
    if args.quick:
        args.rows, args.batches, args.requests, args.repeat = 20_000, 5, 20, 1
        args.purge_seconds = 2.0
    if args.rows < 1000:
        parser.error("--rows must be at least 1000")
    return args


def setup(url: str) -> None:
    """The test project's settings on ``url``, migrated."""
    os.environ["DATABASE_URL"] = url
    os.environ["DJANGO_SETTINGS_MODULE"] = "testproject.settings"
    os.environ["IDEMPOTENCY_LOG_LEVEL"] = "WARNING"
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    if connection.vendor != "postgresql":
        raise SystemExit("bench/growth.py seeds with generate_series: PostgreSQL only.")
    call_command("migrate", verbosity=0)


def claim_only(args: argparse.Namespace) -> dict[str, Any]:
    """``--claim-only``: the relay's claim, and its parts, beside an outbox of ``--rows`` sent
    messages and nothing else; the claim with stale statistics twice, then fresh."""
    runs: dict[str, Any] = {}
    analyze_outbox_quiet()
    add_pending("small")
    runs["small"] = relay_claim(args.batches)
    execute(f"TRUNCATE {OUTBOX}")
    log(f"== seeding {args.rows:,} sent outbox messages")
    started = time.perf_counter()
    step = 1.1 * 7 * 86400 / args.rows
    execute(SENT_SQL, {"rows": args.rows, "step": step, "ttl": "7 days", "keys": KEYS})
    with autocommit():
        execute(f"VACUUM ANALYZE {OUTBOX}")
    seeded = round(time.perf_counter() - started, 1)
    analyze_outbox_quiet()
    add_pending("big")
    runs["stale"] = relay_claim(args.batches)
    runs["stale, again"] = relay_claim(args.batches)
    execute(f"ANALYZE {OUTBOX}")
    runs["fresh"] = relay_claim(args.batches)
    for name, fig in runs.items():
        print(f"{name:<14} whole p50 {fig['whole']['p50']:6.1f} ms  parts {fig['parts_p50']}")
    return {"rows": args.rows, "seeding_seconds": seeded, "claim_only": runs}


def run(url: str, args: argparse.Namespace) -> dict[str, Any]:
    from bench.admin import superuser_client

    client = superuser_client()
    from django.contrib.auth import get_user_model

    user = get_user_model().objects.get(username="bench")
    small: dict[str, Any] = {}
    big: dict[str, Any] = {}
    log(f"== small tables: {PENDING:,} pending messages over {KEYS:,} keys, analyzed empty")
    analyze_outbox_quiet()
    add_pending("small")
    small["claim"] = relay_claim(args.batches)
    small["http"] = http_claim(args.requests, user, "small")
    small["status"] = status()
    small["status_command"] = status_command()
    execute(f"TRUNCATE {OUTBOX}")
    log(f"== seeding {args.rows:,} rows in each of four tables")
    started = time.perf_counter()
    seeding = seed(args.rows)
    seeding["total"] = round(time.perf_counter() - started, 1)
    log(f"   seeded in {seeding['total']:.0f} s: {seeding}")
    analyze_outbox_quiet()  # VACUUM ANALYZE ran with nothing pending; keep it so
    add_pending("big")
    log("== the relay's claim, statistics taken with nothing pending")
    big["claim_stale"] = relay_claim(args.batches)
    execute(f"ANALYZE {OUTBOX}")
    log("== the relay's claim, fresh statistics")
    big["claim"] = relay_claim(args.batches)
    log("== the HTTP core")
    big["http"] = http_claim(args.requests, user, "big")
    log("== idempotency_status")
    big["status"] = status()
    big["status_command"] = status_command()
    log("== admin list pages")
    big["admin"] = admin_pages(client, args.repeat)
    log("== the purge, beside a relay-like load")
    big["purge"] = purge(url, args.purge_seconds, args.load_rate)
    sizes = execute(
        "SELECT relname, pg_total_relation_size(oid) FROM pg_class "
        "WHERE relname LIKE 'django_idempotency_%%' AND relkind = 'r' ORDER BY 2 DESC"
    )
    return {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "postgresql": scalar("SHOW server_version"),
        "rows": args.rows,
        "pending": PENDING,
        "keys": KEYS,
        "seeding_seconds": seeding,
        "table_bytes": {name: size for name, size in sizes if size > 1_000_000},
        "small": small,
        "big": big,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    server = os.environ.get("BENCH_PG_URL", "postgres://postgres@127.0.0.1:5432/postgres")
    if not server.startswith(("postgres://", "postgresql://")):
        print("bench/growth.py needs PostgreSQL: BENCH_PG_URL=postgres://...", file=sys.stderr)
        return 2
    url = database_url(server, args.database)
    recreate_database(server, args.database)
    try:
        setup(url)
        if args.claim_only:
            results = claim_only(args)
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=2) + "\n")
            return 0
        results = run(url, args)
    finally:
        from django.db import connections

        connections.close_all()
        if not args.keep:
            recreate_database(server, args.database, drop_only=True)
    print(json.dumps(results, indent=2, default=str))
    print()
    print(table(results))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
    log(f"== wrote {args.json}")
    failed = [row[0] for row in verdicts(results) if row[4] != "yes"]
    if failed:
        log(f"!! outside their bounds: {', '.join(failed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
