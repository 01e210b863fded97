"""The ``micro`` section of the runner: bench/micro.py once per database, each in its own process.

Backends: ``postgres`` (direct), ``pgbouncer`` (the same PostgreSQL through PgBouncer in
transaction pooling mode, ``scripts/pgbouncer.sh start``), ``mariadb`` and ``sqlite``. A backend
that cannot be reached is reported as a problem and left out; nothing is started here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from bench.servers import REPO, prepare_url, recreate_database, variant_env

MICRO_BACKENDS = ("postgres", "pgbouncer", "mariadb", "sqlite")
DATABASE = "idempotency_bench_micro"
PGBOUNCER_URL = os.environ.get(
    "BENCH_PGBOUNCER_URL", "postgres://postgres@127.0.0.1:6432/postgres"
)
MARIADB_URL = os.environ.get("BENCH_MARIADB_URL", "mysql://root@127.0.0.1:3306/mysql")


def _with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, parts.fragment))


def _recreate_mariadb(name: str) -> None:
    import MySQLdb

    parts = urlsplit(MARIADB_URL)
    conn = MySQLdb.connect(
        host=parts.hostname or "127.0.0.1",
        port=parts.port or 3306,
        user=parts.username or "root",
        password=parts.password or "",
    )
    try:
        cursor = conn.cursor()
        cursor.execute(f"DROP DATABASE IF EXISTS `{name}`")
        cursor.execute(
            f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci"
        )
    finally:
        conn.close()


def _database(backend: str, scratch: Path) -> tuple[str, str, dict[str, str]]:
    """(URL to migrate through, URL to measure through, extra env) for one backend."""
    from bench.servers import database_url

    if backend == "postgres":
        recreate_database(DATABASE)
        return database_url(DATABASE), database_url(DATABASE), {}
    if backend == "pgbouncer":
        recreate_database(DATABASE)
        # Migrated directly (DDL needs no pooler); measured through the pooler.
        return (
            database_url(DATABASE),
            _with_database(PGBOUNCER_URL, DATABASE),
            {"BENCH_PGBOUNCER": "1"},
        )
    if backend == "mariadb":
        _recreate_mariadb(DATABASE)
        url = _with_database(MARIADB_URL, DATABASE)
        return url, url, {}
    if backend == "sqlite":
        url = f"sqlite:///{scratch / 'micro.sqlite3'}"
        return url, url, {}
    raise ValueError(f"unknown micro backend {backend!r}")


def run_micro(
    backends: Sequence[str],
    *,
    requests: int,
    rounds: int,
    problems: list[str],
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="idempotency-micro-") as tmp:
        for backend in backends:
            log(f"   micro: {backend}")
            try:
                migrate_url, url, extra = _database(backend, Path(tmp))
                prepare_url(migrate_url)
            except Exception as exc:  # noqa: BLE001 - reported; the backend is left out
                problems.append(f"micro {backend}: could not set up its database: {exc}")
                log(f"!! micro {backend}: {exc}")
                continue
            command = [sys.executable, "-m", "bench.micro"]
            command += ["--requests", str(requests), "--rounds", str(rounds)]
            if backend == "pgbouncer":
                command.append("--pooled")
            env = variant_env("app", DATABASE, BENCH_DATABASE_URL=url, **extra)
            done = subprocess.run(
                command, env=env, cwd=REPO, capture_output=True, text=True, timeout=1800
            )
            if done.returncode:
                problems.append(f"micro {backend} failed:\n{done.stderr.strip()[-2000:]}")
                log(f"!! micro {backend} failed")
                continue
            result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
            result["backend"] = backend
            out.append(result)
            for row in result["rows"]:
                plaintext = row.get("ratio_to_plaintext")
                log(
                    f"     {row['row']:<13} {row['us_per_request']:>9.1f} us"
                    f"  {row['ratio_to_bare']:.2f}x bare"
                    f" ({row['ratio_min']:.2f}-{row['ratio_max']:.2f})"
                    + ("" if plaintext is None else f"  {plaintext:.3f}x without keys")
                )
    return out


def micro_tables(results: list[dict[str, Any]]) -> list[str]:
    lines: list[str] = []
    for result in results:
        lines += [
            f"### In-process, {result['backend']} ({result['requests_per_round']} requests per"
            f" row per round, {result['rounds']} rounds)",
            "",
            "| row | µs/request | vs bare view (median) | rounds' spread | best rounds |"
            f" CPU µs/request ({result.get('cpu_measured', 'client')}) | CPU vs bare |"
            " SQL/req | commits/req |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in result["rows"]:
            lines.append(
                f"| {row['label']} | {row['us_per_request']:.0f} | {row['ratio_to_bare']:.2f}x |"
                f" {row['ratio_min']:.2f}-{row['ratio_max']:.2f}x | {row['best_ratio']:.2f}x |"
                f" {row.get('cpu_us_per_request', 0):.0f} |"
                f" {row.get('cpu_ratio_to_bare', 0):.2f}x |"
                f" {row.get('statements', '')} | {row.get('commits', '')} |"
            )
        lines.append("")
    return lines
