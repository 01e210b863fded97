"""In-process microbenchmark: microseconds per request, no HTTP, no load generator.

Each row calls a view of the benchmark project directly with a request built beforehand (so
building it is not timed), one request after another on one connection:

* ``bare``: the plain view, one autocommit ``INSERT``;
* ``bare-atomic``: the same view in ``transaction.atomic``;
* ``app-first``: the view under ``@idempotent`` with a new key each time;
* ``app-replay``: the same view and one key, already completed (every call is a replay);
* ``floor-bare``, ``floor-first``, ``floor-replay``: the raw-SQL floor, the same statements as
  the three rows above sent straight through the driver's own cursor (no Django), on PostgreSQL
  as prepared statements unless the connection goes through PgBouncer.
* ``otel-noop-first`` and ``otel-sdk-first`` (when ``opentelemetry-sdk`` is installed): the
  ``app-first`` row with telemetry recording through OpenTelemetry's no-op providers (the
  ``otel`` extra without an SDK), and through a real SDK whose spans go to an in-memory
  exporter and metrics to an in-memory reader. ``app-first`` itself records nothing, as without
  the extra; ``ratio_to_app_first`` is the cost of telemetry on a first execution.
* ``app-first-1k``, ``app-replay-1k``, ``crypto-first-1k``, ``crypto-replay-1k`` (when
  ``cryptography`` is installed): a view answering a 1 kB JSON body, first execution and replay,
  without keys and with ``ENCRYPTION_KEYS`` set (one key; the replayed record was stored
  encrypted). ``ratio_to_plaintext`` of the two ``crypto-`` rows is the cost of encryption at
  rest, and the run prints both on stderr, side by side.

The rows take turns request by request (the order rotates each round), so that outside load
hits every row alike, and a ratio is the median of the per-round ratios to ``bare``. On 2
shared cores this is far steadier than HTTP, and it shows the cost of the library itself.
Run in its own process with the benchmark settings::

    BENCH_DATABASE_URL=postgres://postgres@127.0.0.1:5432/idempotency_bench_app \\
        python -m bench.micro --requests 300 --rounds 7

It prints one JSON document on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from importlib.util import find_spec
from typing import Any

from bench.rounds import rotation

OTEL_ROWS = ("otel-noop-first", "otel-sdk-first") if find_spec("opentelemetry.sdk") else ()
CRYPTO_ROWS = (
    ("app-first-1k", "crypto-first-1k", "app-replay-1k", "crypto-replay-1k")
    if find_spec("cryptography")
    else ()
)
#: Each encrypted row and the plaintext row its ratio is taken to (ENCRYPTION_KEYS, issue 37).
ENCRYPTED_OF = {"crypto-first-1k": "app-first-1k", "crypto-replay-1k": "app-replay-1k"}
ROWS = (
    "bare",
    "bare-atomic",
    "app-first",
    "app-replay",
    "floor-bare",
    "floor-first",
    "floor-replay",
    *OTEL_ROWS,
    *CRYPTO_ROWS,
)
LABELS = {
    "bare": "bare view",
    "bare-atomic": "bare view in transaction.atomic",
    "app-first": "this app, first execution",
    "app-replay": "this app, replay",
    "floor-bare": "raw SQL floor: the bare INSERT",
    "floor-first": "raw SQL floor: first execution",
    "floor-replay": "raw SQL floor: replay",
    "otel-noop-first": "this app, first execution, otel API with no-op providers",
    "otel-sdk-first": "this app, first execution, otel SDK, in-memory exporter",
    "app-first-1k": "this app, first execution, 1 kB response",
    "app-replay-1k": "this app, replay, 1 kB response",
    "crypto-first-1k": "this app, first execution, 1 kB response, ENCRYPTION_KEYS set",
    "crypto-replay-1k": "this app, replay of an encrypted 1 kB response",
}
OWNER = "bench-owner"
BODY = json.dumps({"amount_cents": 1250}).encode()


def _setup() -> None:
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.benchproject.settings")
    os.environ.setdefault("BENCH_VARIANT", "app")
    django.setup()


def _requests(count: int, key: Callable[[int], str | None]) -> list[Any]:
    from django.test import RequestFactory

    from bench.benchproject.middleware import bench_user

    factory = RequestFactory()
    user = bench_user()
    built = []
    for index in range(count):
        extra = {}
        value = key(index)
        if value is not None:
            extra["HTTP_IDEMPOTENCY_KEY"] = value
        request = factory.post("/x/", BODY, content_type="application/json", **extra)
        request.user = user
        built.append(request)
    return built


class Floor:
    """The raw SQL of each path, through the driver's own connection, as fast as it goes."""

    def __init__(self, pooled: bool) -> None:
        from django.db import connection

        from django_idempotency.http.store import CLAIM_POSTGRESQL, _statements, advisory_lock_id

        connection.ensure_connection()
        self.vendor = connection.vendor
        self.raw = connection.connection  # the DB-API connection Django opened
        self.lock_id = advisory_lock_id
        self.claim = CLAIM_POSTGRESQL
        self.statements = _statements(connection)
        self.insert = (
            "INSERT INTO benchproject_effect (name, payload, amount_cents, created_at) "
            "VALUES (%s, %s, %s, %s)"
        )
        self.prepare = self.vendor == "postgresql" and not pooled
        if self.vendor == "postgresql":
            import psycopg

            # A server-binding cursor, so that prepare=True really prepares.
            self.cursor = psycopg.Cursor(self.raw)
        else:
            self.cursor = self.raw.cursor()
        self.replay_key = f"floor-replay-{uuid.uuid4()}"
        self.statements_sent = 0
        """Statements sent (not BEGIN or COMMIT), as the Django rows count them."""

    def _execute(self, sql: str, params: list[Any]) -> None:
        self.statements_sent += 1
        if self.vendor == "postgresql":
            self.cursor.execute(sql, params, prepare=self.prepare)
        elif self.vendor == "sqlite":
            self.cursor.execute(sql.replace("%%", "%").replace("%s", "?"), params)
        else:
            self.cursor.execute(sql.replace("%%", "%"), params)

    def _begin(self) -> None:
        if self.vendor == "postgresql":
            self.raw.autocommit = False  # psycopg sends BEGIN with the next statement
        else:
            self.cursor.execute("START TRANSACTION" if self.vendor == "mysql" else "BEGIN")

    def _commit(self) -> None:
        if self.vendor == "sqlite":
            self.cursor.execute("COMMIT")
            return
        self.raw.commit()
        if self.vendor == "postgresql":
            self.raw.autocommit = True

    def _now(self) -> Any:
        from django.utils import timezone

        now = timezone.now()
        return now if self.vendor == "postgresql" else now.replace(tzinfo=None).isoformat(" ")

    def bare(self, name: str) -> None:
        self._execute(self.insert, ["floor-bare", name, 1250, self._now()])

    def first(self, key: str) -> None:
        self._begin()
        record_id = self._claim(key)
        self._execute(self.insert, ["floor-first", key, 1250, self._now()])
        body = json.dumps({"id": 1, "name": "floor", "amount_cents": 1250}).encode()
        headers = json.dumps({"Content-Type": "application/json"})
        token = self._token
        self._execute(self.statements.complete, [201, headers, body, record_id, token])
        self._commit()

    def replay(self, key: str) -> None:
        self._begin()
        self._claim(key)
        self._commit()

    def _claim(self, key: str) -> int | None:
        token = uuid.uuid4()
        fingerprint = "f" * 64
        if self.vendor == "postgresql":
            self._token = token
            params = [OWNER, key, fingerprint, "POST", "/x/", token, None]
            params += [_day(), self.lock_id(OWNER, key)]
            self._execute(self.claim, params)
            row = self.cursor.fetchone()
            return int(row[1]) if row[1] is not None else None
        self._token = token.hex
        day = "+86400.000000 seconds" if self.vendor == "sqlite" else 86_400_000_000
        params = [OWNER, key, fingerprint, "POST", "/x/", token.hex, None, day]
        try:
            self._execute(self.statements.insert, params)
        except Exception as exc:
            if not exc.args or exc.args[0] != 1062:
                raise
        else:
            if self.cursor.rowcount == 1:
                return int(self.cursor.lastrowid)
        self._execute(self.statements.select, [OWNER, key])
        row = self.cursor.fetchone()
        return int(row[0]) if row else None


