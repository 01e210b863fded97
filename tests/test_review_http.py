"""Review probe: a lease that runs out mid-view, under REPEATABLE READ or SERIALIZABLE on
PostgreSQL.

In lease mode the view runs in a transaction of its own, whose snapshot its first query fixes.
When the lease runs out and a retry takes the record over (swapping the token) and commits, the
stale holder's ``complete()`` updates a row that changed after its snapshot: at READ COMMITTED
the update finds the token gone (``StaleClaim``, answered 409), but at REPEATABLE READ and
SERIALIZABLE PostgreSQL raises a serialization failure (``40001``) instead, which answered 500
(from ``complete()``, or from ``release()`` for a status that is not stored).
Either way the stale holder's writes roll back; the answer must be the same 409.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
from django.db import connection

from django_idempotency.exceptions import RequestInProgress
from django_idempotency.http.core import Captured, Idempotency
from django_idempotency.models import IdempotencyRecord
from testproject.shop.models import Effect
from tests.probes import in_thread
from tests.test_lease import command
from tests.test_lease_fencing import short_lease, take_over

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


@pytest.mark.parametrize("status", [201, 429])  # stores the response, or releases the record
@pytest.mark.parametrize("level", ["REPEATABLE_READ", "SERIALIZABLE"])
def test_a_stale_holder_at_a_strict_isolation_level_gets_409_not_500(
    level: str, status: int
) -> None:
    if connection.Database.__name__ != "psycopg":
        pytest.skip("the isolation level is set through psycopg 3's connection")
    import psycopg

    key = str(uuid.uuid4())
    started, wake = threading.Event(), threading.Event()

    def stale_view() -> str:
        Effect.objects.filter(name="review-charge").count()  # fixes the snapshot
        started.set()
        assert wake.wait(180), "the test never woke the stale holder"
        Effect.objects.create(name="review-charge", payload="stale")
        return "stale"

    def stale_request() -> Any:
        connection.ensure_connection()
        connection.connection.isolation_level = getattr(psycopg.IsolationLevel, level)
        return Idempotency(short_lease()).run(
            command(key), stale_view, lambda result: Captured(status, {}, result.encode())
        )

    stale, stale_outcome = in_thread(stale_request)
    assert started.wait(60)
    new, new_outcome = take_over(key, lambda: "new")
    new.join(60)
    assert new_outcome == {"result": "new"}
    wake.set()
    stale.join(60)
    assert isinstance(stale_outcome.get("error"), RequestInProgress), stale_outcome
    assert int(stale_outcome["error"].retry_after) >= 1
    assert not Effect.objects.filter(name="review-charge").exists()
    assert bytes(IdempotencyRecord.objects.get().response_body or b"") == b"new"
