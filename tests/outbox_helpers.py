"""Real processes for the outbox proofs: relays, a producer that dies after COMMIT, a TCP proxy
that plays a broker going down and coming back, and transports that crash or log their timing.

Relays run as ``manage.py idempotency_relay`` subprocesses against the test database, with their
transports passed as JSON in ``IDEMPOTENCY_OUTBOX_TRANSPORTS`` (read by testproject/settings.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django_idempotency.outbox.transports import CeleryTransport, OutboxMessage
from tests import leaks

REPO = Path(__file__).resolve().parent.parent
CELERY_BACKEND = "django_idempotency.outbox.transports.CeleryTransport"
FAST_RELAY = ("--poll-interval", "0.2", "--backoff", "0.2", "--max-backoff", "0.5")
"""``idempotency_relay`` arguments for the proofs: a short poll, and short back-offs."""


def celery_transports(broker_url: str, backend: str = CELERY_BACKEND, **options: Any) -> str:
    """``IDEMPOTENCY_OUTBOX_TRANSPORTS`` for one Celery transport to ``broker_url``."""
    return json.dumps(
        {"default": {"BACKEND": backend, "OPTIONS": {"broker_url": broker_url, **options}}}
    )


@dataclass
class Process:
    process: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        if self.process.poll() is None:
            with suppress(ProcessLookupError):
                os.kill(self.process.pid, sig)
        with suppress(subprocess.TimeoutExpired):
            return self.process.wait(timeout)
        with suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        return self.process.wait(5)


def start(
    command: list[str],
    *,
    db_url: str,
    env: Mapping[str, str],
    log: Path,
    broker_url: str,
    cwd: Path = REPO,
) -> Process:
    full_env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "testproject.settings",
        "DATABASE_URL": db_url,
        "CELERY_BROKER_URL": broker_url,  # not eager
        "PYTHONUNBUFFERED": "1",
        **env,
    }
    full_env.pop("COV_CORE_SOURCE", None)
    with log.open("wb") as out:
        process = subprocess.Popen(
            command,
            cwd=cwd,
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    leaks.track_process(process, command)
    return Process(process, log)


def start_relay(
    *args: str,
    db_url: str,
    transports: str,
    log: Path,
    broker_url: str,
    cwd: Path = REPO,
    env: Mapping[str, str] | None = None,
) -> Process:
    """``manage.py idempotency_relay ARGS`` with the given transports, from the tree ``cwd``."""
    return start(
        [sys.executable, "manage.py", "idempotency_relay", *args],
        db_url=db_url,
        env={"IDEMPOTENCY_OUTBOX_TRANSPORTS": transports, **(env or {})},
        log=log,
        broker_url=broker_url,
        cwd=cwd,
    )


def wait_for(
    predicate: Callable[[], bool], timeout: float, what: str, logs: Callable[[], str]
) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{logs()}")
        time.sleep(0.1)


# --- A broker that goes away and comes back ---------------------------------------------------


class TcpProxy:
    """Forwards 127.0.0.1:port to a broker; ``stop()`` makes the port refuse connections."""

    def __init__(self, target: tuple[str, int], port: int) -> None:
        self.target = target
        self.port = port
        self._server: socket.socket | None = None
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", self.port))
        server.listen(64)
        self._server = server
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()

    def stop(self) -> None:
        with self._lock:
            server, self._server = self._server, None
            sockets, self._sockets = self._sockets, []
        if server is not None:
            server.close()
        for sock in sockets:
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return  # stopped
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets += [client, upstream]
            self._forward(client, upstream)

    def _forward(self, client: socket.socket, upstream: socket.socket) -> None:
        """Move bytes both ways between an accepted ``client`` and its ``upstream``, a thread
        each way."""
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with suppress(OSError):
                sink.shutdown(socket.SHUT_WR)


@contextmanager
def proxy(target: tuple[str, int], port: int) -> Iterator[TcpProxy]:
    subject = TcpProxy(target, port)
    try:
        yield subject
    finally:
        subject.stop()


# --- Transports for the crash and ordering proofs ----------------------------------------------


class CrashingTransport(CeleryTransport):
    """Publishes ``kill_after`` messages of its first batch, then SIGKILLs its own process.

    Only the first relay that finds ``marker`` absent crashes; later relays send normally.
    """

    def __init__(self, *, kill_after: int, marker: str, **options: Any) -> None:
        super().__init__(**options)
        self.kill_after = kill_after
        self.marker = marker

    def send(self, messages: Any) -> list[BaseException | None]:
        try:
            Path(self.marker).touch(exist_ok=False)
        except FileExistsError:
            return super().send(messages)
        results = super().send(messages[: self.kill_after])
        assert all(result is None for result in results), results
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")


class TimedTransport(CeleryTransport):
    """Logs, per message sent, when its publish started and when the broker acknowledged it.

    With RabbitMQ confirms the transport publishes a batch in rounds (one message per ordering
    key each), and a round starts only once the previous one was confirmed. So a message's start
    is its round's start, and its acknowledgement the next round's start (or the end of the
    call). A Redis pipeline (or an AMQP transaction) sends nothing until it is executed (or
    committed), in order, at the end of the call: that moment is both the start and the
    acknowledgement of each of its messages.
    """

    def __init__(self, *, log: str, **options: Any) -> None:
        super().__init__(**options)
        self.log = log
        self._started: dict[int, int] = {}
        self._acked: dict[int, int] = {}
        self._in_flight: list[int] = []

    def send(self, messages: Any) -> list[BaseException | None]:
        self._started, self._acked, self._in_flight = {}, {}, []
        results = super().send(messages)
        self._stamp_acked()
        if self._confirms is None and self._connection is not None:  # one pipeline or commit
            now = time.time_ns()
            self._started = dict.fromkeys(self._started, now)
            self._acked = dict.fromkeys(self._acked, now)
        with open(self.log, "a") as out:
            for index, (message, result) in enumerate(zip(messages, results, strict=True)):
                if result is None:
                    kwargs = message.payload["kwargs"]
                    line = [kwargs["key"], kwargs["seq"], self._started[index]]
                    out.write(json.dumps([*line, self._acked[index], os.getpid()]) + "\n")
        return results

    def _publish_all(
        self, producer: Any, call: Any, indexes: Any, confirms: Any = None, redis: Any = None
    ) -> Any:
        self._stamp_acked()
        indexes = list(indexes)
        started = time.time_ns()
        for index in indexes:
            self._started.setdefault(index, started)
        tags = super()._publish_all(producer, call, indexes, confirms, redis)
        self._in_flight = indexes
        return tags

    def _stamp_acked(self) -> None:
        now = time.time_ns()
        for index in self._in_flight:
            self._acked[index] = now
        self._in_flight = []


class FileTransport:
    """Writes each message's destination to the file ``log``, one line each, as it "sends"
    it; a message whose destination is in ``poison`` does what a crashing client library
    does to the relay: ``exit`` calls ``os._exit(3)``, ``hang`` writes ``!hang:DESTINATION``
    and sleeps past any lease, and ``raise`` raises."""

    def __init__(self, *, log: str, poison: Mapping[str, str] | None = None) -> None:
        self.log = log
        self.poison = dict(poison or {})

    def send(self, messages: Any) -> list[BaseException | None]:
        results: list[BaseException | None] = []
        failed: set[str] = set()  # a key stops at its first failure, as a real transport's does
        for message in messages:
            if message.ordering_key in failed:
                results.append(RuntimeError("behind a failure of its key"))
                continue
            how = self.poison.get(message.destination)
            if how == "exit":
                os._exit(3)
            if how == "hang":
                with open(self.log, "a") as out:
                    out.write(f"!hang:{message.destination}\n")
                time.sleep(3600)
            if how == "raise":
                results.append(RuntimeError(f"poison {message.destination}"))
                if message.ordering_key is not None:
                    failed.add(message.ordering_key)
                continue
            with open(self.log, "a") as out:
                out.write(message.destination + "\n")
            results.append(None)
        return results

    def close(self) -> None:
        pass


def file_transports(log: Path, poison: Mapping[str, str] | None = None) -> str:
    """``IDEMPOTENCY_OUTBOX_TRANSPORTS`` for one :class:`FileTransport`."""
    return json.dumps(
        {
            "default": {
                "BACKEND": "tests.outbox_helpers.FileTransport",
                "OPTIONS": {"log": str(log), "poison": dict(poison or {})},
            }
        }
    )


class NullTransport:
    """A transport that takes any message and sends nothing: the default of tests that write
    topic messages with ``send()`` and relay them through a transport of their own (the Celery
    transport, the settings' default, refuses a payload that is no task call)."""

    def send(self, messages: Any) -> list[BaseException | None]:
        return [None] * len(messages)

    def close(self) -> None:
        pass


NULL_TRANSPORTS = {"default": {"BACKEND": "tests.outbox_helpers.NullTransport"}}


# --- In-process relays on the REPEATABLE READ alias ---------------------------------------------

RR = "repeatable_read"
"""The test database through connections at REPEATABLE READ (testproject/settings.py)."""


class SentIdsTransport:
    """A transport that acknowledges every message and remembers the event ids it sent; relays
    on several threads may share it."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.lock = threading.Lock()

    def send(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        with self.lock:
            self.sent.extend(message.event_id for message in messages)
        return [None] * len(messages)

    def close(self) -> None:
        pass
