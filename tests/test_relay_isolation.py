"""The relay's claim on an alias at REPEATABLE READ (PostgreSQL and MariaDB): relays running at
once never fail with a serialization error.

On PostgreSQL the claim's first statement (the planner switches) took the transaction's
snapshot at REPEATABLE READ; a second relay that committed its lease or its sent marks before
the ``FOR UPDATE SKIP LOCKED`` claim made the claim fail with "could not serialize access due
to concurrent update" (logged at ERROR, a pause, and again). The claim now runs at READ
COMMITTED, as it already did on MySQL. The interleaving is made, not hoped for: the first
relay's claim, after its first statement, waits while a second relay (a thread with its own
connection) claims, sends and records the rows.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any

import pytest
from django.db import connections, transaction

from django_idempotency.models import OutboxEntry
from django_idempotency.outbox import core as outbox
from django_idempotency.outbox import store
from django_idempotency.outbox.relay import Relay
from tests.outbox_helpers import RR, SentIdsTransport

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.mysql,
    pytest.mark.django_db(transaction=True, databases=["default", RR]),
    pytest.mark.usefixtures("null_default_transport"),
]


def write(count: int, prefix: str) -> set[str]:
    with transaction.atomic(using=RR):
        return {
            outbox.send(f"{prefix}.topic", {"n": n}, key=f"{prefix}-{n % 3}", using=RR)
            for n in range(count)
        }


def in_thread(target: Any) -> None:
    """Run ``target`` on a thread of its own (its own connections), and re-raise its error."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            target()
        except BaseException as error:  # noqa: BLE001 - re-raised below
            errors.append(error)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert not thread.is_alive()
    if errors:
        raise errors[0]


def test_a_claim_overtaken_by_another_relay_does_not_fail(monkeypatch: Any) -> None:
    """Relay A's claim has begun (its first statement ran) when relay B, on another thread,
    claims the same rows, sends them and commits its sent marks. A's claim then finds nothing
    left instead of failing with a serialization error; every message was sent once."""
    events = write(6, "rr-overtaken")
    transport = SentIdsTransport()
    first = Relay(using=RR, transports={"default": transport})
    second = Relay(using=RR, transports={"default": transport})
    real = store.candidates
    overtaken = threading.Event()

    def candidates(using: str, now: Any, limit: int) -> list[store.Claimed]:
        if not overtaken.is_set() and threading.current_thread() is threading.main_thread():
            overtaken.set()
            assert connections[RR].in_atomic_block  # inside A's claim, after its first statement
            in_thread(lambda: second.drain())
        return real(using, now, limit)

    monkeypatch.setattr(store, "candidates", candidates)
    assert first.run_once().claimed == 0  # raised "could not serialize access" before the fix
    assert overtaken.is_set()
    assert Counter(transport.sent) == Counter(events)
    assert OutboxEntry.objects.using(RR).filter(state="sent").count() == 6


@pytest.mark.slow
def test_two_relays_at_repeatable_read_never_log_a_serialization_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two relays serve one outbox at REPEATABLE READ, in small batches, while messages are
    written: no database error is logged, and every message is sent exactly once."""
    caplog.set_level(logging.WARNING, logger="django_idempotency")
    transport = SentIdsTransport()
    relays = [Relay(using=RR, batch_size=3, transports={"default": transport}) for _ in range(2)]
    threads = []
    for relay in relays:

        def serve(relay: Relay = relay) -> None:
            try:
                relay.serve(poll_interval=0.05)
            finally:
                connections.close_all()

        threads.append(threading.Thread(target=serve))
    for thread in threads:
        thread.start()
    events: set[str] = set()
    try:
        for round_ in range(20):
            events |= write(10, f"rr-two-{round_}")
        deadline = 60.0
        started = time.monotonic()
        while len(transport.sent) < len(events) and time.monotonic() - started < deadline:
            time.sleep(0.05)
    finally:
        for relay in relays:
            relay.stop()
        for thread in threads:
            thread.join(30)
    assert Counter(transport.sent) == Counter(events)
    problems = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert problems == []
