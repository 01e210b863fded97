"""A bounded HTTP load generator: closed-loop clients in a few processes of threads.

Each client sends one ``POST`` at a time on a fresh connection (``Connection: close``: gunicorn's
sync workers close every connection anyway) and measures the time from connect to the last byte.
A run stops at its deadline or after ``max_requests``, whichever comes first. Nothing here
retries: an error is counted and reported.

Keys:

* ``first``: every request carries a new key (a first execution each time);
* ``replay``: each client sends one untimed priming request with its own key before the clock
  starts, then repeats that same request (a replay each time);
* ``none``: no ``Idempotency-Key`` header.
"""

from __future__ import annotations

import multiprocessing
import socket
import threading
import time
import uuid
from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

STATEMENTS_HEADER = b"\r\nx-bench-statements: "
Mode = Literal["first", "replay", "none"]
PRIMING_TRIES = 40


@dataclass(frozen=True)
class Target:
    host: str
    port: int
    path: str
    body: bytes = b'{"amount_cents": 1250, "currency": "EUR"}'
    authorization: str = "Bearer bench"
    timeout: float = 30.0

    def request(self, key: str | None) -> bytes:
        lines = [
            f"POST {self.path} HTTP/1.1",
            f"Host: {self.host}:{self.port}",
            f"Authorization: {self.authorization}",
            "Content-Type: application/json",
            f"Content-Length: {len(self.body)}",
            "Connection: close",
        ]
        if key is not None:
            lines.append(f"Idempotency-Key: {key}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + self.body


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes


def exchange(target: Target, raw: bytes) -> bytes:
    """Send one request on a new connection and return the raw response (read to EOF)."""
    with socket.create_connection((target.host, target.port), timeout=target.timeout) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(raw)
        chunks = []
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks)


def parse(raw: bytes) -> Response:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = dechunk(body)
    return Response(status, headers, body)


def dechunk(body: bytes) -> bytes:
    out = []
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out.append(rest[:size])
        body = rest[size + 2 :]
    return b"".join(out)


def send(target: Target, key: str | None) -> Response:
    return parse(exchange(target, target.request(key)))


def _status_and_statements(raw: bytes) -> tuple[int, str | None]:
    """The status and the ``statements/commits`` header of a raw response."""
    status = int(raw[9:12])
    head = raw[: raw.find(b"\r\n\r\n")].lower()
    start = head.find(STATEMENTS_HEADER)
    if start < 0:
        return status, None
    start += len(STATEMENTS_HEADER)
    end = head.find(b"\r\n", start)
    return status, head[start : end if end >= 0 else len(head)].decode("ascii").strip()


@dataclass
class LoadResult:
    clients: int
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)  # seconds, one per completed request
    statuses: Counter[int] = field(default_factory=Counter)
    # "status:statements/commits" -> responses, e.g. {"201:4/1": 1500, "409:1/0": 3}
    statements: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)

    @property
    def requests(self) -> int:
        return len(self.latencies)

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    def percentile(self, q: float) -> float:
        """Nearest-rank percentile of the latencies, in seconds."""
        if not self.latencies:
            return float("nan")
        ordered = sorted(self.latencies)
        rank = max(1, round(q / 100 * len(ordered)))
        return ordered[min(rank, len(ordered)) - 1]

    def merge(self, other: dict[str, Any]) -> None:
        self.seconds = max(self.seconds, other["seconds"])
        self.latencies.extend(array("d", other["latencies"]))
        self.statuses.update(other["statuses"])
        self.statements.update(other["statements"])
        self.errors.update(other["errors"])


