"""The ride-sharing checkout of docs/flows.md: Stripe's Rocket Rides, as a phased request.

``POST /api/rides/`` with ``{"origin": [lat, lon], "target": [lat, lon]}`` and an
``Idempotency-Key`` runs three phases:

1. ``ride_created`` (local): the ride is inserted;
2. ``charge_created`` (foreign): the provider charges the customer, under a key derived from
   the request's key, so a retry never charges twice;
3. ``finished`` (local): the charge is recorded on the ride and the receipt written.

A crash anywhere resumes at the first phase not done, on the client's retry or in the completer
(``manage.py idempotency_complete``). If the flow is rolled forward to failure, the ride is
cancelled and the charge refunded, each once.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from django_idempotency import idempotent
from django_idempotency.flows.phases import Flow
from testproject.shop import psp
from testproject.shop.models import Receipt, Ride

RIDE_PRICE_CENTS = 2000


def parse_points(body: bytes) -> dict[str, float]:
    """``{"origin": [lat, lon], "target": [lat, lon]}`` as model fields; ValueError if not."""
    data = json.loads(body or b"null")
    if not isinstance(data, dict):
        raise ValueError("the body must be a JSON object")
    fields: dict[str, float] = {}
    for point in ("origin", "target"):
        value = data.get(point)
        if (
            not isinstance(value, list)
            or len(value) != 2
            or not all(isinstance(n, (int, float)) and not isinstance(n, bool) for n in value)
        ):
            raise ValueError(f"{point} must be [latitude, longitude]")
        fields[f"{point}_lat"], fields[f"{point}_lon"] = float(value[0]), float(value[1])
    return fields


def customer_of(request: HttpRequest) -> str:
    return f"user-{request.user.pk}" if request.user.is_authenticated else "guest"


# --8<-- [start:rides]
def cancel_ride(ride: Ride, key: str) -> None:
    """Compensation of ``ride_created``."""
    Ride.objects.filter(pk=ride.pk).update(status=Ride.Status.CANCELLED)


def refund_charge(charge: dict[str, Any], key: str) -> None:
    """Compensation of ``charge_created``: a refund under its own stable key."""
    if "id" in charge:
        psp.refund(charge["id"], idempotency_key=key)


def finish(ride: Ride, charge: dict[str, Any]) -> Receipt:
    Ride.objects.filter(pk=ride.pk).update(status=Ride.Status.CHARGED, charge_id=charge["id"])
    return Receipt.objects.create(ride=ride, charge_id=charge["id"], amount_cents=charge["amount"])


@csrf_exempt
@require_POST
@idempotent(phases=True, required=True, lease=timedelta(seconds=30))
def create_ride(request: HttpRequest, flow: Flow) -> HttpResponse:
    try:
        points = parse_points(request.body)
    except ValueError as exc:
        return JsonResponse({"error": str(exc)}, status=400)  # stored: no phase ran

    ride = flow.phase(
        "ride_created",
        lambda: Ride.objects.create(
            customer=request.user if request.user.is_authenticated else None,
            price_cents=RIDE_PRICE_CENTS,
            **points,
        ),
        compensate=cancel_ride,
    )
    charge = flow.call(
        "charge_created",
        lambda key: psp.charge(ride.price_cents, customer_of(request), idempotency_key=key),
        compensate=refund_charge,
    )
    if "declined" in charge:
        return JsonResponse({"ride": ride.pk, "declined": charge["declined"]}, status=402)
    receipt = flow.phase("finished", lambda: finish(ride, charge))
    return JsonResponse(
        {"ride": ride.pk, "charge": charge["id"], "receipt": receipt.pk}, status=201
    )


# --8<-- [end:rides]
