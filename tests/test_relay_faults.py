"""The relay through a TCP proxy that cuts its database connection: a claim whose COMMIT goes
unanswered, and an outage.

* **A cut claim COMMIT** (issue 35, item 10): the proxy lets the claim's COMMIT reach the
  server, drops the answer and closes the connection. The lease committed, but the relay never
  heard it; it used to leave the message leased until the lease ran out. It now takes back the
  rows still under its own lease token at its next claim, and sends them at once.
* **An outage** (item 12): the proxy refuses connections for a few seconds. The relay logs one
  WARNING naming the cause, no traceback, and one line when the database answers again.

The relay is a real ``manage.py idempotency_relay`` process; its log is read at WARNING.
"""

from __future__ import annotations

import re
import socket
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, transaction

from django_idempotency.models import OutboxEntry
from django_idempotency.outbox import core as outbox
from tests.outbox_helpers import Process, TcpProxy, file_transports, start, wait_for
from tests.servers import database_url, free_port
from tests.test_relay_psycopg2 import UNDER_PSYCOPG2

pytestmark = [
    pytest.mark.slow,
    pytest.mark.postgres,
    pytest.mark.mysql,
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("null_default_transport"),
]

LEASE = 20.0


def markers() -> tuple[re.Pattern[bytes], bytes]:
    """What the claim's lease statement and a COMMIT look like on the wire, per backend."""
    if connection.vendor == "postgresql":
        # A simple-query message "COMMIT" (psycopg sends it so; "READ COMMITTED" is no match).
        return re.compile(rb"attempts = attempts \+ 1"), b"Q\x00\x00\x00\x0bCOMMIT\x00"
    # COM_QUERY "COMMIT": a 7-byte packet, sequence 0.
    return re.compile(rb"`attempts` \+ 1\)"), b"\x07\x00\x00\x00\x03COMMIT"


class Proxy(TcpProxy):
    """:class:`TcpProxy`, whose ``stop()`` also wakes the thread blocked in ``accept()``: closed
    under it, the listening socket went on queueing connections, which then hung instead of
    being refused."""

    def stop(self) -> None:
        server = self._server
        if server is not None:
            with suppress(OSError):
                server.shutdown(socket.SHUT_RDWR)
        super().stop()


class ClaimCommitCut(Proxy):
    """A proxy to the database that cuts the first claim's COMMIT after the server answered it:
    once a connection has sent the claim's lease, its next COMMIT goes through, the server's
    answer is dropped and both sides are closed."""

    def __init__(self, target: tuple[str, int], port: int) -> None:
        super().__init__(target, port)
        self.lease, self.commit = markers()
        self.armed = True
        self.cut = threading.Event()

    def _forward(self, client: socket.socket, upstream: socket.socket) -> None:
        state = {"leased": False, "cutting": False}
        threading.Thread(target=self._outward, args=(client, upstream, state), daemon=True).start()
        threading.Thread(target=self._inward, args=(upstream, client, state), daemon=True).start()

    def _outward(self, client: socket.socket, upstream: socket.socket, state: dict) -> None:
        try:
            while data := client.recv(65536):
                if self.armed:
                    if self.lease.search(data):
                        state["leased"] = True
                    elif state["leased"] and self.commit in data:
                        self.armed = False
                        state["cutting"] = True  # the answer to this is dropped
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            with suppress(OSError):
                upstream.shutdown(socket.SHUT_WR)

    def _inward(self, upstream: socket.socket, client: socket.socket, state: dict) -> None:
        try:
            while data := upstream.recv(65536):
                if state["cutting"]:
                    # The server answered the COMMIT: it committed. The client never hears it.
                    for sock in (client, upstream):
                        with suppress(OSError):
                            sock.shutdown(socket.SHUT_RDWR)
                        sock.close()
                    self.cut.set()
                    return
                client.sendall(data)
        except OSError:
            pass
        finally:
            with suppress(OSError):
                client.shutdown(socket.SHUT_WR)


@pytest.fixture(params=["default-driver", "psycopg2"])
def driver(request: pytest.FixtureRequest) -> str:
    """The relay's driver: the backend's default (psycopg 3, mysqlclient), or psycopg2
    (PostgreSQL only, psycopg 3 hidden)."""
    if request.param == "psycopg2" and connection.vendor != "postgresql":
        pytest.skip("psycopg2 is a PostgreSQL driver")
    return str(request.param)


