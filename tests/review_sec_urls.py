"""URLs of tests/test_review_sec_atomic.py: views that write, then refuse or raise."""

from __future__ import annotations

from django.urls import path
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency.http.drf import IdempotentMixin
from testproject.shop.probe_views import record_effect


class WritesThenInvalid(IdempotentMixin, APIView):
    permission_classes: list[type] = []

    def post(self, request: Request) -> Response:
        record_effect(request, "writes-then-invalid")
        raise ValidationError({"detail": "invalid after a write"})


urlpatterns = [path("invalid/", WritesThenInvalid.as_view())]
