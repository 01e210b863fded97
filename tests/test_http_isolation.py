"""A retry under REPEATABLE READ or SERIALIZABLE on PostgreSQL: 409, then the replay.

Under ``ATOMIC_REQUESTS`` the request's transaction takes its snapshot at its first statement
(a session lookup, say), before the view's claim. When a rival request with the same key commits
after that snapshot, the claim's ``INSERT ... ON CONFLICT DO UPDATE`` meets a row the snapshot
cannot see, and PostgreSQL raises a serialization failure (``40001``): it answered 500. It is now
"in progress" (409, ``Retry-After``), and the client's retry, in a new transaction, gets the
replay. Real threads, each with its own connection; the isolation level is set on the
connection as ``DATABASES[...]["OPTIONS"]["isolation_level"]`` sets it.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth.models import AnonymousUser
from django.db import connection, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import RequestFactory

from django_idempotency import idempotent
from django_idempotency.exceptions import RequestInProgress
from testproject.shop.models import Effect
from tests.probes import PROBLEM, effects, in_thread

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

CLAIMED = threading.Event()
FINISH = threading.Event()


@idempotent
def slow_create(request: HttpRequest) -> HttpResponse:
    """Creates an effect; the first request waits, claim held, until the test lets it finish."""
    key = request.headers["Idempotency-Key"]
    Effect.objects.create(name="isolation", payload=key)
    if request.headers.get("X-Hold"):
        CLAIMED.set()
        assert FINISH.wait(30), "the test never let the holder finish"
    return JsonResponse({"created": key}, status=201)


def keyed_post(key: str, **headers: str) -> HttpRequest:
    request = RequestFactory().post(
        "/isolation", data=b'{"n": 1}', content_type="application/json", headers=headers
    )
    request.META["HTTP_IDEMPOTENCY_KEY"] = key
    request.user = AnonymousUser()
    return request


@pytest.fixture
def isolation(request: pytest.FixtureRequest) -> Iterator[str]:
    import psycopg

    if connection.Database.__name__ != "psycopg":
        pytest.skip("the isolation level is set through psycopg 3's connection")
    level: str = request.param
    connection.ensure_connection()
    raw = connection.connection
    raw.isolation_level = getattr(psycopg.IsolationLevel, level.replace(" ", "_").upper())
    CLAIMED.clear()
    FINISH.clear()
    yield level
    FINISH.set()
    raw.isolation_level = None


@pytest.mark.parametrize("isolation", ["repeatable read", "serializable"], indirect=True)
def test_a_retry_whose_rival_committed_after_its_snapshot_gets_409_then_the_replay(
    isolation: str,
) -> None:
    key = str(uuid.uuid4())
    holder, held = in_thread(lambda: slow_create(keyed_post(key, X_Hold="1")))
    assert CLAIMED.wait(30), held
    answers: list[Any] = []
    with transaction.atomic():  # ATOMIC_REQUESTS: the request's own transaction
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_setting('transaction_isolation')")
            assert cursor.fetchone()[0] == isolation
            cursor.execute("SELECT COUNT(*) FROM django_session")  # the session lookup
        FINISH.set()  # the rival commits now, after this transaction's snapshot
        holder.join(30)
        assert held["result"].status_code == 201, held
        answers.append(slow_create(keyed_post(key)))
    conflict = answers[0]
    assert conflict.status_code == 409, conflict.content
    assert conflict["Content-Type"] == PROBLEM
    assert json.loads(conflict.content)["type"].endswith(RequestInProgress.slug)
    assert int(conflict["Retry-After"]) >= 1
    retry = slow_create(keyed_post(key))  # a new transaction, whose snapshot sees the record
    assert retry.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert json.loads(retry.content) == {"created": key}
    assert effects("isolation", key) == 1
