"""Benchmark databases and gunicorn servers: created, started and stopped by the runner only."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
PG_URL = os.environ.get("BENCH_PG_URL", "postgres://postgres@127.0.0.1:5432/postgres")
DB_PREFIX = "idempotency_bench_"


def database_url(name: str) -> str:
    parts = urlsplit(PG_URL)
    return urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, parts.fragment))


def _admin_connection() -> object:
    import psycopg

    return psycopg.connect(PG_URL, autocommit=True)


def recreate_database(name: str) -> None:
    """Drop (if it exists) and create a benchmark database; only ``idempotency_bench_*``."""
    if not name.startswith(DB_PREFIX):
        raise ValueError(f"benchmark databases start with {DB_PREFIX!r}, not {name!r}")
    with _admin_connection() as conn:  # type: ignore[attr-defined]
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')


def create_database(url: str) -> None:
    """Create the database ``url`` names unless it exists (PostgreSQL, MySQL/MariaDB); a
    SQLite file is created by its first connection. Never drops anything."""
    import environ

    config = environ.Env.db_url_config(url)
    name = config["NAME"]
    if config["ENGINE"].endswith("postgresql"):
        import psycopg

        with psycopg.connect(
            host=config["HOST"], port=config["PORT"] or 5432, user=config["USER"],
            password=config["PASSWORD"] or None, dbname="postgres", autocommit=True,
        ) as conn:  # fmt: skip
            if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
                conn.execute(f'CREATE DATABASE "{name}"')
    elif config["ENGINE"].endswith("mysql"):
        import MySQLdb

        conn = MySQLdb.connect(
            host=config["HOST"], port=int(config["PORT"] or 3306),
            user=config["USER"] or "root", password=config["PASSWORD"] or "",
        )  # fmt: skip
        conn.cursor().execute(f"CREATE DATABASE IF NOT EXISTS `{name}` CHARACTER SET utf8mb4")
        conn.close()


def postgres_version() -> str:
    with _admin_connection() as conn:  # type: ignore[attr-defined]
        row = conn.execute("SHOW server_version").fetchone()
    return str(row[0])


def variant_env(
    variant: str, database: str, checkout: Path = REPO, **extra: str
) -> dict[str, str]:
    """The environment of a benchmark process: ``checkout``'s bench/ and package imported."""
    env = dict(os.environ)
    env.update(
        {
            "DJANGO_SETTINGS_MODULE": "bench.benchproject.settings",
            "BENCH_VARIANT": variant,
            "BENCH_DATABASE_URL": database_url(database),
            "PYTHONPATH": str(checkout),
            "PYTHONDONTWRITEBYTECODE": "1",
        }
    )
    env.update(extra)
    return env


def prepare(variant: str, database: str) -> None:
    """Migrate the variant's database and create its user (in a subprocess: its own settings)."""
    prepare_url(database_url(database), variant)


def run_python(
    args: list[str], env: dict[str, str], checkout: Path = REPO, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``python args`` in ``checkout`` (this interpreter), its output captured."""
    return subprocess.run(
        [sys.executable, *args],
        env=env,
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def prepare_url(url: str, variant: str = "app", checkout: Path = REPO) -> None:
    """Migrate the database at ``url`` (any backend) for ``variant`` and create its user, with
    the migrations of ``checkout`` (another checkout's, for ``python -m bench --compare-with``)."""
    env = variant_env(variant, "", checkout, BENCH_DATABASE_URL=url)
    done = run_python(["-m", "bench.benchproject.prepare"], env, checkout)
    if done.returncode:
        raise RuntimeError(f"preparing {variant} failed:\n{done.stderr.strip()}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_get(port: int, path: str, timeout: float = 5.0) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(
            f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode()
        )
        head = sock.recv(64)
    return int(head[9:12])


class Server:
    """One gunicorn master for one variant, in its own process group."""

    def __init__(
        self,
        variant: str,
        database: str,
        *,
        workers: int = 4,
        threads: int = 1,
        name: str | None = None,
    ) -> None:
        self.variant = variant
        self.database = database
        self.workers = workers
        self.threads = threads
        self.name = name or variant
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.log = RESULTS / "logs" / f"gunicorn-{self.name}.log"

    def start(self) -> Server:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.log.unlink(missing_ok=True)  # gunicorn appends; keep this run's log only
        self.port = free_port()
        command = [
            sys.executable,
            "-m",
            "gunicorn",
            "bench.benchproject.wsgi:application",
            "--bind",
            f"127.0.0.1:{self.port}",
            "--workers",
            str(self.workers),
            "--worker-class",
            "sync" if self.threads == 1 else "gthread",
            "--threads",
            str(self.threads),
            "--backlog",
            "2048",
            "--timeout",
            "60",
            "--log-level",
            "warning",
            "--error-logfile",
            str(self.log),
        ]
        import gunicorn

        if gunicorn.version_info >= (27,):
            # Each master would otherwise claim ~/.gunicorn/gunicorn.ctl, and all but one fail.
            command.append("--no-control-socket")
        with self.log.with_suffix(".stderr").open("wb") as stderr:  # warnings, import errors
            self.process = subprocess.Popen(
                command,
                env=variant_env(self.variant, self.database),
                cwd=REPO,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,
            )
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"gunicorn for {self.name} exited:\n{self.log_tail()}")
            try:
                if http_get(self.port, "/health/") == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"gunicorn for {self.name} did not answer in {timeout}s")

    def log_tail(self, lines: int = 30) -> str:
        text = ""
        for path in (self.log, self.log.with_suffix(".stderr")):
            if path.exists():
                text += path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:]) or "(no log)"

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(5)
