"""How fast are the admin list pages on a million rows? Seeds PostgreSQL and measures.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres .venv/bin/python bench/admin.py
    ... --rows 200000 --repeat 5

It creates a scratch test database (``test_idempotency_bench_admin``), fills
``IdempotencyRecord`` and ``ProcessedEvent`` with ``--rows`` rows each through
``generate_series`` (a few seconds per million), runs ``ANALYZE``, then loads each admin list page
as a logged-in superuser through Django's test client and prints, per page, the number of SQL
queries, the median and worst wall time over ``--repeat`` loads, and the slowest single query.
For scale it also prints what one plain ``COUNT(*)`` of each table costs: the query Django's
admin would run on every page without :class:`~django_idempotency.admin.EstimatedCountPaginator`.

tests/test_admin.py runs the same measurement on a smaller table in the PostgreSQL pass.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

RECORDS_SQL = """
INSERT INTO django_idempotency_idempotencyrecord
  (owner, key, fingerprint, method, path, state, token, response_status, response_headers,
   response_body, created_at, completed_at, expires_at)
SELECT 'user:' || mod(i, 1000),
       'key-' || i,
       md5(i::text) || md5((i + 1)::text),
       'POST',
       CASE mod(i, 4)
         WHEN 0 THEN '/api/orders/'
         WHEN 1 THEN '/api/payments/'
         WHEN 2 THEN '/api/refunds/'
         ELSE '/api/orders/' || mod(i, 50) || '/cancel/'
       END,
       CASE WHEN mod(i, 100) = 0 THEN 'in_progress' ELSE 'completed' END,
       md5(i::text)::uuid,
       CASE WHEN mod(i, 100) = 0 THEN NULL WHEN mod(i, 10) = 1 THEN 422 ELSE 201 END,
       '{"Content-Type": "application/json"}'::jsonb,
       convert_to('{"id": ' || i || ', "status": "confirmed"}', 'UTF8'),
       now() - make_interval(secs => i * %(step)s),
       now() - make_interval(secs => i * %(step)s),
       now() - make_interval(secs => i * %(step)s) + %(ttl)s::interval
FROM generate_series(1, %(rows)s) AS i
"""
"""``%(rows)s`` records, one every ``%(step)s`` seconds back from now, each expiring ``%(ttl)s``
after it was made (bench/growth.py seeds with it too)."""

EVENTS_SQL = """
INSERT INTO django_idempotency_processedevent (consumer, event_id, topic, processed_at, expires_at)
SELECT CASE mod(i, 3)
         WHEN 0 THEN 'billing.apply_order_confirmed'
         WHEN 1 THEN 'mail.send_receipt'
         ELSE 'stock.reserve'
       END,
       md5(i::text)::uuid::text,
       CASE mod(i, 2) WHEN 0 THEN 'orders' ELSE 'payments' END,
       now() - make_interval(secs => i * %(step)s),
       now() - make_interval(secs => i * %(step)s) + %(ttl)s::interval
