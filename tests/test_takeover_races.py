"""Concurrent takeovers of one stale record on MariaDB: one of them wins.

Every contender's failed insert (1062) and locking read leave it a shared lock on the record,
so an ``UPDATE`` that never waits could not take it over while another contender holds one:
all of them answered 409 and nobody resumed the work (the flow completer's race test caught it
on a loaded machine). The takeover now waits briefly; the contenders deadlock, InnoDB rolls the
victims back, and one takes the record over.
"""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.db import transaction
from django.utils import timezone

from django_idempotency.http.store import RecordStore
from django_idempotency.models import IdempotencyRecord
from tests.probes import in_thread

pytestmark = [pytest.mark.mysql, pytest.mark.django_db(transaction=True)]

CONTENDERS = 4


def test_concurrent_takeovers_of_a_stale_lease_give_one_winner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = timezone.now()
    record = IdempotencyRecord.objects.create(
        owner="owner",
        key="key",
        fingerprint="f" * 64,
        method="POST",
        path="/x/",
        locked_until=now - timedelta(minutes=1),  # its holder died: the lease ran out
        expires_at=now + timedelta(days=1),
    )
    # Every contender has read the record (and holds its shared lock) before any of them
    # tries to take it over: the overlap a loaded machine produces by chance.
    all_read = threading.Barrier(CONTENDERS, timeout=60)
    take_over = RecordStore._take_over_or_report

    def after_everyone_read(self: RecordStore, *args: Any, **kwargs: Any) -> Any:
        all_read.wait()
        return take_over(self, *args, **kwargs)

    monkeypatch.setattr(RecordStore, "_take_over_or_report", after_everyone_read)

    all_tried = threading.Barrier(CONTENDERS, timeout=60)

    def contend() -> bool:
        with transaction.atomic():
            # Each transaction stays open until every contender has tried, as an atomic
            # request's does while its view runs: a loser does not let go of its lock early.
            result = RecordStore("default").claim(
                owner="owner",
                key="key",
                fingerprint="f" * 64,
                method="POST",
                path="/x/",
                token=uuid.uuid4(),
                ttl=timedelta(days=1),
                lease=timedelta(minutes=5),
            )
            all_tried.wait()
        return result.record_id is not None

    threads = [in_thread(contend) for _ in range(CONTENDERS)]
    for thread, _ in threads:
        thread.join(150)  # past both barriers' guards
    outcomes = [outcome.get("result", outcome.get("error")) for _, outcome in threads]

    assert outcomes.count(True) == 1, outcomes
    assert outcomes.count(False) == CONTENDERS - 1, outcomes
    record.refresh_from_db()
    assert record.locked_until is not None and record.locked_until > timezone.now()
