"""Review probes of phased views: a multipart upload larger than what the database takes in one
statement.

A multipart body is written again from its parsed form for the completer (``_stored_body``), files
included, and stored base64 in ``FlowRun.request``. Django bounds a raw body by
``DATA_UPLOAD_MAX_MEMORY_SIZE``, but not uploaded files, so a large upload made the first phase
write a value over MariaDB's ``max_allowed_packet`` (16 MB by default): "server has gone away", a
500, and the connection dropped.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
from django.contrib.auth.models import AnonymousUser
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import RequestFactory

from django_idempotency import idempotent
from django_idempotency.flows.completer import complete_abandoned
from django_idempotency.flows.phases import Flow
from django_idempotency.models import FlowRun
from testproject.shop.models import Effect
from testproject.shop.probe_flows import ProbeError
from tests.probes import effects, in_thread
from tests.test_flows_hardening import json_post

pytestmark = [pytest.mark.django_db(transaction=True)]

SIZE = 13 * 1024 * 1024
"""Under 16 MB as a file; over it once base64-encoded in the stored request."""


@idempotent(phases=True, lease=30)
def big_upload_view(request: HttpRequest, flow: Flow) -> HttpResponse:
    key = request.headers["Idempotency-Key"]
    flow.phase("stored", lambda: Effect.objects.create(name="review-upload", payload=key).pk)
    if request.headers.get("X-Stop"):
        raise ProbeError("stopped after stored")
    return JsonResponse({"size": request.FILES["doc"].size}, status=201)


def big_post(key: str, **headers: str) -> HttpRequest:
    content = b"\x00\xff" * (SIZE // 2)
    request = RequestFactory().post(
        "/upload",
        data={"doc": SimpleUploadedFile("big.bin", content, "application/pdf")},
        headers=headers,
    )
    request.META["HTTP_IDEMPOTENCY_KEY"] = key
    request.user = AnonymousUser()
    return request


def test_a_large_multipart_upload_to_a_phased_view_is_answered_not_500() -> None:
    key = str(uuid.uuid4())
    response = big_upload_view(big_post(key))
    assert response.status_code == 201, response.content[:500]
    assert effects("review-upload", key) == 1
    stopped = str(uuid.uuid4())
    with pytest.raises(ProbeError):
        big_upload_view(big_post(stopped, X_Stop="1"))
    assert FlowRun.objects.get(record__key=stopped).request["body"] is None
    [done] = complete_abandoned()  # cannot rebuild the request: says so, runs nothing
    assert (done.key, done.outcome) == (stopped, "unavailable")
    assert "DATA_UPLOAD_MAX_MEMORY_SIZE" in done.detail
    retry = big_upload_view(big_post(stopped))  # the client's retry resumes the run
    assert retry.status_code == 201, retry.content[:500]
    assert effects("review-upload", stopped) == 1


# --- a phase whose lease runs out mid-way, at a strict isolation level (PostgreSQL) -----------

HOLD = threading.Event()
HOLDING = threading.Event()
WAKE = threading.Event()


@idempotent(phases=True, lease=0.3)
def slow_phase_view(request: HttpRequest, flow: Flow) -> HttpResponse:
    key = request.headers["Idempotency-Key"]

    def charge() -> int:
        Effect.objects.filter(name="review-phase").count()  # fixes the snapshot
        if HOLD.is_set():
            HOLD.clear()
            HOLDING.set()
            assert WAKE.wait(180), "the test never woke the stale holder"
        return Effect.objects.create(name="review-phase", payload=key).pk

    flow.phase("charge", charge)
    return JsonResponse({"ok": True}, status=201)


@pytest.mark.postgres
@pytest.mark.parametrize("level", ["REPEATABLE_READ", "SERIALIZABLE"])
def test_a_phase_that_outlived_its_lease_gets_409_not_500(level: str) -> None:
    """The phase's fence (a token-checked update) meets a takeover committed after the phase's
    snapshot: at READ COMMITTED it finds the token gone (409); at REPEATABLE READ and
    SERIALIZABLE PostgreSQL raised a serialization failure, a 500."""
    if connection.Database.__name__ != "psycopg":
        pytest.skip("the isolation level is set through psycopg 3's connection")
    import psycopg

    key = str(uuid.uuid4())
    HOLD.set()
    HOLDING.clear()
    WAKE.clear()

    def stale() -> Any:
        connection.ensure_connection()
        connection.connection.isolation_level = getattr(psycopg.IsolationLevel, level)
        return slow_phase_view(json_post(key))

    holder, held = in_thread(stale)
    assert HOLDING.wait(60)
    threading.Event().wait(0.6)  # the holder's lease runs out
    retry, retried = in_thread(lambda: slow_phase_view(json_post(key)))
    retry.join(60)
    assert retried["result"].status_code == 201, retried
    WAKE.set()
    holder.join(60)
    assert "error" not in held, held
    assert held["result"].status_code == 409, held["result"].content
    assert effects("review-phase", key) == 1
