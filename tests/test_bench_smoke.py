"""Keeps bench/ from rotting: the benchmark project, load generator and report, in seconds.

No timing is asserted and no competitor library is needed: the benchmark project runs its ``app``
variant (this app and the bare views) on a scratch SQLite file in a subprocess, since it has its
own settings. The real benchmark is ``make bench`` (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from bench import compare, micro, microrun, run
from bench.loadgen import Target, race, run_load

pytestmark = pytest.mark.sqlite  # no database of the suite is used; once per run is enough

REPO = Path(__file__).resolve().parent.parent

IN_PROCESS = r"""
import json, sys
from bench.benchproject.prepare import prepare
prepare()
from django.test import Client
from bench.benchproject.models import Effect

client = Client(HTTP_AUTHORIZATION="Bearer bench")
body = json.dumps({"amount_cents": 1250})
out = {}
for name, path, key in [
    ("bare", "/bare/", None),
    ("bare-atomic", "/bare-atomic/", None),
    ("bare-drf", "/bare-drf/", None),
    ("app-first", "/app/", "smoke-key-1"),
    ("app-replay", "/app/", "smoke-key-1"),
]:
    extra = {"HTTP_IDEMPOTENCY_KEY": key} if key else {}
    response = client.post(path, body, content_type="application/json", **extra)
    out[name] = {
        "status": response.status_code,
        "body": response.content.decode(),
        "replayed": response.headers.get("Idempotent-Replayed"),
        "statements": response.headers.get("X-Bench-Statements"),
    }
names = ("bare", "bare-atomic", "bare-drf", "app")
out["effects"] = {n: Effect.objects.filter(name=n).count() for n in names}
print(json.dumps(out))
"""


def bench_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "DJANGO_SETTINGS_MODULE": "bench.benchproject.settings",
            "BENCH_VARIANT": "app",
            "BENCH_DATABASE_URL": f"sqlite:///{tmp_path / 'bench.sqlite3'}",
            "PYTHONPATH": str(REPO),
        }
    )
    return env


def run_python(args: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_app_variant_views_answer_and_replay(tmp_path: Path) -> None:
    out = json.loads(run_python(["-c", IN_PROCESS], bench_env(tmp_path)).splitlines()[-1])

    for name in ("bare", "bare-atomic", "bare-drf", "app-first", "app-replay"):
        assert out[name]["status"] == 201, (name, out[name])
        assert out[name]["statements"] is not None, name
    assert out["app-replay"]["replayed"] == "true"
    assert out["app-replay"]["body"] == out["app-first"]["body"]
    assert out["effects"] == {"bare": 1, "bare-atomic": 1, "bare-drf": 1, "app": 1}


def test_consumer_benchmark_runs(tmp_path: Path) -> None:
    env = bench_env(tmp_path)
    run_python(["-m", "bench.benchproject.prepare"], env)

    result = json.loads(
        run_python(["-m", "bench.consumer", "--events", "5", "--rounds", "1"], env).splitlines()[
            -1
        ]
    )

    rows = {row["row"]: row for row in result["rows"]}
    assert {"effect alone", "try_reserve + effect", "duplicate (try_reserve)"} <= set(rows)
    for name, row in rows.items():
        assert "error" not in row, (name, row)
        assert row["statements"] >= 1, (name, row)


def test_micro_benchmark_runs_every_row(tmp_path: Path) -> None:
    env = bench_env(tmp_path)
    run_python(["-m", "bench.benchproject.prepare"], env)

    result = json.loads(
        run_python(["-m", "bench.micro", "--requests", "3", "--rounds", "2"], env).splitlines()[-1]
    )

    rows = {row["row"]: row for row in result["rows"]}
    assert list(rows) == list(micro.ROWS)
    for name, row in rows.items():
        assert row["us_per_request"] > 0, (name, row)
        assert len(row["us_rounds"]) == 2, (name, row)
    assert rows["bare"]["ratio_to_bare"] == 1.0
    # The statements each path sends (SQLite counts Django's BEGIN as one): the app adds two
    # on a first execution (claim, store) and a replay reads the stored response.
    assert rows["bare"]["statements"] == 1
    assert rows["app-first"]["statements"] == rows["bare-atomic"]["statements"] + 2
    assert rows["floor-first"]["statements"] == 3
    table = "\n".join(microrun.micro_tables([{**result, "backend": "sqlite"}]))
    assert "| this app, first execution |" in table
    # Encryption at rest: each encrypted row against its plaintext twin, and the same
    # statements (encryption adds no query).
    for encrypted, plain in micro.ENCRYPTED_OF.items():
        assert rows[encrypted]["ratio_to_plaintext"] > 0, rows[encrypted]
        assert rows[encrypted]["statements"] == rows[plain]["statements"]


def test_charts_render_svg(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from bench import charts

    row = {
        "row": "app-first",
        "label": "this app, first execution",
        "ratio_to_bare": 2.0,
        "ratio_min": 1.8,
        "ratio_max": 2.4,
        "statements": 3,
    }
    bare = {**row, "row": "bare", "label": "bare view", "ratio_to_bare": 1.0, "statements": 1}
    written = charts.render({"micro": [{"backend": "sqlite", "rows": [bare, row]}]}, tmp_path)

    assert [path.name for path in written] == ["micro-sqlite.svg"]
    svg = written[0].read_text()
    assert svg.startswith("<?xml") and "this app, first execution" in svg


class Handler(BaseHTTPRequestHandler):
    """Answers every POST 201 with a statement count, as the benchmark project does."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps({"key": self.headers.get("Idempotency-Key")}).encode()
        self.send_response(201)
        self.send_header("Content-Type", "application/json")
        self.send_header("X-Bench-Statements", "3/1")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[ThreadingHTTPServer]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def test_load_generator_counts_answers_and_statements(server: ThreadingHTTPServer) -> None:
    target = Target("127.0.0.1", server.server_address[1], "/x/", timeout=5)

    result = run_load(target, clients=2, seconds=0.3, mode="replay", max_requests=40)

    assert 0 < result.requests <= 40
    assert result.statuses == {201: result.requests}
    assert result.statements == {"201:3/1": result.requests}
    assert not result.errors
    answers = race(target, duplicates=4, key="same")
    assert [getattr(a, "status", a) for a in answers] == [201] * 4
    assert {getattr(a, "body", b"") for a in answers} == {b'{"key": "same"}'}


