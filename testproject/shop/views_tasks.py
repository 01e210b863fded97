"""``POST /api/task-orders/``: the double protection recipe of ``docs/django-tasks.md``.

The view is idempotent per ``Idempotency-Key``: a retried request replays the stored answer and
enqueues nothing. The ledger task it enqueues on commit is idempotent per event id: a duplicate
enqueue, or a run again after a worker crash, writes no second ledger entry.
"""

from __future__ import annotations

import json
from functools import partial

from django.db import transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from django_idempotency import idempotent, new_event_id
from testproject.shop.models import Order
from testproject.shop.tasks_django import apply_order_confirmed


# --8<-- [start:view]
@csrf_exempt
@require_POST
@idempotent(required=True)
def orders_api(request: HttpRequest) -> HttpResponse:
    """Create an order once per Idempotency-Key; its ledger task runs once per event id."""
    try:
        data = json.loads(request.body)
        reference, amount_cents = str(data["reference"]), int(data["amount_cents"])
    except (ValueError, TypeError, KeyError) as exc:
        return _invalid(f"{type(exc).__name__}: {exc}")
    order = Order.objects.create(reference=reference, amount_cents=amount_cents)
    event_id = str(new_event_id())
    transaction.on_commit(
        partial(
            apply_order_confirmed.enqueue,
            event_id=event_id,
            order_id=order.pk,
            amount_cents=order.amount_cents,
        )
    )
    return JsonResponse({"order_id": order.pk, "event_id": event_id}, status=201)


# --8<-- [end:view]


def _invalid(detail: str) -> HttpResponse:
    body = {"type": "about:blank", "title": "Invalid order", "status": 400, "detail": detail}
    return JsonResponse(body, status=400, content_type="application/problem+json")