def _no_cpu() -> int:
    return 0


def _backend_cpu_reader(connection: Any, pooled: bool) -> Callable[[], int]:
    """Nanoseconds of CPU the PostgreSQL backend of ``connection`` has used, when it runs on
    this machine and the connection is direct (through a pooler the backend changes)."""
    if connection.vendor != "postgresql" or pooled:
        return _no_cpu
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (pid,) = cursor.fetchone()
    path = f"/proc/{pid}/schedstat"
    if not os.path.exists(path):
        return _no_cpu

    def read() -> int:
        with open(path, "rb") as stat:
            return int(stat.read().split()[0])

    return read


def _day() -> Any:
    from datetime import timedelta

    return timedelta(days=1)


def _telemetry_switch(
    names: tuple[str, ...],
) -> Callable[[str, Callable[[Any], Any]], Callable[[Any], Any]]:
    """``switch(mode, view)``: the view, recording telemetry as ``mode`` says for each call.

    ``off`` records nothing (as without the ``otel`` extra), ``noop`` goes through
    OpenTelemetry's no-op providers, ``sdk`` through an SDK with in-memory exporters. The rows
    take turns request by request, so each call puts its own state in place, then the one
    before it back. Every row goes through the switch, so its cost is in every row alike.
    """
    try:
        from django_idempotency import telemetry
    except ImportError:  # an older version of the app, without telemetry
        return lambda mode, view: view
    states: dict[str, tuple[Any, dict[str, Any]]] = {"off": (None, {})}
    if any(name.startswith("otel-") for name in names):
        from opentelemetry.metrics import NoOpMeterProvider
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
            InMemorySpanExporter,
        )
        from opentelemetry.trace import NoOpTracerProvider

        telemetry.configure(NoOpTracerProvider(), NoOpMeterProvider())
        states["noop"] = (telemetry._state.api, {})
        tracer_provider = TracerProvider()
        exporter = InMemorySpanExporter()
        tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
        meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
        telemetry.configure(tracer_provider, meter_provider)
        states["sdk"] = (telemetry._state.api, {})
        telemetry.reset()
    state = telemetry._state
    state.loaded = True

    def switch(mode: str, view: Callable[[Any], Any]) -> Callable[[Any], Any]:
        api, instruments = states[mode]

        def call(request: Any) -> Any:
            before = state.api, state.instruments
            state.api, state.instruments = api, instruments
            try:
                return view(request)
            finally:
                state.api, state.instruments = before
                if mode == "sdk":
                    exporter.clear()  # an in-memory exporter keeps every span otherwise

        return call

    return switch


