"""Review s3: a statement's error at the request's COMMIT (a deferred constraint on PostgreSQL)
is what it was before the 503 for a lost database: the driver's error, not "unknown"."""

from __future__ import annotations

import uuid

import pytest
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import Client
from django.urls import path
from django.views.decorators.csrf import csrf_exempt

from django_idempotency import idempotent
from django_idempotency.models import IdempotencyRecord
from testproject.shop.models import Payment

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.urls(__name__),
    pytest.mark.skipif("connection.vendor != 'postgresql'", reason="deferred foreign keys"),
]


@csrf_exempt
@idempotent
def pay(request: HttpRequest) -> HttpResponse:
    # Django's foreign keys are DEFERRABLE INITIALLY DEFERRED on PostgreSQL: checked at COMMIT.
    Payment.objects.create(
        order_id=987654321, provider="p", external_payment_id="x", amount_cents=1
    )
    return JsonResponse({"ok": True}, status=201)


urlpatterns = [path("pay/", pay)]


@pytest.mark.parametrize("atomic_requests", [False, True], ids=["plain", "atomic-requests"])
def test_a_deferred_constraint_at_commit_is_no_503(
    monkeypatch: pytest.MonkeyPatch, atomic_requests: bool
) -> None:
    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", atomic_requests)
    client = Client(raise_request_exception=False)
    key = str(uuid.uuid4())
    for _ in range(2):  # nothing committed: the retry runs again, and fails the same way
        response = client.post("/pay/", HTTP_IDEMPOTENCY_KEY=key)
        assert response.status_code == 500, response.content
    assert not Payment.objects.exists()
    assert not IdempotencyRecord.objects.exists()
