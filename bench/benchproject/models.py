"""One row per execution of a benchmark view or consumer body: the effect being protected."""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class Effect(models.Model):
    name = models.CharField(max_length=50)
    payload = models.CharField(max_length=255, blank=True, default="")
    amount_cents = models.IntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [models.Index(fields=["name", "payload"], name="bench_effect_name_payload")]

    def __str__(self) -> str:
        return f"{self.name} {self.payload}"
