"""SQLite: a lease-mode request whose response cannot be stored because another connection holds
the database's write lock past the connection's ``timeout`` (``database is locked``).

In lease mode the claim commits on its own, and the view's transaction takes the write lock
only when it first writes, here when the response is stored; a writer that holds the lock for
longer (a purge's batch, a key rotation, a long admin edit, another process's transaction) makes
SQLite give up with ``database is locked``. That was the driver's ``OperationalError``, a
``500`` of the library's own. It is now what the other backends answer for a lock wait that ran
out (MariaDB 1205, PostgreSQL ``55P03``): ``503`` ``database-unavailable`` with
``Retry-After``, nothing of the view's transaction kept, and a retry after the claim (which the
same lock may keep from being released: ``release_failed``) stores the answer, replayed after."""

from __future__ import annotations

import json
import sqlite3
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import RequestFactory
from django.utils import timezone

from django_idempotency.http.decorators import idempotent
from django_idempotency.models import IdempotencyRecord

pytestmark = [pytest.mark.sqlite, pytest.mark.django_db(transaction=True)]

HOLDERS: list[sqlite3.Connection] = []


@pytest.fixture
def short_timeout() -> Iterator[None]:
    """The test connection waits 0.3 s for the write lock (the test settings give it 20 s)."""
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's write lock")
    options = connection.settings_dict.setdefault("OPTIONS", {})
    saved = dict(options)
    connection.close()
    options["timeout"] = 0.3
    try:
        yield
    finally:
        for holder in HOLDERS:
            holder.close()
        HOLDERS.clear()
        connection.close()
        options.clear()
        options.update(saved)


CALLS: list[str] = []


@idempotent(atomic=False, lease=timedelta(seconds=30))
def view(request: HttpRequest) -> HttpResponse:
    key = request.headers["Idempotency-Key"]
    CALLS.append(key)
    if len(CALLS) == 1:
        # Another connection takes the write lock that storing the response needs (the view
        # wrote nothing, so its transaction does not hold it yet), and keeps it.
        holder = sqlite3.connect(connection.settings_dict["NAME"], timeout=0.1)
        holder.isolation_level = None
        HOLDERS.append(holder)
        holder.execute("BEGIN IMMEDIATE")
    return JsonResponse({"call": len(CALLS)}, status=201)


def post(key: str) -> HttpResponse:
    request = RequestFactory().post(
        "/locked/", b"{}", content_type="application/json", headers={"Idempotency-Key": key}
    )
    return view(request)  # type: ignore[no-any-return]


@pytest.mark.usefixtures("short_timeout")
def test_a_response_that_meets_the_write_lock_is_503_not_a_500() -> None:
    CALLS.clear()
    key = f"locked-{uuid.uuid4()}"
    first = post(key)  # raised OperationalError("database is locked")
    assert first.status_code == 503, first.content
    assert first["Content-Type"] == "application/problem+json"
    assert first["Retry-After"]
    assert json.loads(first.content)["type"].endswith("#database-unavailable")
    for holder in HOLDERS:
        holder.execute("ROLLBACK")
    # The release met the same lock (release_failed): the claim is kept until its lease runs
    # out, as after a crash. Let it run out.
    IdempotencyRecord.objects.filter(key=key).update(locked_until=timezone.now())
    second = post(key)
    assert second.status_code == 201, second.content
    assert json.loads(second.content) == {"call": 2}
    replay = post(key)
    assert replay["Idempotent-Replayed"] == "true" and replay.content == second.content
    assert CALLS == [key, key]
