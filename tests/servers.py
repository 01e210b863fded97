"""A real gunicorn serving the test project against the test database, for races and crashes.

The server runs ``testproject.wsgi`` with ``DATABASE_URL`` pointing at the database that
pytest-django created for this run (``connection.settings_dict["NAME"]`` is the test name once
the test database is set up), so tests that use it must be ``transaction=True``: only committed
rows are visible to the server. It runs in its own process group, and is always stopped, so no
worker keeps a connection to the test database.
"""

from __future__ import annotations

import http.client
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT = 120.0  # a guard against a hang, not a timing: CI's loaded machine is slow to start
STOP_TIMEOUT = 10.0


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes


@dataclass
class Gunicorn:
    process: subprocess.Popen[bytes]
    port: int
    pid_dir: Path
    log: Path

    def post(
        self,
        path: str,
        key: str,
        *,
        body: bytes = b"{}",
        headers: dict[str, str] | None = None,
        timeout: float = 30.0,
    ) -> Reply:
        """POST ``body`` as JSON with ``Idempotency-Key: key`` on a fresh connection."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            all_headers = {
                "Content-Type": "application/json",
                "Idempotency-Key": key,
                "Connection": "close",
                **(headers or {}),
            }
            connection.request("POST", path, body=body, headers=all_headers)
            response = connection.getresponse()
            return Reply(response.status, dict(response.getheaders()), response.read())
        finally:
            connection.close()

    def worker_pid(self, key: str, timeout: float = 60.0) -> int:
        """The pid of the worker running the probe view for ``key`` (it writes a pid file)."""
        path = self.pid_dir / (re.sub(r"[^A-Za-z0-9_-]", "_", key) + ".pid")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with suppress(FileNotFoundError, ValueError):
                return int(path.read_text())
            time.sleep(0.01)
        raise AssertionError(f"no worker wrote {path} within {timeout}s\n{self.logs()}")

    def logs(self) -> str:
        return self.log.read_text(errors="replace")[-5000:]


def database_url(settings_dict: dict[str, Any]) -> str:
    """A ``DATABASE_URL`` for django-environ that points at ``settings_dict``'s database."""
    engine = settings_dict["ENGINE"].rsplit(".", 1)[-1]
    name = settings_dict["NAME"]
    if engine == "sqlite3":
        return f"sqlite:///{Path(name).resolve()}"
    scheme = {"postgresql": "postgres", "mysql": "mysql"}[engine]
    user = quote(settings_dict.get("USER") or "")
    password = settings_dict.get("PASSWORD") or ""
    credentials = f"{user}:{quote(password)}" if password else user
    host = settings_dict.get("HOST") or "127.0.0.1"
    port = settings_dict.get("PORT") or ""
    return f"{scheme}://{credentials}@{host}{':' + str(port) if port else ''}/{name}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def gunicorn(settings_dict: dict[str, Any], *, workers: int = 4) -> Iterator[Gunicorn]:
    """Start ``gunicorn testproject.wsgi -w workers`` on a free port; stop it afterwards."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="idem-gunicorn-") as tmp:
        pid_dir = Path(tmp, "pids")
        pid_dir.mkdir()
        log = Path(tmp, "gunicorn.log")
        env = {
            **os.environ,
            "DATABASE_URL": database_url(settings_dict),
            "DJANGO_SETTINGS_MODULE": "testproject.settings",
            "PROBE_PID_DIR": str(pid_dir),
            "PYTHONPATH": str(REPO),
            "IDEMPOTENCY_LOG_LEVEL": "WARNING",
        }
        command = [
            sys.executable,
            "-m",
            "gunicorn",
            "testproject.wsgi",
            "--workers",
            str(workers),
            "--bind",
            f"127.0.0.1:{port}",
            "--preload",
            "--timeout",
            "60",
            "--graceful-timeout",
            "2",
        ]
        with log.open("wb") as output:
            process = subprocess.Popen(
                command, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        server = Gunicorn(process, port, pid_dir, log)
        try:
            wait_until_serving(server)
            yield server
        finally:
            stop(process)


def wait_until_serving(server: Gunicorn) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise AssertionError(
                f"gunicorn exited with {server.process.returncode}\n{server.logs()}"
            )
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        try:
            connection.request("GET", "/probe/not-a-page/")
            if connection.getresponse().status == 404:
                return
        except OSError:
            time.sleep(0.05)
        finally:
            connection.close()
    raise AssertionError(f"gunicorn did not answer within {START_TIMEOUT}s\n{server.logs()}")


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the master (it stops its workers), then SIGKILL the whole group if needed."""
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGCONT)  # a test may have left a worker stopped
        os.killpg(process.pid, signal.SIGTERM)
    with suppress(subprocess.TimeoutExpired):
        process.wait(STOP_TIMEOUT)
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with suppress(subprocess.TimeoutExpired):
        process.wait(5)