def _client_process(
    target: Target,
    mode: Mode,
    threads: int,
    seconds: float,
    max_requests: int,
    start: Any,
    results: Any,
) -> None:
    """One process of ``threads`` closed-loop clients; puts its figures on ``results``."""
    latencies = array("d")
    statuses: Counter[int] = Counter()
    statements: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    lock = threading.Lock()
    primed = threading.Barrier(threads + 1)
    go = threading.Event()
    deadline = [0.0]
    budget = [max_requests]

    def client() -> None:
        replay_key = str(uuid.uuid4())
        own: list[float] = []
        own_statuses: Counter[int] = Counter()
        own_statements: Counter[str] = Counter()
        own_errors: Counter[str] = Counter()
        fixed = target.request(replay_key if mode == "replay" else None)
        try:
            if mode == "replay":
                # Untimed set-up; a 423 Locked answer is retried, as a client would.
                for _ in range(PRIMING_TRIES):
                    primed_status = parse(exchange(target, fixed)).status
                    if primed_status != 423:
                        break
                    time.sleep(0.05)
                if primed_status >= 300:
                    own_errors[f"priming answered {primed_status}"] += 1
        except OSError as exc:
            own_errors[f"priming {type(exc).__name__}"] += 1
        finally:
            primed.wait()
        go.wait()
        while time.monotonic() < deadline[0]:
            with lock:
                if budget[0] <= 0:
                    break
                budget[0] -= 1
            raw = fixed if mode != "first" else target.request(str(uuid.uuid4()))
            began = time.perf_counter()
            try:
                answer = exchange(target, raw)
            except OSError as exc:
                own_errors[type(exc).__name__] += 1
                continue
            own.append(time.perf_counter() - began)
            status, count = _status_and_statements(answer)
            own_statuses[status] += 1
            if count is not None:
                own_statements[f"{status}:{count}"] += 1
        with lock:
            latencies.extend(own)
            statuses.update(own_statuses)
            statements.update(own_statements)
            errors.update(own_errors)

    workers = [threading.Thread(target=client, daemon=True) for _ in range(threads)]
    for worker in workers:
        worker.start()
    primed.wait()
    start.wait()  # every process is primed
    began = time.monotonic()
    deadline[0] = began + seconds
    go.set()
    for worker in workers:
        worker.join(seconds + target.timeout + 5)
    results.put(
        {
            "seconds": time.monotonic() - began,
            "latencies": latencies.tobytes(),
            "statuses": dict(statuses),
            "statements": dict(statements),
            "errors": dict(errors),
        }
    )


def run_load(
    target: Target,
    *,
    clients: int,
    seconds: float,
    mode: Mode,
    max_requests: int = 100_000,
    processes: int = 2,
) -> LoadResult:
    """Run ``clients`` closed-loop clients for ``seconds`` (or ``max_requests``) against target."""
    ctx = multiprocessing.get_context("fork")
    processes = max(1, min(processes, clients))
    start = ctx.Barrier(processes)
    results = ctx.Queue()
    shares = [
        clients // processes + (1 if i < clients % processes else 0) for i in range(processes)
    ]
    budgets = [max_requests * share // clients for share in shares]
    children = [
        ctx.Process(
            target=_client_process,
            args=(target, mode, share, seconds, budget, start, results),
            daemon=True,
        )
        for share, budget in zip(shares, budgets, strict=True)
    ]
    for child in children:
        child.start()
    outcome = LoadResult(clients=clients)
    wait = seconds + 2 * target.timeout + 30
    try:
        for _ in children:
            payload = results.get(timeout=wait)
            payload["latencies"] = array("d", payload["latencies"])
            outcome.merge(payload)
    finally:
        for child in children:
            child.join(5)
            if child.is_alive():
                child.kill()
                child.join()
    return outcome


def race(target: Target, *, duplicates: int, key: str) -> list[Response | str]:
    """Send ``duplicates`` requests with one key at the same instant; answers in send order."""
    barrier = threading.Barrier(duplicates)
    answers: list[Response | str] = ["not sent"] * duplicates
    raw = target.request(key)

    def one(index: int) -> None:
        barrier.wait()
        try:
            answers[index] = parse(exchange(target, raw))
        except OSError as exc:
            answers[index] = f"{type(exc).__name__}: {exc}"

    workers = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(duplicates)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(target.timeout + 5)
    return answers