def relay_through(proxy: TcpProxy, tmp_path: Path, driver: str, name: str = "relay") -> Process:
    """A relay process whose database connections go through ``proxy``; it writes each message
    it sends to ``tmp_path / "sent.log"`` (every relay of a test to the same file)."""
    url = database_url({**connection.settings_dict, "HOST": "127.0.0.1", "PORT": proxy.port})
    arguments = ["idempotency_relay", "--lease", str(LEASE), "--poll-interval", "0.5"]
    launcher = ["manage.py"] if driver == "default-driver" else ["-c", UNDER_PSYCOPG2]
    relay = start(
        [sys.executable, *launcher, *arguments],
        db_url=url,
        env={
            "IDEMPOTENCY_OUTBOX_TRANSPORTS": file_transports(tmp_path / "sent.log"),
            "IDEMPOTENCY_LOG_LEVEL": "WARNING",
        },
        log=tmp_path / f"{name}.log",
        broker_url="memory://",
    )
    # A guard against a hang: Django's start alone took 11 s on the loaded CI machine.
    wait_for(lambda: "outbox relay started" in relay.output(), 120, "the relay", relay.output)
    if driver == "psycopg2":
        assert "driver: psycopg2" in relay.output()
    return relay


def output(relay: Process) -> str:
    """The relay's log, without the lines the command and the driver probe print."""
    return "\n".join(
        line
        for line in relay.output().splitlines()
        if line.strip() and not line.startswith(("outbox relay started", "{", "driver: "))
    )


def write(destination: str) -> str:
    with transaction.atomic():
        return outbox.send(destination, {"at": time.time()})


def sent(event_id: str) -> bool:
    return OutboxEntry.objects.filter(event_id=event_id, state="sent").exists()


def target() -> tuple[str, int]:
    settings: Any = connection.settings_dict
    return (settings.get("HOST") or "127.0.0.1", int(settings["PORT"]))


def test_a_claim_whose_commit_went_unanswered_is_taken_back_at_once(
    tmp_path: Path, driver: str
) -> None:
    """The claim's COMMIT reaches the server and its answer is lost: the message was leased
    (committed) by a relay that did not know it. That relay reconnects, takes back its own
    lease, fenced by the lease token, and sends the message: one attempt counted, not two
    (a lease run out would have counted a second claim), and long before the lease ends. A
    second relay runs meanwhile: the message is sent once, by one of them."""
    proxy = ClaimCommitCut(target(), free_port())
    proxy.start()
    relays = [relay_through(proxy, tmp_path, driver, name) for name in ("one", "two")]

    def logs() -> str:
        return "\n".join(relay.output() for relay in relays)

    try:
        written = time.monotonic()
        event = write("cut.commit")
        wait_for(proxy.cut.is_set, 120, "the cut of the claim's COMMIT", logs)
        wait_for(lambda: sent(event), LEASE * 2, "the message sent", logs)
        took = time.monotonic() - written
    finally:
        for relay in relays:
            relay.stop()
        proxy.stop()
    row = OutboxEntry.objects.get(event_id=event)
    print(
        f"COMMIT -> sent across a cut claim COMMIT ({driver}): {took:.2f} s, lease {LEASE:.0f} s"
    )
    assert row.attempts == 1, logs()
    assert (tmp_path / "sent.log").read_text().splitlines() == ["cut.commit"]
    assert "1 failed batch(es) retried, 1 message(s) of unanswered claims taken back" in logs()
    assert "Traceback" not in logs()


def test_an_outage_is_one_warning_and_one_line_when_it_ends(tmp_path: Path, driver: str) -> None:
    """The database cannot be reached for a few seconds (the proxy closes every connection
    and refuses new ones), while a message is written directly. The relay logs one WARNING
    naming the cause and one line when the database answers again, with no traceback, and
    sends the message."""
    proxy = Proxy(target(), free_port())
    proxy.start()
    relay = relay_through(proxy, tmp_path, driver)
    try:
        first = write("outage.before")
        wait_for(lambda: sent(first), 120, "a first message", relay.output)
        proxy.stop()  # every connection reset, new ones refused
        event = write("outage.during")
        time.sleep(4)  # the outage: about eight failed claims at a 0.5 s poll interval
        proxy.start()
        wait_for(lambda: sent(event), 120, "the message sent after the outage", relay.output)
        wait_for(lambda: "answers again" in relay.output(), 60, "recovery", relay.output)
    finally:
        relay.stop()
        proxy.stop()
    lines = output(relay).splitlines()
    assert "Traceback" not in relay.output(), relay.output()
    assert len(lines) == 2, relay.output()
    failed, recovered = lines
    assert failed.startswith("outbox relay: database 'default' failed (OperationalError: ")
    assert "retrying every 0.5 s until it answers" in failed
    assert re.fullmatch(
        r"outbox relay: database 'default' answers again after [\d.]+ s; "
        r"([2-9]|\d\d+) failed batch\(es\) retried, 0 message\(s\) of unanswered claims taken "
        r"back, \d+ claimed now",
        recovered,
    ), recovered
