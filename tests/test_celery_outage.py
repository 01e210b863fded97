"""A real database outage under a real Celery worker logs the outage, not every message.

Issue 35: during a 5-second outage under load, the worker logged about 320 "could not count the
failed delivery" warnings with 1,280 tracebacks. Now each pool process logs one WARNING line
naming the cause when it meets the outage, keeps the per-message lines and their tracebacks at
DEBUG, and logs one line when a delivery succeeds again, saying what was retried meanwhile.

The outage is PostgreSQL's own: the test database stops accepting connections
(``ALLOW_CONNECTIONS false``) and the worker's sessions are terminated, for 5 seconds, while
messages keep arriving; then it accepts connections again. Every message is applied once.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from celery.result import ResultSet
from django.db import connection, connections

from django_idempotency.events.ids import new_event_id
from testproject.shop.models import Effect
from tests.conftest import require_service
from tests.services import BROKER_URLS
from tests.workers import database_url, worker_group

pytestmark = [
    pytest.mark.slow,
    pytest.mark.postgres,
    pytest.mark.timeout(600),  # above the sum of its guards against a hang
    pytest.mark.django_db(transaction=True, databases=["default", "other"]),
]

CONCURRENCY = 4
MESSAGES = 120
OUTAGE = 5.0


def outage(name: str, *, begin: bool) -> None:
    """Begin or end the outage of the test database, from a session on another database (a
    database cannot refuse the connections of a session connected to it)."""
    with connections["other"].cursor() as cursor:
        cursor.execute(
            f"ALTER DATABASE {connection.ops.quote_name(name)} "
            f"ALLOW_CONNECTIONS {'false' if begin else 'true'}"
        )
        if begin:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                [name],
            )


def test_an_outage_logs_one_warning_per_process_and_one_line_when_it_ends(
    tmp_path: Path,
) -> None:
    require_service("redis")
    name = str(connection.settings_dict["NAME"])
    with worker_group(
        broker_url=BROKER_URLS["redis"],
        db_url=database_url(connection.settings_dict),
        log_dir=tmp_path,
        label="outage",
        workers=1,
        concurrency=CONCURRENCY,
    ) as group:
        warm = [group.publish("shop.effect", kwargs={"event_id": str(new_event_id())})]
        ResultSet(warm).join_native(timeout=60, propagate=True)  # connections open
        events = [str(new_event_id()) for _ in range(MESSAGES)]
        results: list[Any] = []
        outage(name, begin=True)
        try:
            with group.producer() as producer:
                started = time.monotonic()
                for event in events:  # the load arrives while the database is away
                    results.append(
                        group.publish("shop.effect", kwargs={"event_id": event}, producer=producer)
                    )
                    time.sleep(OUTAGE / MESSAGES)
                time.sleep(max(0.0, OUTAGE - (time.monotonic() - started)))
        finally:
            outage(name, begin=False)
        outcomes = ResultSet(results).join_native(timeout=180, propagate=False, interval=0.1)
        connection.close()  # this test's own session was terminated too
        log = group.workers[0].output()

    assert Counter(outcomes) == {"applied": MESSAGES}, log[-6000:]
    applied = Counter(Effect.objects.filter(payload__in=events).values_list("payload", flat=True))
    assert applied == dict.fromkeys(events, 1)

    began = re.findall(r"WARNING.*the database is unavailable \((.*)\)", log)
    ended = re.findall(r"WARNING.*the database is back after .*", log)
    print(
        f"\n{MESSAGES} messages over a {OUTAGE:.0f}s outage: {len(began)} outage lines, "
        f"{len(ended)} recovery lines, {log.count('Traceback')} tracebacks"
    )
    for line in ended:
        print(line)
    # One line per pool process (and at most one outage each: the load stops with it).
    assert 1 <= len(began) <= CONCURRENCY + 1, began
    assert all("OperationalError" in cause for cause in began), began
    assert 1 <= len(ended) <= len(began), log[-6000:]
    assert all("deliveries retried" in line for line in ended), ended
    # The per-message lines and their tracebacks are at DEBUG (the worker logs INFO).
    assert "could not count the failed delivery" not in log
    assert "database error, nothing applied" not in log
    assert "Traceback" not in log, log[-6000:]
