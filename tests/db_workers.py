"""Real django-tasks-db workers for the Django Tasks worker tests: start, wait, kill.

Each worker is a ``python manage.py db_worker --backend database`` subprocess of the test
project, in its own process group, on the pytest test database (``DATABASE_URL`` is built from
the test connection's settings). It runs one task at a time, polls every 50 ms, and logs to a
file the test shows when something goes wrong.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

from tests.workers import Worker, spawn

READY_TIMEOUT = 120.0  # guards against a hang: Django's start alone took 11 s on CI
WAIT_TIMEOUT = 120.0  # a guard against a hang, never a timing
STOP_TIMEOUT = 15.0
READY_LINE = "Starting worker worker_id="


class DbWorker(Worker):
    """A ``db_worker`` process: its name (the worker id), process and log."""

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> int:
        """SIGKILL the worker's process group; return the worker's exit status."""
        if self.alive():
            os.killpg(self.process.pid, signal.SIGKILL)
        return self.process.wait(timeout=STOP_TIMEOUT)

    def wait_exit(self, timeout: float = WAIT_TIMEOUT) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"worker {self.name} still running after {timeout}s\n{self.output()}")

    def stop(self) -> None:
        """SIGTERM (a graceful stop), then SIGKILL if it does not exit in time."""
        if not self.alive():
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill()


def start_db_worker(*, db_url: str, log_dir: Path, name: str) -> DbWorker:
    """Start a ``db_worker`` and return once it polls for tasks."""
    log = log_dir / f"{name}.log"
    command = [
        sys.executable,
        "manage.py",
        "db_worker",
        "--backend",
        "database",
        "--interval",
        "0.05",
        "--no-startup-delay",
        "--no-reload",
        "--worker-id",
        name,
        "--verbosity",
        "1",
    ]
    process = spawn(command, db_url=db_url, log=log)
    worker = DbWorker(name, process, log)
    ready = f"worker {name} ready"
    wait_until(lambda: READY_LINE in worker.output(), ready, [worker], READY_TIMEOUT)
    return worker


def wait_until(
    condition: Callable[[], Any],
    what: str,
    workers: Iterable[DbWorker],
    timeout: float = WAIT_TIMEOUT,
) -> None:
    """Poll ``condition`` until it is true; fail with the workers' logs after ``timeout``."""
    workers = list(workers)
    deadline = time.monotonic() + timeout
    while not condition():
        dead = [w for w in workers if not w.alive() and READY_LINE not in w.output()]
        if dead or time.monotonic() > deadline:
            logs = "\n".join(f"--- {w.name} ---\n{w.output()[-6000:]}" for w in workers)
            pytest.fail(f"not reached within {timeout}s: {what}\n{logs}")
        time.sleep(0.05)
