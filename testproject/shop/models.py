"""A small orders-and-payments domain that the demo and the tests protect."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone


class Order(models.Model):
    customer = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    reference = models.CharField(max_length=100)
    amount_cents = models.PositiveIntegerField()
    currency = models.CharField(max_length=3, default="EUR")
    created_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"Order {self.pk} {self.reference}"


class Payment(models.Model):
    """Money double protection: besides the idempotency key, a business unique constraint."""

    order = models.ForeignKey(Order, on_delete=models.CASCADE, related_name="payments")
    provider = models.CharField(max_length=50)
    external_payment_id = models.CharField(max_length=100)
    amount_cents = models.PositiveIntegerField()
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["provider", "external_payment_id"], name="shop_payment_provider_ext_uniq"
            )
        ]

    def __str__(self) -> str:
        return f"{self.provider}:{self.external_payment_id}"


class LedgerEntry(models.Model):
    """Written by the billing consumer once per OrderConfirmed event."""

    order = models.ForeignKey(Order, on_delete=models.CASCADE, related_name="ledger_entries")
    event_id = models.CharField(max_length=255)
    amount_cents = models.IntegerField()
    created_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"Ledger {self.order_id} {self.amount_cents}"


class Effect(models.Model):
    """One row per execution of a test view or task body: the tests count these."""

    name = models.CharField(max_length=100)
    payload = models.CharField(max_length=255, blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"{self.name} {self.payload}"


class Ride(models.Model):
    """The ride-sharing checkout of docs/flows.md (Stripe's Rocket Rides, ported)."""

    class Status(models.TextChoices):
        CREATED = "created"
        CHARGED = "charged"
        CANCELLED = "cancelled"

    customer = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    origin_lat = models.FloatField()
    origin_lon = models.FloatField()
    target_lat = models.FloatField()
    target_lon = models.FloatField()
    price_cents = models.PositiveIntegerField()
    charge_id = models.CharField(max_length=100, blank=True, default="")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.CREATED)
    created_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"Ride {self.pk} ({self.status})"


class Receipt(models.Model):
    """Written by the last phase of the ride checkout; one per ride."""

    ride = models.OneToOneField(Ride, on_delete=models.CASCADE, related_name="receipt")
    charge_id = models.CharField(max_length=100)
    amount_cents = models.PositiveIntegerField()
    created_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"Receipt for ride {self.ride_id}"


class ServiceAccount(models.Model):
    """A principal that is not ``AUTH_USER_MODEL``: an API client an authentication middleware
    sets as ``request.user``. It has no ``is_active``, as many such models do not."""

    name = models.CharField(max_length=100)

    is_authenticated = True
    is_anonymous = False

    def __str__(self) -> str:
        return self.name
