"""A small client for the payment provider (PSP) the ride checkout charges.

It speaks a Stripe-like JSON API: ``POST /v1/charges`` and ``POST /v1/refunds``, each with an
``Idempotency-Key`` header that the provider deduplicates on. The tests run a fake provider
(``tests/psp.py``) that records every key it sees.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from django.conf import settings

TIMEOUT = 10.0


class ProviderError(RuntimeError):
    """The provider could not be reached or answered with a server error: try again later."""


def charge(amount_cents: int, customer: str, *, idempotency_key: str) -> dict[str, Any]:
    """Charge ``amount_cents``; returns ``{"id", "amount", ...}``, or ``{"declined": reason}``."""
    return _post("/v1/charges", {"amount": amount_cents, "customer": customer}, idempotency_key)


def refund(charge_id: str, *, idempotency_key: str) -> dict[str, Any]:
    return _post("/v1/refunds", {"charge": charge_id}, idempotency_key)


def _post(path: str, payload: dict[str, Any], idempotency_key: str) -> dict[str, Any]:
    request = urllib.request.Request(
        settings.PSP_URL.rstrip("/") + path,
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json", "Idempotency-Key": idempotency_key},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            body: dict[str, Any] = json.loads(response.read())
            return body
    except urllib.error.HTTPError as exc:
        if exc.code == 402:
            return {"declined": json.loads(exc.read()).get("reason", "declined")}
        raise ProviderError(f"{path}: HTTP {exc.code}") from exc
    except OSError as exc:
        raise ProviderError(f"{path}: {exc}") from exc
