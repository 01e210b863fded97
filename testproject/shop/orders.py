"""The demo's order logic: the protected way, and a naive copy to compare it with.

:func:`place_order` is what ``POST /api/orders/`` runs under ``@idempotent(required=True)``. It
has the second line of defence that money needs, a business unique constraint:
``Payment`` is unique on (provider, external payment id). If the same payment arrives under
another idempotency key (a client that lost its key, two clients racing), the insert conflicts and
the existing order is returned instead of a second one. Its ``OrderConfirmed`` event goes through
the transactional outbox (:mod:`django_idempotency.outbox.core`).

:func:`place_order_unprotected` is what ``POST /api/unsafe-orders/`` runs: no idempotency key, no
business key, a fresh event id every time. Each retry is a new order and a new ledger entry; the
``retry_storm`` command shows the difference. It cannot record a ``Payment`` (the table's unique
constraint would refuse the second), which is the point of that constraint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db import IntegrityError, transaction

from django_idempotency import new_event_id, outbox
from django_idempotency.models import OutboxEntry
from testproject.shop.models import LedgerEntry, Order, Payment
from testproject.shop.tasks import apply_order_confirmed


class InvalidOrder(ValueError):
    """The request body is not a valid order; ``errors`` maps each field to its problem."""

    def __init__(self, errors: dict[str, str]) -> None:
        super().__init__(", ".join(f"{name}: {problem}" for name, problem in errors.items()))
        self.errors = errors


@dataclass(frozen=True)
class OrderRequest:
    reference: str
    amount_cents: int
    provider: str
    external_payment_id: str

    @classmethod
    def parse(cls, data: Any) -> OrderRequest:
        """Validate a decoded JSON body; raise :class:`InvalidOrder` listing every problem."""
        if not isinstance(data, dict):
            raise InvalidOrder({"body": "must be a JSON object"})
        errors: dict[str, str] = {}
        strings = {"reference": 100, "provider": 50, "external_payment_id": 100}
        for name, limit in strings.items():
            value = data.get(name)
            if not isinstance(value, str) or not value.strip():
                errors[name] = "a non-empty string is required"
            elif len(value) > limit:
                errors[name] = f"at most {limit} characters"
        amount = data.get("amount_cents")
        if isinstance(amount, bool) or not isinstance(amount, int) or amount <= 0:
            errors["amount_cents"] = "a positive integer is required"
        if errors:
            raise InvalidOrder(errors)
        return cls(
            reference=data["reference"].strip(),
            amount_cents=amount,
            provider=data["provider"].strip(),
            external_payment_id=data["external_payment_id"].strip(),
        )


@dataclass(frozen=True)
class Placed:
    order: Order
    payment: Payment | None
    event_id: str | None
    created: bool
    """False when the payment already existed and its order is returned."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "order": {
                "id": self.order.pk,
                "reference": self.order.reference,
                "amount_cents": self.order.amount_cents,
                "currency": self.order.currency,
            },
            "payment": None
            if self.payment is None
            else {
                "provider": self.payment.provider,
                "external_payment_id": self.payment.external_payment_id,
            },
            "event_id": self.event_id,
            "created": self.created,
        }


def order_key(order_id: int) -> str:
    """The ordering key of an order's events: they reach consumers in the order written."""
    return f"order-{order_id}"


def _existing(request: OrderRequest) -> Placed | None:
    payment = (
        Payment.objects.select_related("order")
        .filter(provider=request.provider, external_payment_id=request.external_payment_id)
        .first()
    )
    if payment is None:
        return None
    # The order's OrderConfirmed event id, as written to the outbox with the order.
    event = OutboxEntry.objects.filter(ordering_key=order_key(payment.order.pk)).values_list(
        "event_id", flat=True
    )
    return Placed(payment.order, payment, event.order_by("pk").first(), created=False)


def place_order(request: OrderRequest, customer: Any = None) -> Placed:
    """Create the order and its payment once per (provider, external payment id).

    Runs inside the caller's transaction (the ``@idempotent`` one). The ``OrderConfirmed``
    event, stamped with a UUIDv7, is written to the outbox in that transaction, with the order as
    its ordering key: it exists if and only if the order does, and the relay
    (``manage.py idempotency_relay``) hands it to Celery once the transaction has committed, even
    if this process dies right after the COMMIT.
    """
    existing = _existing(request)
    if existing is not None:
        return existing
    try:
        with transaction.atomic():  # a savepoint: a conflict must not break the outer block
            order = Order.objects.create(
                customer=customer,
                reference=request.reference,
                amount_cents=request.amount_cents,
            )
            payment = Payment.objects.create(
                order=order,
                provider=request.provider,
                external_payment_id=request.external_payment_id,
                amount_cents=request.amount_cents,
            )
    except IntegrityError:
        # Another transaction recorded this payment first and has committed: return its order.
        existing = _existing(request)
        if existing is None:
            raise
        return existing
    # --8<-- [start:outbox]
    event_id = str(new_event_id())
    outbox.publish(
        apply_order_confirmed,
        args=[{"event_id": event_id, "order_id": order.pk, "amount_cents": order.amount_cents}],
        key=order_key(order.pk),
    )
    # --8<-- [end:outbox]
    return Placed(order, payment, event_id, created=True)


def place_order_unprotected(request: OrderRequest, customer: Any = None) -> Placed:
    """The naive version: every call creates an order and applies a brand-new event."""
    with transaction.atomic():
        order = Order.objects.create(
            customer=customer, reference=request.reference, amount_cents=request.amount_cents
        )
        event = {
            "event_id": str(new_event_id()),
            "order_id": order.pk,
            "amount_cents": order.amount_cents,
        }
        transaction.on_commit(lambda: apply_unprotected(event))
    return Placed(order, None, event["event_id"], created=True)


def apply_unprotected(event: dict[str, Any]) -> LedgerEntry:
    """A consumer without idempotency: every delivery of the event writes a ledger entry."""
    return LedgerEntry.objects.create(
        order_id=int(event["order_id"]),
        event_id=str(event["event_id"]),
        amount_cents=int(event["amount_cents"]),
    )
