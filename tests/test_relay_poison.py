"""Poison for the relay, with real relay processes: a message whose send kills the relay
(``os._exit``), hangs past the lease, or raises, and payloads at the edges of what a database
stores. The relay goes on, sends every healthy message, and parks each poison message within
``OUTBOX_MAX_ATTEMPTS`` (issue 25, item 5 and the relay's poison proof).

Each relay is ``manage.py idempotency_relay --once`` against the test database, with a
:class:`tests.outbox_helpers.FileTransport` that writes what it sends to a file: no broker is
involved, what is proven is the relay's loop.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest
from django.db import connection, transaction

from django_idempotency.models import OutboxEntry
from django_idempotency.outbox import core as outbox
from tests.outbox_helpers import Process, file_transports, start
from tests.workers import database_url

pytestmark = [
    pytest.mark.slow,
    # The relay processes and their claims on the two servers; SQLite's single writer adds
    # nothing here that tests/test_relay.py does not show.
    pytest.mark.postgres,
    pytest.mark.mysql,
    pytest.mark.timeout(600),
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("null_default_transport"),  # the relays below use FileTransport
]

MAX_ATTEMPTS = 3
LEASE = 1.0


def run_relay(log: Path, sent: Path, poison: dict[str, str], run: int) -> Process:
    import sys

    return start(
        [
            sys.executable,
            "manage.py",
            "idempotency_relay",
            "--once",
            "--lease",
            str(LEASE),
            "--backoff",
            "0.1",
            "--max-backoff",
            "0.1",
        ],
        db_url=database_url(connection.settings_dict),
        env={
            "IDEMPOTENCY_OUTBOX_TRANSPORTS": file_transports(sent, poison),
            "IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS": str(MAX_ATTEMPTS),
        },
        log=log.with_name(f"relay-{run}.log"),
        broker_url="memory://",
    )


def hangs(sent: Path) -> int:
    return sent.read_text().count("!hang:") if sent.exists() else 0


def wait_or_hang(relay: Process, sent: Path) -> int:
    """The relay's exit status, or -1 once it hangs in a send (then it is stopped)."""
    before = hangs(sent)
    deadline = time.monotonic() + 120
    while relay.process.poll() is None:
        if hangs(sent) > before:
            relay.stop(timeout=5)
            return -1
        if time.monotonic() > deadline:
            relay.stop(timeout=5)
            raise AssertionError(f"a relay neither ended nor hung\n{relay.output()}")
        time.sleep(0.1)
    return relay.process.returncode


def relay_until_done(tmp_path: Path, poison: dict[str, str], runs: int = 12) -> Counter[int]:
    """Relays, one after another, until one ends normally with nothing left to send; returns
    how the runs ended (exit status, or -1 for a relay stopped because it hung)."""
    endings: Counter[int] = Counter()
    sent = tmp_path / "sent.txt"
    for run in range(runs):
        relay = run_relay(tmp_path / "relay.log", sent, poison, run)
        status = wait_or_hang(relay, sent)
        endings[status] += 1
        if (
            status == 0
            and OutboxEntry.objects.filter(destination="poison", state="parked").exists()
            and not OutboxEntry.objects.filter(state="pending").exclude(ordering_key="bad")
        ):
            return endings
        time.sleep(LEASE + 0.2)  # the dead relay's lease runs out
    raise AssertionError(f"the relays never finished: {endings}\n{relay.output()}")


@pytest.mark.parametrize("how", ["exit", "hang", "raise"])
def test_a_poison_message_is_parked_within_max_attempts_and_healthy_ones_go_once(
    how: str, tmp_path: Path
) -> None:
    with transaction.atomic():
        outbox.send("poison", {"n": 0}, key="bad")
        outbox.send("behind-poison", {"n": 1}, key="bad")
        for n in range(5):
            outbox.send(f"healthy-{n}", {"n": n}, key="good")
            outbox.send(f"free-{n}", {"n": n})

    endings = relay_until_done(tmp_path, {"poison": how})

    poison = OutboxEntry.objects.get(destination="poison")
    assert poison.state == "parked", endings
    assert poison.attempts == MAX_ATTEMPTS
    if how != "raise":
        assert "lease ran out" in poison.last_error
        # One death (or hang) per attempt, then a relay that parks it and goes on.
        assert endings[0] >= 1 and sum(endings.values()) - endings[0] == MAX_ATTEMPTS, endings
    assert OutboxEntry.objects.get(destination="behind-poison").state == "pending"
    healthy = {f"{prefix}-{n}" for prefix in ("healthy", "free") for n in range(5)}
    assert set(OutboxEntry.objects.filter(state="sent").values_list("destination", flat=True)) == (
        healthy
    )
    sends = Counter(line for line in (tmp_path / "sent.txt").read_text().split() if line[0] != "!")
    assert set(sends) == healthy
    # A healthy batch-mate goes again at most once: with the batch the poison first took down,
    # then on its own; never once per death.
    assert max(sends.values()) <= 2, sends
