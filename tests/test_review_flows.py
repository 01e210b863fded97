"""Review probes of phased views: a multipart upload larger than what the database takes in one
statement.

A multipart body is written again from its parsed form for the completer (``_stored_body``), files
included, and stored base64 in ``FlowRun.request``. Django bounds a raw body by
``DATA_UPLOAD_MAX_MEMORY_SIZE``, but not uploaded files, so a large upload made the first phase
write a value over MariaDB's ``max_allowed_packet`` (16 MB by default): "server has gone away", a
500, and the connection dropped.
"""

from __future__ import annotations

import uuid

import pytest
from django.contrib.auth.models import AnonymousUser
from django.core.files.uploadedfile import SimpleUploadedFile
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import RequestFactory

from django_idempotency import idempotent
from django_idempotency.flows.completer import complete_abandoned
from django_idempotency.flows.phases import Flow
from django_idempotency.models import FlowRun
from testproject.shop.models import Effect
from testproject.shop.probe_flows import ProbeError
from tests.probes import effects

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