def _encryption_switch() -> Callable[[str, Callable[[Any], Any]], Callable[[Any], Any]]:
    """``switch(mode, view)``: the view, with ``ENCRYPTION_KEYS`` empty (``off``) or set to one
    key (``on``) for each call. The rows take turns request by request, so each call puts its
    keys in place (the parsed setting and the ready keyring, as they are once a process has read
    them), then the ones before it back; both modes go through the switch alike."""
    try:
        from django_idempotency.conf import conf
        from django_idempotency.protection import keys as protection_keys
    except ImportError:  # an older version of the app, without encryption at rest
        return lambda mode, view: view
    on = (os.urandom(32),)
    states = {"off": ((), None), "on": (on, protection_keys.Keyring(on))}
    cache = conf._cache

    def switch(mode: str, view: Callable[[Any], Any]) -> Callable[[Any], Any]:
        value, ring = states[mode]

        def call(request: Any) -> Any:
            before = cache.get("ENCRYPTION_KEYS"), protection_keys._cache
            cache["ENCRYPTION_KEYS"], protection_keys._cache = value, (value, ring)
            try:
                return view(request)
            finally:
                cache["ENCRYPTION_KEYS"], protection_keys._cache = before

        return call

    return switch


def build_rows(
    pooled: bool, names: tuple[str, ...] = ROWS
) -> tuple[dict[str, tuple[Callable[[Any], Any], str]], Floor | None]:
    """name -> (call(item), what each call takes: "request-new", "request-replay", "key")."""
    from django.db import transaction

    from bench.benchproject.views import plain_view
    from django_idempotency import idempotent

    app = idempotent(plain_view("app"))
    switch = _telemetry_switch(names)
    rows: dict[str, tuple[Callable[[Any], Any], str]] = {
        "bare": (plain_view("bare"), "request"),
        "bare-atomic": (transaction.atomic(plain_view("bare-atomic")), "request"),
        "app-first": (switch("off", app), "request-new"),
        "app-replay": (switch("off", app), "request-replay"),
    }
    if "otel-noop-first" in names:
        rows["otel-noop-first"] = (switch("noop", app), "request-new")
        rows["otel-sdk-first"] = (switch("sdk", app), "request-new")
    if any(name in names for name in CRYPTO_ROWS):
        from bench.benchproject.views import plain_view_1k

        app_1k = idempotent(plain_view_1k("app"))
        keys = _encryption_switch()
        rows["app-first-1k"] = (keys("off", app_1k), "request-new")
        rows["app-replay-1k"] = (keys("off", app_1k), "request-replay-1k")
        rows["crypto-first-1k"] = (keys("on", app_1k), "request-new")
        rows["crypto-replay-1k"] = (keys("on", app_1k), "request-replay-1k-crypto")
    if not any(name.startswith("floor") for name in names):
        return rows, None  # e.g. an older version of the app, without the floor's statements
    floor = Floor(pooled)
    rows["floor-bare"] = (floor.bare, "key")
    rows["floor-first"] = (floor.first, "key")
    rows["floor-replay"] = (lambda _: floor.replay(floor.replay_key), "key")
    floor.first(floor.replay_key)  # the record every floor replay reads
    return rows, floor


