"""Crashes: a gunicorn worker is SIGKILLed (or stopped) while it holds a request.

Atomic mode: the database rolls back the dead worker's transaction, record included, so the
retry executes once and succeeds. Lease mode: the committed claim stays until the lease runs
out (retries get 409), then a retry takes it over; a holder that wakes up after the takeover
cannot store its response.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from django_idempotency.models import IdempotencyRecord
from testproject.shop.models import Effect
from tests.probes import effects
from tests.servers import Gunicorn, Reply, gunicorn

pytestmark = [pytest.mark.slow, pytest.mark.pooler, pytest.mark.django_db(transaction=True)]

RETRY_DEADLINE = 60.0  # a guard against a hang (the probe's lease is 3 s), not a timing


@pytest.fixture(scope="module")
def server(django_db_setup: None) -> Iterator[Gunicorn]:
    with gunicorn(connection.settings_dict, workers=2) as running:
        yield running


def send_in_background(
    server: Gunicorn, path: str, key: str, headers: dict[str, str]
) -> tuple[threading.Thread, dict[str, Any]]:
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["reply"] = server.post(path, key, headers=headers)
        except OSError as exc:  # the worker died under the request: no answer
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def retry_until_done(server: Gunicorn, path: str, key: str) -> tuple[Reply, int]:
    """Retry like a client honouring 409 + Retry-After; return the reply and the 409 count."""
    refused = 0
    deadline = time.monotonic() + RETRY_DEADLINE
    while True:
        reply = server.post(path, key)
        if reply.status != 409:
            return reply, refused
        assert json.loads(reply.body)["type"].endswith("#in-progress")
        refused += 1
        assert time.monotonic() < deadline, f"still 409 after {RETRY_DEADLINE}s"
        time.sleep(0.2)


def test_sigkill_while_holding_the_transaction(server: Gunicorn) -> None:
    key = str(uuid.uuid4())
    thread, outcome = send_in_background(server, "/probe/effect/", key, {"X-Probe-Sleep": "20"})
    pid = server.worker_pid(key)  # written after the effect, inside the open transaction
    os.kill(pid, signal.SIGKILL)
    thread.join(60)  # the request ends with its worker; a guard, not a timing
    assert "error" in outcome or outcome["reply"].status >= 500, outcome

    reply, _ = retry_until_done(server, "/probe/effect/", key)
    assert reply.status == 201
    assert "Idempotent-Replayed" not in reply.headers
    assert json.loads(reply.body)["pid"] != pid
    assert effects(key=key) == 1  # the killed worker's effect was rolled back
    record = IdempotencyRecord.objects.get(key=key)
    assert record.state == IdempotencyRecord.State.COMPLETED
    assert server.post("/probe/effect/", key).body == reply.body


def test_lease_sigkill_mid_view_then_retry_inside_and_after_the_lease(server: Gunicorn) -> None:
    key = str(uuid.uuid4())
    thread, outcome = send_in_background(
        server, "/probe/lease-short/", key, {"X-Probe-Sleep": "20"}
    )
    pid = server.worker_pid(key)
    claim = IdempotencyRecord.objects.get(key=key)  # committed before the view ran
    assert claim.state == IdempotencyRecord.State.IN_PROGRESS
    assert claim.locked_until is not None
    os.kill(pid, signal.SIGKILL)
    thread.join(60)  # the request ends with its worker; a guard, not a timing
    assert "error" in outcome or outcome["reply"].status >= 500, outcome

    inside = server.post("/probe/lease-short/", key)
    answered = timezone.now()
    if answered < claim.locked_until:
        assert inside.status == 409  # answered inside the lease (3 s): still held
    else:
        # A loaded machine took longer than the lease to kill the worker and answer: the retry
        # may already have taken over (the lease's own rule); what follows holds either way.
        assert inside.status in (409, 201), inside
    reply, _ = retry_until_done(server, "/probe/lease-short/", key)
    assert reply.status == 201
    record = IdempotencyRecord.objects.get(key=key)
    assert record.pk == claim.pk
    assert record.token != claim.token  # taken over with a new fencing token
    assert record.state == IdempotencyRecord.State.COMPLETED
    assert effects(key=key) == 1  # the killed view's transaction rolled back
    assert server.post("/probe/lease-short/", key).body == reply.body


def test_lease_holder_that_wakes_after_a_takeover_cannot_store(server: Gunicorn) -> None:
    key = str(uuid.uuid4())
    headers = {"X-Probe-Sleep": "1", "X-Probe-Late-Effect": "1"}
    thread, outcome = send_in_background(server, "/probe/lease-short/", key, headers)
    pid = server.worker_pid(key)
    os.kill(pid, signal.SIGSTOP)  # the holder freezes (a long GC pause, a stalled VM...)
    try:
        taken_over, refused = retry_until_done(server, "/probe/lease-short/", key)
        assert taken_over.status == 201
        assert refused >= 1
    finally:
        os.kill(pid, signal.SIGCONT)
    thread.join(60)
    stale = outcome["reply"]
    assert stale.status == 409, stale
    assert "took it over" in json.loads(stale.body)["detail"]
    # The holder wrote its effect after waking, but its transaction rolled back.
    assert list(Effect.objects.filter(payload=key).values_list("name", flat=True)) == [
        "lease-short"
    ]
    record = IdempotencyRecord.objects.get(key=key)
    assert bytes(record.response_body or b"") == taken_over.body
