"""Views for the outbox proofs.

``POST /probe/outbox/effect/`` (``Idempotency-Key`` required, body ``{"queue"}``) writes one
``Effect`` named ``probe-outbox`` for the key and, in the same transaction, publishes
``shop.effect`` for a new event id through the outbox to ``queue``; it answers both (the database
fault tests, tests/test_db_faults.py: one effect and one message per key).

A view for the outbox proofs: confirm an order, then die right after COMMIT.

``POST /probe/outbox/order-then-die/`` with ``{"queue", "outbox", "on_commit"}`` (two event
ids) creates an ``Order`` and, in its transaction, publishes event ``outbox`` through the outbox
and event ``on_commit`` with ``apply_async_on_commit``. The first ``on_commit`` callback SIGKILLs
the worker process: the COMMIT has happened, no publish has. It only runs in a server started by
the test suite (``PROBE_PID_DIR`` set, see tests/servers.py); anywhere else it answers 403.
"""

from __future__ import annotations

import json
import os
import signal

from django.db import transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from django_idempotency import idempotent, new_event_id, outbox
from testproject.shop.models import Effect, Order
from testproject.shop.tasks import effect


@csrf_exempt
@require_POST
def order_then_die(request: HttpRequest) -> HttpResponse:
    if not os.environ.get("PROBE_PID_DIR"):
        return JsonResponse({"error": "only under the test suite's gunicorn"}, status=403)
    data = json.loads(request.body)
    with transaction.atomic():
        Order.objects.create(reference="KILLED-AFTER-COMMIT", amount_cents=100)
        transaction.on_commit(lambda: os.kill(os.getpid(), signal.SIGKILL))
        outbox.publish(effect, kwargs={"event_id": data["outbox"]}, queue=data["queue"])
        effect.apply_async_on_commit(kwargs={"event_id": data["on_commit"]}, queue=data["queue"])
    return JsonResponse({"unreachable": True})


@csrf_exempt
@require_POST
@idempotent(required=True)
def effect_and_event(request: HttpRequest) -> HttpResponse:
    data = json.loads(request.body or b"{}")
    key = request.headers["Idempotency-Key"]
    row = Effect.objects.create(name="probe-outbox", payload=key)
    event_id = str(new_event_id())
    outbox.publish(effect, kwargs={"event_id": event_id}, queue=data.get("queue", "unused"))
    return JsonResponse({"effect": row.pk, "event_id": event_id}, status=201)
