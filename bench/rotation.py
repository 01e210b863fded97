"""Key rotation benchmark: ``rotate_keys`` over a table of a million records, beside replays.

On PostgreSQL, in a database of its own (``idempotency_bench_rotation``, created here):

1. Seed ``--rows`` completed records (default 1,000,000) whose 1 kB responses are sealed with an
   old key, through ``COPY``: each one a first execution of the benchmark view's request, by the
   benchmark user, under its own key.
2. Replay a random sample of them for ``--baseline`` seconds through ``@idempotent`` in a
   thread (the quiet baseline), then run ``manage.py idempotency_rotate_keys`` with the new key
   first (batches of ``--batch-size``), in its own process, while the thread keeps replaying:
   every replay must be byte-identical to the stored response.
3. Check that no record is left under the old key, and replay a sample with the new key alone.

Usage::

    .venv/bin/python bench/rotation.py [--rows N] [--batch-size N] [--quick]

``BENCH_PG_URL`` (default ``postgres://postgres@127.0.0.1:5432/postgres``) names the server.
Prints a summary and writes ``bench/results/rotation.json``.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DATABASE = "idempotency_bench_rotation"
RESULTS = REPO / "bench" / "results" / "rotation.json"
TABLE = "django_idempotency_idempotencyrecord"
BODY = json.dumps({"amount_cents": 1250}).encode()


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _key() -> str:
    return base64.urlsafe_b64encode(os.urandom(32)).decode("ascii")


def setup(old: str, new: str) -> None:
    """A fresh, migrated database; Django set up on it with ``new, old`` as the keys."""
    from bench.servers import database_url, prepare_url, recreate_database

    recreate_database(DATABASE)
    prepare_url(database_url(DATABASE))
    os.environ["DJANGO_SETTINGS_MODULE"] = "bench.benchproject.settings"
    os.environ["BENCH_VARIANT"] = "app"
    os.environ["BENCH_DATABASE_URL"] = database_url(DATABASE)
    os.environ["IDEMPOTENCY_ENCRYPTION_KEYS"] = f"{new},{old}"
    import django

    django.setup()


def request(key: str) -> Any:
    from django.test import RequestFactory

    from bench.benchproject.middleware import bench_user

    built = RequestFactory().post(
        "/x/", BODY, content_type="application/json", HTTP_IDEMPOTENCY_KEY=key
    )
    built.user = bench_user()
    return built


def response_of(index: int) -> bytes:
    """The stored 1 kB answer of record ``index`` (what the view would have said)."""
    text = json.dumps({"id": index, "name": "app", "amount_cents": 1250, "note": ""})
    return text.replace('"note": ""', '"note": "' + "x" * (1024 - len(text)) + '"').encode()


def seed(rows: int, old: str) -> float:
    """``rows`` completed records sealed with ``old``, through COPY; returns the seconds."""
    from django.db import connection

    from django_idempotency.http.handler import request_fingerprint
    from django_idempotency.http.owner import resolve_owner
    from django_idempotency.protection.core import seal_response
    from django_idempotency.protection.keys import Keyring

    ring = Keyring((base64.urlsafe_b64decode(old),))
    sample = request("seed")
    owner, fingerprint = resolve_owner(sample), request_fingerprint(sample, "POST")
    headers = {"Content-Type": "application/json"}
    columns = (
        "owner, key, fingerprint, method, path, state, token, response_status, "
        "response_headers, response_body, created_at, completed_at, expires_at"
    )
    started = time.monotonic()
    connection.ensure_connection()
    raw = connection.connection
    with raw.cursor() as cursor, cursor.copy(f"COPY {TABLE} ({columns}) FROM STDIN") as copy:
        now = time.time()
        created = time.strftime("%Y-%m-%d %H:%M:%S+00", time.gmtime(now))
        expires = time.strftime("%Y-%m-%d %H:%M:%S+00", time.gmtime(now + 86_400))
        for index in range(rows):
            key = f"seed-{index}"
            stored, body = seal_response(ring, owner, key, headers, response_of(index), status=201)
            copy.write_row(
                (owner, key, fingerprint, "POST", "/x/", "completed", uuid.uuid4(), 201,
                 json.dumps(stored), body, created, created, expires)
            )  # fmt: skip
            if index and index % 200_000 == 0:
                log(f"   seeded {index:,} rows ({time.monotonic() - started:.0f} s)")
    raw.commit()
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {TABLE}")
    return time.monotonic() - started


class Replayer(threading.Thread):
    """Replays random seeded keys through ``@idempotent`` and times each one."""

    def __init__(self, rows: int) -> None:
        super().__init__(daemon=True)
        self.rows = rows
        self.phase = "baseline"
        self.latencies: dict[str, list[float]] = {"baseline": [], "rotation": [], "after": []}
        self.differing: list[str] = []
        self.other: dict[int, int] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        from django.db import connections

        from bench.benchproject.views import plain_view
        from django_idempotency import idempotent

        view = idempotent(plain_view("app"))
        try:
            while not self.stop.is_set():
                index = random.randrange(self.rows)
                built = request(f"seed-{index}")
                began = time.perf_counter()
                response = view(built)
                self.latencies[self.phase].append(time.perf_counter() - began)
                if response.status_code != 201:
                    self.other[response.status_code] = self.other.get(response.status_code, 0) + 1
                elif response.content != response_of(index):
                    self.differing.append(f"seed-{index}")
        finally:
            connections.close_all()


def summary(latencies: list[float]) -> dict[str, Any]:
    if not latencies:
        return {"replays": 0}
    ordered = sorted(latencies)
    return {
        "replays": len(ordered),
        "p50_ms": round(statistics.median(ordered) * 1e3, 2),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3, 2),
        "max_ms": round(ordered[-1] * 1e3, 2),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--baseline", type=float, default=5.0, help="quiet replay seconds")
    parser.add_argument("--quick", action="store_true", help="20,000 rows")
    args = parser.parse_args(argv)
    rows = 20_000 if args.quick else args.rows
    old, new = _key(), _key()
    setup(old, new)
    from django.db import connection

    from django_idempotency.protection.keys import key_id

    log(f"== seeding {rows:,} records sealed with the old key")
    seed_seconds = seed(rows, old)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT pg_size_pretty(pg_total_relation_size('{TABLE}'))")
        size = cursor.fetchone()[0]
    log(f"   {seed_seconds:.1f} s, table {size}")
    replayer = Replayer(rows)
    replayer.start()
    time.sleep(args.baseline)
    log(f"== rotating (manage.py idempotency_rotate_keys), batches of {args.batch_size}")
    replayer.phase = "rotation"
    started = time.monotonic()
    # Its own process, as in production: the replays here do not share its interpreter.
    command = [sys.executable, "-m", "django", "idempotency_rotate_keys"]
    done = subprocess.run(
        [*command, "--batch-size", str(args.batch_size)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
        check=False,
    )
    rotation_seconds = time.monotonic() - started
    log(done.stdout)
    if done.returncode:
        raise SystemExit(f"idempotency_rotate_keys exited with {done.returncode}")
    found = re.search(
        r"idempotency records: re-encrypted (\d+) in \d+ \w+ \(([\d.]+)s\)", done.stdout
    )
    if found is None:
        raise SystemExit(f"no result line in:\n{done.stdout}")
    resealed, records_seconds = int(found[1]), float(found[2])
    replayer.phase = "after"
    time.sleep(min(args.baseline, 2.0))
    replayer.stop.set()
    replayer.join(30)
    new_id = key_id(base64.urlsafe_b64decode(new))
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT count(*) FILTER (WHERE response_headers->>'@sealed' = %s), count(*) "
            f"FROM {TABLE}",
            [new_id],
        )
        under_new, total = cursor.fetchone()
    out = {
        "rows": rows,
        "table_size": size,
        "batch_size": args.batch_size,
        "seed_seconds": round(seed_seconds, 1),
        "rotation_seconds": round(rotation_seconds, 1),  # the command, start-up included
        "records_seconds": records_seconds,
        "rows_per_second": round(resealed / records_seconds),
        "resealed": resealed,
        "under_new_key": under_new,
        "records": total,
        "replays": {phase: summary(values) for phase, values in replayer.latencies.items()},
        "differing_replays": len(replayer.differing),
        "other_statuses": replayer.other,
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    log(json.dumps(out, indent=2))
    if under_new != total or replayer.differing or resealed != rows:
        raise SystemExit("the rotation left rows under the old key, or a replay differed")
    return out


if __name__ == "__main__":
    main()  # the seeded database is left for inspection; the next run recreates it
