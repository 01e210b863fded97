"""The demo: an orders API protected by django-idempotency, an unprotected copy, a home page.

* ``POST /api/orders/`` needs an ``Idempotency-Key`` (``@idempotent(required=True)``). The body
  ``{"reference", "amount_cents", "provider", "external_payment_id"}`` creates an order and its
  payment once, and publishes ``OrderConfirmed`` to the billing consumer on commit.
* ``POST /api/unsafe-orders/`` is the same endpoint without any protection, for comparison.
* ``GET /api/orders/<id>/`` (and ``/api/unsafe-orders/<id>/``) shows an order: the ``Location``
  both answer with.
"""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings
from django.db.models import Count
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, render
from django.urls import reverse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from django_idempotency import idempotent
from django_idempotency.models import IdempotencyRecord, ProcessedEvent
from testproject.shop.models import LedgerEntry, Order, Payment
from testproject.shop.orders import (
    InvalidOrder,
    OrderRequest,
    Placed,
    place_order,
    place_order_unprotected,
)


def _problem(status: int, title: str, **extra: Any) -> HttpResponse:
    body = {"type": "about:blank", "title": title, "status": status, **extra}
    return HttpResponse(json.dumps(body), status=status, content_type="application/problem+json")


def _parse(request: HttpRequest) -> OrderRequest:
    try:
        data = json.loads(request.body or b"null")
    except ValueError as exc:
        raise InvalidOrder({"body": f"is not JSON: {exc}"}) from exc
    return OrderRequest.parse(data)


def _customer(request: HttpRequest) -> Any:
    return request.user if request.user.is_authenticated else None


@csrf_exempt
@require_POST
@idempotent(required=True)
def orders_api(request: HttpRequest) -> HttpResponse:
    """Create an order and its payment, exactly once per Idempotency-Key and per payment."""
    try:
        order_request = _parse(request)
    except InvalidOrder as exc:
        return _problem(400, "Invalid order", errors=exc.errors)
    placed = place_order(order_request, _customer(request))
    response = JsonResponse(placed.as_dict(), status=201 if placed.created else 200)
    response["Location"] = f"/api/orders/{placed.order.pk}/"
    return response


@csrf_exempt
@require_POST
def unsafe_orders_api(request: HttpRequest) -> HttpResponse:
    """The same endpoint with no idempotency key and no business key: every retry counts."""
    try:
        order_request = _parse(request)
    except InvalidOrder as exc:
        return _problem(400, "Invalid order", errors=exc.errors)
    placed = place_order_unprotected(order_request, _customer(request))
    response = JsonResponse(placed.as_dict(), status=201)
    response["Location"] = f"/api/unsafe-orders/{placed.order.pk}/"
    return response


@require_GET
def order_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """The order a ``Location`` header points to, with its payment."""
    order = get_object_or_404(Order, pk=pk)
    placed = Placed(order, order.payments.first(), None, False).as_dict()
    return JsonResponse({"order": placed["order"], "payment": placed["payment"]})


def home(request: HttpRequest) -> HttpResponse:
    """The story of the demo, with live counts and the commands to try."""
    base = request.build_absolute_uri("/").rstrip("/")
    counts = {
        "orders": Order.objects.count(),
        "payments": Payment.objects.count(),
        "ledger_entries": LedgerEntry.objects.count(),
        "records": IdempotencyRecord.objects.count(),
        "events": ProcessedEvent.objects.count(),
    }
    duplicated = (
        Order.objects.values("reference")
        .annotate(n=Count("id"))
        .filter(n__gt=1)
        .order_by("-n")[:5]
    )
    return render(
        request,
        "shop/home.html",
        {
            "base": base,
            "counts": counts,
            "duplicated": list(duplicated),
            "orders_url": base + reverse("orders-api"),
            "unsafe_url": base + reverse("unsafe-orders-api"),
            "celery_eager": settings.CELERY_TASK_ALWAYS_EAGER,
            "broker": settings.CELERY_BROKER_URL,
        },
    )