def run(requests: int, rounds: int, pooled: bool, names: tuple[str, ...] = ROWS) -> dict[str, Any]:
    _setup()
    from django.db import connection

    from bench.benchproject.middleware import StatementCounter

    rows, floor = build_rows(pooled, names)
    replay_key = f"micro-replay-{uuid.uuid4()}"
    prime = _requests(1, lambda i: replay_key)[0]
    response = rows["app-replay"][0](prime)
    if response.status_code != 201:
        raise RuntimeError(f"priming the replay answered {response.status_code}")
    replay_keys = {"request-replay": replay_key}
    for kind, row in (
        ("request-replay-1k", "app-replay-1k"),
        ("request-replay-1k-crypto", "crypto-replay-1k"),
    ):
        if row in names:  # a stored 1 kB response, plaintext or encrypted, to replay
            replay_keys[kind] = f"micro-{kind}-{uuid.uuid4()}"
            primed = rows[row][0](_requests(1, lambda i, k=replay_keys[kind]: k)[0])
            if primed.status_code != 201 or len(primed.content) != 1024:
                raise RuntimeError(f"priming {row} answered {primed.status_code}")
    per_round: dict[str, list[float]] = {name: [] for name in names}
    statements: dict[str, Counter[str]] = {name: Counter() for name in names}

    def items(kind: str, count: int) -> list[Any]:
        if kind == "request":
            return _requests(count, lambda i: None)
        if kind == "request-new":
            return _requests(count, lambda i: f"micro-{uuid.uuid4()}")
        if kind in replay_keys:
            return _requests(count, lambda i: replay_keys[kind])
        return [f"floor-{uuid.uuid4()}" for _ in range(count)]

    for name in names:  # warm-up: imports, plan caches (PL/pgSQL, prepared statements)
        call, kind = rows[name]
        for item in items(kind, 30):
            call(item)
    perf_counter, thread_time = time.perf_counter, time.thread_time
    backend_cpu = _backend_cpu_reader(connection, pooled)
    cpu_rounds: dict[str, list[float]] = {name: [] for name in names}
    client_rounds: dict[str, list[float]] = {name: [] for name in names}
    server_rounds: dict[str, list[float]] = {name: [] for name in names}
    for round_no in range(rounds):
        order = rotation(names, round_no)
        batches = {}
        for name in order:
            call, kind = rows[name]
            batches[name] = batch = items(kind, requests)
            if not name.startswith("floor"):  # statements of the Django rows, untimed
                with StatementCounter().counting() as counter:
                    call(batch.pop())
                statements[name][counter.header] += 1
            elif floor is not None:
                floor.statements_sent = 0
                call(batch.pop())
                commits = 0 if name == "floor-bare" else 1
                statements[name][f"{floor.statements_sent}/{commits}"] += 1
        # Request by request, the rows take turns: a burst of outside load (2 shared cores)
        # then hits every row alike, instead of whichever row ran at that moment.
        spent = dict.fromkeys(order, 0.0)
        client = dict.fromkeys(order, 0.0)
        server = dict.fromkeys(order, 0)
        for index in range(requests - 1):
            for name in order:
                call = rows[name][0]
                item = batches[name][index]
                before = backend_cpu()
                cpu = thread_time()
                began = perf_counter()
                call(item)
                spent[name] += perf_counter() - began
                client[name] += thread_time() - cpu
                server[name] += backend_cpu() - before
        for name in order:
            per_round[name].append(spent[name] / (requests - 1) * 1e6)
            client_rounds[name].append(client[name] * 1e6 / (requests - 1))
            server_rounds[name].append(server[name] / 1e3 / (requests - 1))
            cpu_rounds[name].append(client_rounds[name][-1] + server_rounds[name][-1])
    out: dict[str, Any] = {
        "cpu_measured": "client+server" if backend_cpu is not _no_cpu else "client",
        "vendor": connection.vendor,
        "pooled": pooled,
        "requests_per_round": requests,
        "rounds": rounds,
        "rows": [],
    }
    for name in names:
        us = per_round[name]
        ratios = [a / b for a, b in zip(us, per_round["bare"], strict=True)]
        entry: dict[str, Any] = {
            "row": name,
            "label": LABELS[name],
            "us_per_request": round(statistics.median(us), 1),
            "us_rounds": [round(u, 1) for u in us],
            "ratio_to_bare": round(statistics.median(ratios), 3),
            "ratio_min": round(min(ratios), 3),
            "ratio_max": round(max(ratios), 3),
            # Each row's fastest round against the bare view's fastest: the least disturbed
            # figure on a shared machine.
            "best_ratio": round(min(us) / min(per_round["bare"]), 3),
            # CPU time per request: this process, plus the PostgreSQL backend (read from
            # /proc/<pid>/schedstat, same machine, direct connection). Waiting (for a core, a
            # round trip, a WAL flush) is not in it, so it barely moves with outside load.
            "cpu_us_per_request": round(statistics.median(cpu_rounds[name]), 1),
            "client_cpu_us_per_request": round(statistics.median(client_rounds[name]), 1),
            "server_cpu_us_per_request": round(statistics.median(server_rounds[name]), 1),
            "cpu_ratio_to_bare": round(
                statistics.median(
                    a / b for a, b in zip(cpu_rounds[name], cpu_rounds["bare"], strict=True)
                ),
                3,
            ),
        }
        if name.startswith("otel-"):
            ratios = [a / b for a, b in zip(us, per_round["app-first"], strict=True)]
            entry["ratio_to_app_first"] = round(statistics.median(ratios), 3)
            entry["ratio_to_app_first_rounds"] = [round(r, 3) for r in ratios]
            pairs = zip(cpu_rounds[name], cpu_rounds["app-first"], strict=True)
            entry["cpu_ratio_to_app_first"] = round(statistics.median(a / b for a, b in pairs), 3)
        if name in ENCRYPTED_OF:
            plain = ENCRYPTED_OF[name]
            ratios = [a / b for a, b in zip(us, per_round[plain], strict=True)]
            entry["ratio_to_plaintext"] = round(statistics.median(ratios), 3)
            entry["ratio_to_plaintext_rounds"] = [round(r, 3) for r in ratios]
            pairs = zip(cpu_rounds[name], cpu_rounds[plain], strict=True)
            entry["cpu_ratio_to_plaintext"] = round(statistics.median(a / b for a, b in pairs), 3)
        if statements[name]:
            header = statements[name].most_common(1)[0][0]
            count, _, commits = header.partition("/")
            entry["statements"], entry["commits"] = int(count), int(commits)
        out["rows"].append(entry)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="requests per row per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--pooled", action="store_true", help="the connection goes through PgBouncer"
    )
    parser.add_argument(
        "--rows", default=",".join(ROWS), help="rows to run (bare first): %(default)s"
    )
    args = parser.parse_args(argv)
    if args.requests < 2:
        parser.error("--requests must be at least 2 (one call per row counts statements)")
    names = tuple(name for name in args.rows.split(",") if name)
    unknown = set(names) - set(ROWS)
    if unknown or not names or names[0] != "bare":
        parser.error(f"--rows must start with bare and name only {', '.join(ROWS)}")
    result = run(args.requests, args.rounds, args.pooled, names)
    encrypted = [row for row in result["rows"] if "ratio_to_plaintext" in row]
    if encrypted:  # side by side, for a reader; stdout stays one JSON document
        print(
            "encryption at rest, 1 kB response, vs the same without keys: "
            + ", ".join(
                f"{row['row']} {row['ratio_to_plaintext']:.3f}x "
                f"(CPU {row['cpu_ratio_to_plaintext']:.3f}x)"
                for row in encrypted
            ),
            file=sys.stderr,
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