FROM generate_series(1, %(rows)s) AS i
"""

RECORDS = "/admin/django_idempotency/idempotencyrecord/"
EVENTS = "/admin/django_idempotency/processedevent/"

PAGES = [
    ("records: first page", RECORDS),
    ("records: page 50", RECORDS + "?p=50"),
    ("records: state=completed", RECORDS + "?state__exact=completed"),
    ("records: status 4xx", RECORDS + "?status_class=4xx"),
    ("records: expired", RECORDS + "?expired=yes"),
    ("records: live", RECORDS + "?expired=no"),
    ("records: path", RECORDS + "?path=/api/refunds/"),
    ("records: search key", RECORDS + "?q=key-777"),
    ("records: search owner", RECORDS + "?q=user:7"),
    ("records: sort by expires", RECORDS + "?o=7"),
    ("events: first page", EVENTS),
    ("events: page 50", EVENTS + "?p=50"),
    ("events: consumer", EVENTS + "?consumer=mail.send_receipt"),
    ("events: topic", EVENTS + "?topic=orders"),
    ("events: search event id", EVENTS + "?q=c4ca4238-a0b9-2382-0dcc-509a6f75849b"),
]


def seed(rows: int) -> float:
    """Insert ``rows`` records and ``rows`` events (PostgreSQL only); return the seconds taken."""
    from django.db import connection

    if connection.vendor != "postgresql":
        raise SystemExit("bench/admin.py seeds with generate_series: PostgreSQL only.")
    started = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute(RECORDS_SQL, {"rows": rows, "step": 1, "ttl": "1 day"})
        cursor.execute(EVENTS_SQL, {"rows": rows, "step": 1, "ttl": "7 days"})
        cursor.execute("ANALYZE django_idempotency_idempotencyrecord")
        cursor.execute("ANALYZE django_idempotency_processedevent")
    return time.perf_counter() - started


@dataclass
class PageFigures:
    name: str
    url: str
    status: int
    queries: int
    median_ms: float
    worst_ms: float
    slowest_query_ms: float
    slowest_query: str


def measure(client: Any, name: str, url: str, repeat: int) -> PageFigures:
    """Load ``url`` once to warm up, then ``repeat`` times; count queries on the last load."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    client.get(url)
    timings = []
    for _ in range(repeat):
        with CaptureQueriesContext(connection) as queries:
            started = time.perf_counter()
            response = client.get(url)
            timings.append((time.perf_counter() - started) * 1000)
    slowest = max(queries.captured_queries, key=lambda q: float(q["time"]), default=None)
    return PageFigures(
        name=name,
        url=url,
        status=response.status_code,
        queries=len(queries.captured_queries),
        median_ms=statistics.median(timings),
        worst_ms=max(timings),
        slowest_query_ms=float(slowest["time"]) * 1000 if slowest else 0.0,
        slowest_query=(slowest["sql"] if slowest else "")[:100],
    )


def report(figures: list[PageFigures]) -> None:
    print(f"{'page':<28} {'status':>6} {'queries':>7} {'median ms':>10} {'worst ms':>9}  slowest")
    for fig in figures:
        print(
            f"{fig.name:<28} {fig.status:>6} {fig.queries:>7} {fig.median_ms:>10.1f} "
            f"{fig.worst_ms:>9.1f}  {fig.slowest_query_ms:.1f} ms: {fig.slowest_query}"
        )


def full_count_ms(table: str) -> float:
    """What one exact ``COUNT(*)`` costs, which the admin avoids on every page."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(f"SELECT COUNT(*) FROM {table}")  # warm the cache once
        started = time.perf_counter()
        cursor.execute(f"SELECT COUNT(*) FROM {table}")
        cursor.fetchone()
    return (time.perf_counter() - started) * 1000


def superuser_client() -> Any:
    from django.contrib.auth import get_user_model
    from django.test import Client

    user = get_user_model().objects.create_superuser("bench", "bench@example.com", "bench")
    client = Client()
    client.force_login(user)
    return client


@contextmanager
def scratch_database() -> Iterator[None]:
    """A fresh test database, destroyed afterwards."""
    from django.db import connection

    old_name = connection.settings_dict["NAME"]
    connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
    try:
        yield
    finally:
        connection.creation.destroy_test_db(old_name, verbosity=0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows per table")
    parser.add_argument("--repeat", type=int, default=5, help="loads per page")
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    os.environ["TEST_DB_SUFFIX"] = "_bench_admin"
    import django

    django.setup()
    from django.db import connection

    if connection.vendor != "postgresql":
        print("bench/admin.py needs PostgreSQL: set DATABASE_URL=postgres://...", file=sys.stderr)
        return 2
    with scratch_database():
        print(f"seeding {args.rows:,} idempotency records and {args.rows:,} processed events ...")
        print(f"seeded in {seed(args.rows):.1f} s")
        client = superuser_client()
        figures = [measure(client, name, url, args.repeat) for name, url in PAGES]
        detail = _first_record_url()
        figures.append(measure(client, "records: detail", detail, args.repeat))
        print()
        report(figures)
        print()
        for table in ("django_idempotency_idempotencyrecord", "django_idempotency_processedevent"):
            print(f"one exact COUNT(*) of {table}: {full_count_ms(table):.1f} ms (avoided)")
        bad = [fig for fig in figures if fig.status != 200]
        if bad:
            print(f"NOT 200: {', '.join(fig.name for fig in bad)}", file=sys.stderr)
            return 1
    return 0


def _first_record_url() -> str:
    from django_idempotency.models import IdempotencyRecord

    pk = IdempotencyRecord.objects.order_by("-created_at").values_list("pk", flat=True)[0]
    return f"{RECORDS}{pk}/change/"


if __name__ == "__main__":
    sys.exit(main())
