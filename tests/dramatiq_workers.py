"""Real Dramatiq workers for the tests: ``python -m dramatiq tests.dramatiq_app`` processes on a
queue of their own, on the test database, started, waited for, killed and stopped.

Dramatiq's main process shuts every worker down when one of its worker processes dies (a
SIGKILL), so a test that kills one waits for the group to exit and starts a new one: the broker
then gives the unacknowledged message to the new worker (RabbitMQ at once, Redis after the
app's heartbeat timeout).
"""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dramatiq
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.brokers.redis import RedisBroker

from tests.workers import Worker, spawn

READY = "Worker process is ready for action."
READY_TIMEOUT = 120.0  # guards against a hang: Django's start alone took 11 s on CI


def new_queue(label: str) -> str:
    return f"idem-dq-{label}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def sender(url: str) -> dramatiq.Broker:
    """A broker for the test process to send with (no actors, no middleware to speak of)."""
    if url.startswith("redis"):
        return RedisBroker(url=url, middleware=[])
    return RabbitmqBroker(url=url, middleware=[])


@dataclass
class DramatiqGroup:
    broker_url: str
    queue: str
    db_url: str
    log_dir: Path
    threads: int = 2
    workers: list[Worker] = field(default_factory=list)
    broker: Any = None

    def start(self) -> Worker:
        name = f"dq-{len(self.workers)}"
        command = [
            *(sys.executable, "-m", "dramatiq", "tests.dramatiq_app"),
            *("--processes", "1", "--threads", str(self.threads), "--queues", self.queue),
        ]
        env = {"DRAMATIQ_BROKER_URL": self.broker_url, "DRAMATIQ_QUEUE": self.queue}
        log = self.log_dir / f"{name}.log"
        worker = Worker(name, spawn(command, db_url=self.db_url, log=log, env=env), log)
        self.workers.append(worker)
        deadline = time.monotonic() + READY_TIMEOUT
        while READY not in worker.output():
            if worker.process.poll() is not None:
                raise RuntimeError(f"dramatiq worker exited:\n{worker.output()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"dramatiq worker not ready:\n{worker.output()}")
            time.sleep(0.1)
        return worker

    def send(self, actor: str, **kwargs: Any) -> dramatiq.Message[Any]:
        message: dramatiq.Message[Any] = dramatiq.Message(
            queue_name=self.queue, actor_name=actor, args=(), kwargs=kwargs, options={}
        )
        return self.broker.enqueue(message)  # type: ignore[no-any-return]

    def wait_exit(self, worker: Worker, timeout: float = 30.0) -> None:
        """Wait for a group whose worker process was killed to shut down; SIGKILL what lingers."""
        with suppress(Exception):
            worker.process.wait(timeout)
        with suppress(ProcessLookupError):
            os.killpg(worker.process.pid, signal.SIGKILL)
        worker.process.wait(5)

    def stop(self) -> None:
        for worker in self.workers:
            if worker.process.poll() is None:
                with suppress(ProcessLookupError):
                    os.kill(worker.process.pid, signal.SIGTERM)
        for worker in self.workers:
            with suppress(Exception):
                worker.process.wait(15)
            with suppress(ProcessLookupError):
                os.killpg(worker.process.pid, signal.SIGKILL)
            with suppress(Exception):
                worker.process.wait(5)

    def logs(self) -> str:
        return "\n".join(f"--- {w.name} ---\n{w.output()[-6000:]}" for w in self.workers)

    def wait_for(self, condition: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}\n{self.logs()}")
            time.sleep(0.1)


def pika_url(url: str) -> str:
    """kombu's ``amqp://...//`` (the vhost ``/``) as pika spells it, ``amqp://.../%2F``."""
    return url[:-2] + "/%2F" if url.startswith("amqp") and url.endswith("//") else url


@contextmanager
def dramatiq_group(
    *, broker_url: str, db_url: str, log_dir: Path, label: str, start: bool = True
) -> Iterator[DramatiqGroup]:
    broker_url = pika_url(broker_url)
    group = DramatiqGroup(broker_url, new_queue(label), db_url, log_dir)
    group.broker = sender(broker_url)
    group.broker.declare_queue(group.queue)
    try:
        if start:
            group.start()
        yield group
    finally:
        group.stop()
        with suppress(Exception):
            group.broker.flush(group.queue)
        with suppress(Exception):
            group.broker.close()
