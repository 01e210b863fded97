"""The relay under psycopg2 listens, as under psycopg 3 (issue 35, item 9).

psycopg2 keeps notifications in ``connection.notifies``, filled by ``connection.poll()``, and
the wait is a ``select`` on the connection; the relay used to poll there instead, so COMMIT ->
sent took about a poll interval. A real relay process runs with psycopg 3 hidden (a meta-path
finder refuses it, so Django's backend loads psycopg2) and a poll interval of a minute: only a
``NOTIFY`` can wake it within the test. Its LISTEN connection is then cut from the server side
(``pg_terminate_backend``): it listens again and wakes for the next message too.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

# Imported, not skipped when missing: the dev extra installs psycopg2-binary, so CI runs this.
import psycopg2  # noqa: F401
import pytest
from django.db import connection, transaction

from django_idempotency.models import OutboxEntry
from django_idempotency.outbox import core as outbox
from django_idempotency.outbox.store import NOTIFY_CHANNEL
from tests.outbox_helpers import NULL_TRANSPORTS, start, wait_for
from tests.servers import database_url

pytestmark = [
    pytest.mark.slow,
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("null_default_transport"),
]

UNDER_PSYCOPG2 = """
import importlib.abc, sys

class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "psycopg" or name.startswith("psycopg."):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)
        return None

sys.meta_path.insert(0, Hide())
import django
django.setup()
from django.db import connections
print("driver:", connections["default"].Database.__name__, flush=True)
from django.core.management import execute_from_command_line
execute_from_command_line(["manage.py", *sys.argv[1:]])
"""


def listeners() -> list[int]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE query = %s AND pid <> pg_backend_pid() "
            "AND datname = current_database()",
            [f"LISTEN {NOTIFY_CHANNEL}"],
        )
        return [row[0] for row in cursor.fetchall()]


def write(destination: str) -> str:
    with transaction.atomic():
        return outbox.send(destination, {"at": time.time()})


def sent(event_id: str) -> bool:
    return OutboxEntry.objects.filter(event_id=event_id, state="sent").exists()


def test_under_psycopg2_a_notification_wakes_the_relay(tmp_path: Path) -> None:
    relay = start(
        [sys.executable, "-c", UNDER_PSYCOPG2, "idempotency_relay", "--poll-interval", "60"],
        db_url=database_url(connection.settings_dict),
        env={"IDEMPOTENCY_OUTBOX_TRANSPORTS": json.dumps(NULL_TRANSPORTS)},
        log=tmp_path / "relay.log",
        broker_url="memory://",
    )
    try:
        # A guard against a hang (Django's start alone took 11 s on the loaded CI machine); the
        # waits below, under the 60 s poll interval, are what shows a NOTIFY woke the relay.
        wait_for(lambda: bool(listeners()), 120, "the relay's LISTEN", relay.output)
        assert "driver: psycopg2" in relay.output()
        written = time.monotonic()
        first = write("psycopg2.first")
        wait_for(lambda: sent(first), 30, "a NOTIFY to wake the relay", relay.output)
        took = time.monotonic() - written
        # The LISTEN connection cut from the server side: the relay listens again.
        (pid,) = listeners()
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
        wait_for(lambda: listeners() not in ([], [pid]), 30, "a new LISTEN", relay.output)
        second = write("psycopg2.second")
        wait_for(lambda: sent(second), 30, "a NOTIFY after listening again", relay.output)
    finally:
        relay.stop()
    print(f"COMMIT -> sent under psycopg2 (poll interval 60 s): {took:.3f} s")
    assert "polls instead" not in relay.output()
