"""Real Celery workers for the worker tests: start, wait until ready, publish, stop.

Each worker is a ``celery -A testproject worker`` subprocess with the prefork pool, in its own
process group, consuming one queue that no other test or helper uses. It talks to the pytest
test database (``DATABASE_URL`` is built from the test connection's settings) and stores task
results in Redis, so a test can wait for every message's final state, duplicates included,
before it counts effects.

The app is the test project's own, loaded through ``tests.worker_app``, which only makes Celery's
Django fixup keep database connections across tasks (as a production worker with persistent
connections does) instead of reconnecting for every task: that triples throughput here.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from celery import Celery
from celery.result import AsyncResult
from django.db import connection
from kombu import Exchange, Queue
from kombu.exceptions import ChannelError

from tests.conftest import require_service
from tests.services import BROKER_URLS

REPO = Path(__file__).resolve().parent.parent
RESULT_BACKEND = "redis://127.0.0.1:6379/14"
READY_TIMEOUT = 180.0  # for the whole group (one deadline), started together on a loaded CI
STOP_TIMEOUT = 15.0


def database_url(settings_dict: Mapping[str, Any]) -> str:
    """A django-environ ``DATABASE_URL`` for the database ``settings_dict`` points at now."""
    engine = settings_dict["ENGINE"]
    name = str(settings_dict["NAME"])
    if engine == "django.db.backends.sqlite3":
        return f"sqlite:///{name}"
    scheme = {
        "django.db.backends.postgresql": "postgres",
        "django.db.backends.mysql": "mysql",
    }[engine]
    user = quote(settings_dict.get("USER") or "")
    password = settings_dict.get("PASSWORD") or ""
    auth = f"{user}:{quote(password)}@" if password else f"{user}@" if user else ""
    host = settings_dict.get("HOST") or "127.0.0.1"
    port = f":{settings_dict['PORT']}" if settings_dict.get("PORT") else ""
    return f"{scheme}://{auth}{host}{port}/{name}"


@dataclass
class Worker:
    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass
class WorkerGroup:
    """Workers sharing one queue, and a publisher for it."""

    broker_url: str
    queue: str
    workers: list[Worker] = field(default_factory=list)
    publisher: Celery | None = None

    def publish(
        self,
        task: str,
        *,
        args: Iterable[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        headers: Mapping[str, Any] | None = None,
        producer: Any = None,
    ) -> AsyncResult[Any]:
        assert self.publisher is not None
        return self.publisher.send_task(
            task,
            args=tuple(args),
            kwargs=dict(kwargs or {}),
            queue=self.queue,
            headers=dict(headers or {}),
            producer=producer,
        )

    @contextmanager
    def producer(self) -> Iterator[Any]:
        """One connection for many publishes (send_task(..., producer=...))."""
        assert self.publisher is not None
        with self.publisher.producer_or_acquire() as producer:
            yield producer

    def logs(self) -> str:
        return "\n".join(f"--- {w.name} ---\n{w.output()[-6000:]}" for w in self.workers)

    def held(self) -> dict[str, int]:
        """What the group still has to run: the messages waiting in its queue, and per worker
        the tasks it runs, has reserved, or holds until their ETA (a retry's countdown). A
        worker that does not answer counts as holding one."""
        assert self.publisher is not None
        names = [f"{worker.name}@{socket.gethostname()}" for worker in self.workers]
        with self.publisher.connection_for_write() as connection:
            try:
                waiting = connection.default_channel.queue_declare(self.queue, passive=True)
            except ChannelError:  # Redis: an empty queue is no key at all
                counts = {"queue": 0}
            else:
                counts = {"queue": waiting.message_count}
        inspect = self.publisher.control.inspect(destination=names, timeout=2.0)
        for kind in ("active", "reserved", "scheduled"):
            replies = getattr(inspect, kind)() or {}
            for name in names:
                counts[f"{name} {kind}"] = len(replies[name]) if name in replies else 1
        return counts

    def drain(self, timeout: float = 180.0) -> None:
        """Wait until the group has nothing left to run (see :meth:`held`). A module-scoped
        group otherwise carries an earlier test's late retries into the next test, whose
        flushed tables no longer hold that event's processed row: the retry would apply it
        there as a new event. The bound is a guard against a hang: a retry's countdown is up
        to a minute (the consumer's backoff cap)."""
        deadline = time.monotonic() + timeout
        while any((counts := self.held()).values()):
            if time.monotonic() > deadline:
                raise AssertionError(f"the workers still hold {counts}:\n{self.logs()}")
            time.sleep(0.5)


def new_queue_name(label: str) -> str:
    return f"idem-test-{label}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def start_worker(
    *,
    broker_url: str,
    queue: str,
    db_url: str,
    name: str,
    log_dir: Path,
    concurrency: int = 4,
    prefetch_multiplier: int = 1,
    extra_env: Mapping[str, str] | None = None,
) -> Worker:
    env = {
        "CELERY_BROKER_URL": broker_url,
        "CELERY_RESULT_BACKEND": RESULT_BACKEND,
        "CELERY_TASK_ALWAYS_EAGER": "false",
        **(extra_env or {}),
    }
    log = log_dir / f"{name}.log"
    command = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "tests.worker_app",
        "worker",
        "-P",
        "prefork",
        "-c",
        str(concurrency),
        "-Q",
        queue,
        "-n",
        f"{name}@%h",
        "--prefetch-multiplier",
        str(prefetch_multiplier),
        "--without-heartbeat",
        "--without-gossip",
        "--without-mingle",
        "-l",
        "INFO",
    ]
    return Worker(name, spawn(command, db_url=db_url, log=log, env=env), log)