def test_report_renders_targets_from_figures() -> None:
    results = {
        "http": [
            {
                "row": "app-first",
                "label": "this app, first execution",
                "clients": 8,
                "rps": 100.0,
                "p50_ms": 2.0,
                "p99_ms": 4.0,
                "p50_ratio": 1.5,
                "rps_ratio": 0.7,
                "statements": 5,
                "statements_added": 3,
                "ok_share": 1.0,
                "statuses": {"201": 10},
                "baseline": "bare",
            }
        ],
        "micro": [
            {
                "backend": "postgres",
                "rows": [
                    {"row": "bare", "ratio_to_bare": 1.0, "best_ratio": 1.0, "statements": 1},
                    {"row": "app-first", "ratio_to_bare": 2.4, "best_ratio": 2.1},
                ],
            }
        ],
        "race": [{"variant": "app", "effects": 1}],
        "consumer": {"rows": [{"row": "try_reserve + effect", "p50_ratio_to_effect_alone": 1.2}]},
    }

    by_name = {t["target"]: t for t in run.targets(results)}

    in_process = "first execution in-process <= 2.2x the bare view (PostgreSQL, median of rounds)"
    assert by_name[in_process]["met"] is False
    assert by_name["the same, best rounds (each row's fastest round)"]["met"] is True
    assert by_name["first execution >= 0.6x the bare view's req/s (HTTP, 8 clients)"]["met"]
    assert by_name["statements added on a first execution <= 2"]["met"] is False
    assert by_name["zero double effects under 16 concurrent duplicates (effects == 1)"]["met"]
    assert by_name["try_reserve + effect <= 1.3x the effect alone (p50)"]["met"] is True
    assert by_name["replay p50 below the bare view's (HTTP, 8 clients)"]["met"] is None
    table = run.tables({"http": results["http"], "targets": run.targets(results)})
    assert "| this app, first execution | 8 | 100 | 2.00 | 4.00 | 1.50x (bare) |  |" in table


def test_compare_flags_only_a_slowdown_beyond_the_rounds_noise() -> None:
    def rounds(us: list[float]) -> list[dict[str, dict[str, float]]]:
        bare = {"us": 100.0, "cpu": 90.0, "rel": 1.0}
        return [{"bare": bare, "app": {"us": u, "cpu": u, "rel": u / 100}} for u in us]

    base = rounds([200.0, 210.0, 190.0, 205.0, 195.0])
    steady = compare.summarise({"base": base, "this": rounds([202.0, 208.0, 193.0, 204.0, 197.0])})
    slower = compare.summarise({"base": base, "this": rounds([260.0, 270.0, 250.0, 265.0, 255.0])})

    by_row = {r["row"]: r for r in steady}
    assert by_row["bare"]["ratio"] == 1.0 and not by_row["bare"]["slower_beyond_noise"]
    assert not by_row["app"]["slower_beyond_noise"]
    assert by_row["app"]["rounds_slower"] == 3
    app = {r["row"]: r for r in slower}["app"]
    assert app["slower_beyond_noise"] and app["rounds_slower"] == 5
    assert app["ratio"] == app["rel_ratio"] == 1.3
    table = compare.compare_table({"checkouts": {"base": "old", "this": "new"}, "micro": slower})
    assert "| micro | app | 200 | 260 | 1.300 **slower beyond noise** | 1.29-1.32 | 5/5 |" in table
    assert "| 2.00 / 2.60 | 1.300 (1.29-1.31) |" in table
