"""One endpoint body for every variant: parse the JSON body, insert one Effect, answer 201.

``race_*`` views sleep first (``RACE_SLEEP`` seconds) so that concurrent duplicates overlap.
Library imports happen inside the functions that need them, so the app variant runs without any
competitor installed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse

from bench.benchproject.models import Effect

RACE_SLEEP = 0.2
View = Callable[..., HttpResponse]


def perform(name: str, key: str, data: dict[str, Any], *, sleep: float = 0.0) -> dict[str, Any]:
    """The protected effect: one INSERT. Returns the JSON answer."""
    if sleep:
        time.sleep(sleep)
    effect = Effect.objects.create(
        name=name, payload=key, amount_cents=int(data.get("amount_cents", 0))
    )
    return {"id": effect.pk, "name": name, "amount_cents": effect.amount_cents}


def plain_view(name: str, *, sleep: float = 0.0) -> View:
    """A plain Django function view."""

    def view(request: HttpRequest) -> HttpResponse:
        if request.method != "POST":
            return HttpResponse(status=405)
        data = json.loads(request.body or b"{}")
        key = request.headers.get("Idempotency-Key", "")
        return JsonResponse(perform(name, key, data, sleep=sleep), status=201)

    view.__name__ = f"{name.replace('-', '_')}_view"
    return view


RESPONSE_1K = 1024
"""The response body of :func:`plain_view_1k`, in bytes: the encryption overhead's row."""


def plain_view_1k(name: str) -> View:
    """:func:`plain_view` answering a JSON body of exactly 1 kB (the effect and padding)."""

    def view(request: HttpRequest) -> HttpResponse:
        if request.method != "POST":
            return HttpResponse(status=405)
        data = json.loads(request.body or b"{}")
        key = request.headers.get("Idempotency-Key", "")
        answer: dict[str, Any] = {**perform(name, key, data), "note": ""}
        answer["note"] = "x" * (RESPONSE_1K - len(json.dumps(answer)))
        return JsonResponse(answer, status=201)

    view.__name__ = f"{name.replace('-', '_')}_1k_view"
    return view


def drf_view(name: str, *, sleep: float = 0.0, mixins: tuple[type, ...] = ()) -> View:
    """The same body as a DRF ``APIView`` (drf-idempotencykey only works on one)."""
    from rest_framework.request import Request
    from rest_framework.response import Response
    from rest_framework.views import APIView

    def post(self: APIView, request: Request) -> Response:
        key = request.headers.get("Idempotency-Key", "")
        return Response(perform(name, key, dict(request.data), sleep=sleep), status=201)

    cls = type(f"{name.title().replace('-', '')}View", (*mixins, APIView), {"post": post})
    return cls.as_view()


def health(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok", content_type="text/plain")


def app_views() -> dict[str, View]:
    from django.db import transaction

    from django_idempotency import idempotent

    return {
        "bare": plain_view("bare"),
        "bare-atomic": transaction.atomic(plain_view("bare-atomic")),
        "bare-drf": drf_view("bare-drf"),
        "app": idempotent(plain_view("app")),
        "race/bare": plain_view("bare", sleep=RACE_SLEEP),
        "race/app": idempotent(plain_view("app", sleep=RACE_SLEEP)),
    }


def dik_views() -> dict[str, View]:
    from idempotency_key.decorators import idempotency_key

    return {
        "dik": idempotency_key(plain_view("dik")),
        "race/dik": idempotency_key(plain_view("dik", sleep=RACE_SLEEP)),
    }


def drfi_views() -> dict[str, View]:
    # The project-wide middleware (settings) protects these plain views.
    return {"drfi": plain_view("drfi"), "race/drfi": plain_view("drfi", sleep=RACE_SLEEP)}


def drfik_views() -> dict[str, View]:
    from drf_idempotencykey.mixins import DrfIdempotencyKeyMixin

    return {
        "drfik": drf_view("drfik", mixins=(DrfIdempotencyKeyMixin,)),
        "race/drfik": drf_view("drfik", sleep=RACE_SLEEP, mixins=(DrfIdempotencyKeyMixin,)),
    }


def drfir_views() -> dict[str, View]:
    return {"drfir": plain_view("drfir"), "race/drfir": plain_view("drfir", sleep=RACE_SLEEP)}


VIEWS_BY_VARIANT: dict[str, Callable[[], dict[str, View]]] = {
    "app": app_views,
    "dik": dik_views,
    "drfi": drfi_views,
    "drfir": drfir_views,
    "drfik": drfik_views,
}