def spawn(
    command: list[str], *, db_url: str, log: Path, env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start a process of the test project on the database ``db_url``, writing to ``log``.

    It runs in its own process group (so a test can stop or SIGKILL its children too), without
    coverage tracing (it would only be slower).
    """
    environ = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "testproject.settings",
        "DATABASE_URL": db_url,
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    environ.pop("COV_CORE_SOURCE", None)
    with log.open("wb") as out:
        return subprocess.Popen(
            command,
            cwd=REPO,
            env=environ,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_ready(workers: Iterable[Worker], timeout: float = READY_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    for worker in workers:
        while " ready." not in worker.output():
            if worker.process.poll() is not None:
                raise RuntimeError(f"worker {worker.name} exited:\n{worker.output()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {worker.name} not ready:\n{worker.output()}")
            time.sleep(0.1)


def stop_workers(workers: Iterable[Worker], timeout: float = STOP_TIMEOUT) -> None:
    """Cold-stop the workers (SIGQUIT) together, then SIGKILL any process group that lingers."""
    workers = list(workers)
    for worker in workers:
        if worker.process.poll() is None:
            with suppress(ProcessLookupError):
                os.kill(worker.process.pid, signal.SIGQUIT)
    deadline = time.monotonic() + timeout
    for worker in workers:
        with suppress(subprocess.TimeoutExpired):
            worker.process.wait(max(0.1, deadline - time.monotonic()))
        with suppress(ProcessLookupError):
            os.killpg(worker.process.pid, signal.SIGKILL)  # the group we created: pool children
        with suppress(subprocess.TimeoutExpired):
            worker.process.wait(5)


def delete_queue(broker_url: str, queue: str) -> None:
    """Delete the test's queue and its exchange (on Redis, their binding keys too)."""
    app = Celery("cleanup", broker=broker_url, set_as_current=False)
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        exchange = Exchange(queue, type="direct")
        bound = Queue(queue, exchange, routing_key=queue).bind(channel)
        bound.declare()  # kombu's Redis transport deletes only the bindings it knows of
        bound.delete()
        exchange.bind(channel).delete()


@contextmanager
def worker_group(
    *,
    broker_url: str,
    db_url: str,
    log_dir: Path,
    label: str,
    workers: int = 2,
    concurrency: int = 4,
    extra_env: Mapping[str, str] | None = None,
) -> Iterator[WorkerGroup]:
    """Start ``workers`` worker processes on a new queue; stop them and delete the queue after."""
    queue = new_queue_name(label)
    group = WorkerGroup(broker_url, queue)
    group.publisher = Celery(
        "publisher", broker=broker_url, backend=RESULT_BACKEND, set_as_current=False
    )
    group.publisher.conf.update(task_create_missing_queues=True, broker_connection_retry=False)
    try:
        for index in range(workers):
            group.workers.append(
                start_worker(
                    broker_url=broker_url,
                    queue=queue,
                    db_url=db_url,
                    name=f"{label}{index}-{uuid.uuid4().hex[:6]}",
                    log_dir=log_dir,
                    concurrency=concurrency,
                    extra_env=extra_env,
                )
            )
        wait_ready(group.workers)
        yield group
    finally:
        stop_workers(group.workers)
        delete_queue(broker_url, queue)
        group.publisher.close()


def broker_workers_fixture(
    name: str,
    label: str,
    *,
    redis_only: Mapping[str, str] | None = None,
    doc: str | None = None,
    **options: Any,
) -> Any:
    """A module-scoped fixture ``name``, parametrized over the brokers (``BROKER_URLS``): a
    :func:`worker_group` on the broker, for every test of the module that asks for it.

    Assign it to ``name`` in the test module (``workers = broker_workers_fixture("workers",
    ...)``). Its queue and log directory are named ``label-BROKER``; ``options`` go to
    :func:`worker_group` (``workers``, ``concurrency``, ``extra_env``). In the pass of a database
    vendor (``connection.vendor``) that ``redis_only`` names, a broker other than Redis is
    skipped, with the reason given there. The broker, and Redis (the result backend), must
    answer (:func:`tests.conftest.require_service`).
    """

    def fixture(
        request: pytest.FixtureRequest,
        django_db_setup: None,
        tmp_path_factory: pytest.TempPathFactory,
    ) -> Iterator[WorkerGroup]:
        broker = request.param
        reason = (redis_only or {}).get(connection.vendor)
        if reason is not None and broker != "redis":
            pytest.skip(reason)
        require_service(broker)
        require_service("redis")  # the result backend
        started = time.monotonic()
        with worker_group(
            broker_url=BROKER_URLS[broker],
            db_url=database_url(connection.settings_dict),
            log_dir=tmp_path_factory.mktemp(f"{label}-{broker}"),
            label=f"{label}-{broker}",
            **options,
        ) as group:
            print(f"\n[workers on {broker} ready in {time.monotonic() - started:.1f}s]")
            yield group

    fixture.__doc__ = doc
    return pytest.fixture(scope="module", params=sorted(BROKER_URLS), name=name)(fixture)
