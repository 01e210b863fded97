"""Views that exist for the test suite: each execution writes one ``Effect`` row to count.

The query parameter ``status`` makes a view answer with that HTTP status instead of 201.
Request headers that are not part of the request fingerprint, so that a retry can differ:

* ``X-Probe-Sleep``: seconds to sleep after writing the effect (at most 30), to hold the
  transaction open.
* ``X-Probe-Late-Effect: 1``: write the effect after the sleep instead of before it.

With the environment variable ``PROBE_PID_DIR`` set (the gunicorn tests set it), a view writes
its process id to ``<PROBE_PID_DIR>/<key>.pid`` before sleeping, so that a test can SIGKILL or
SIGSTOP the worker while it holds the transaction.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.db import IntegrityError, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.utils.decorators import method_decorator
from django.views import View
from django.views.decorators.csrf import csrf_exempt
from rest_framework import viewsets
from rest_framework.permissions import BasePermission, IsAdminUser, IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency import idempotent
from django_idempotency.http.drf import IdempotentMixin
from testproject.shop.models import Effect

MAX_SLEEP = 30.0


def record_effect(request: HttpRequest | Request, name: str) -> Effect:
    """Write the effect row; honour ``X-Probe-Sleep``, ``X-Probe-Late-Effect``, the pid file."""
    key = request.headers.get("Idempotency-Key", "")
    late = request.headers.get("X-Probe-Late-Effect") == "1"
    effect = None if late else Effect.objects.create(name=name, payload=key[:255])
    pid_dir = os.environ.get("PROBE_PID_DIR")
    if pid_dir and key:
        safe = re.sub(r"[^A-Za-z0-9_-]", "_", key)
        Path(pid_dir, f"{safe}.pid").write_text(str(os.getpid()))
    time.sleep(min(float(request.headers.get("X-Probe-Sleep", 0) or 0), MAX_SLEEP))
    return effect or Effect.objects.create(name=name, payload=key[:255])


def effect_payload(request: HttpRequest | Request, effect: Effect) -> dict[str, Any]:
    return {
        "effect": effect.pk,
        "nonce": uuid.uuid4().hex,
        "pid": os.getpid(),
        "user": str(request.user.pk) if getattr(request.user, "is_authenticated", False) else "",
    }


def effect_response(request: HttpRequest, effect: Effect) -> HttpResponse:
    status = int(request.GET.get("status", 201))
    response = JsonResponse(effect_payload(request, effect), status=status)
    response["Location"] = f"/probe/effects/{effect.pk}"
    response["X-Probe"] = "probe"
    response["Cache-Control"] = "no-store"
    response.set_cookie("probe_session", "secret-cookie")
    if request.GET.get("raw_cookie"):  # a raw header, which set_cookie() never produces
        response["Set-Cookie"] = "raw_session=secret-raw-cookie; HttpOnly"
    if request.GET.get("gzip"):  # representation headers a replay must keep
        response["Content-Encoding"] = "gzip"
        response["Content-Language"] = "de"
        response["Content-Disposition"] = 'attachment; filename="order.json"'
    return response


@csrf_exempt
@idempotent
def effect(request: HttpRequest) -> HttpResponse:
    """The all-purpose probe: one effect, then the status asked for."""
    return effect_response(request, record_effect(request, "effect"))


@idempotent(required=True)
def form(request: HttpRequest) -> HttpResponse:
    """CSRF-protected (not exempt), as a form view is: CSRF reads ``request.POST`` first."""
    effect = record_effect(request, "form")
    files = {name: upload.read().decode() for name, upload in request.FILES.items()}
    return JsonResponse({**effect_payload(request, effect), "files": files}, status=201)


@csrf_exempt
@idempotent(required=True)
def required(request: HttpRequest) -> HttpResponse:
    return effect_response(request, record_effect(request, "required"))


@csrf_exempt
@idempotent(methods=["PUT", "DELETE"], ttl=timedelta(minutes=5))
def put_only(request: HttpRequest) -> HttpResponse:
    return effect_response(request, record_effect(request, "put"))


class ProbeError(RuntimeError):
    pass


@csrf_exempt
@idempotent
def raising(request: HttpRequest) -> HttpResponse:
    record_effect(request, "raising")
    raise ProbeError("the probe view raised on purpose")


@csrf_exempt
@idempotent
def big(request: HttpRequest) -> HttpResponse:
    record_effect(request, "big")
    return HttpResponse(b"x" * int(request.GET.get("size", 0)), content_type="text/plain")


@csrf_exempt
@idempotent
def streaming(request: HttpRequest) -> StreamingHttpResponse:
    record_effect(request, "streaming")

    def chunks() -> Iterator[bytes]:
        yield b"streamed "
        yield b"body"

    return StreamingHttpResponse(chunks(), content_type="text/plain", status=201)


@csrf_exempt
@idempotent
def nested_atomic(request: HttpRequest) -> HttpResponse:
    """Opens its own atomic blocks, one of which fails and is caught."""
    with transaction.atomic():
        first = record_effect(request, "nested-outer")
        try:
            with transaction.atomic():
                Effect.objects.create(name="nested-doomed")
                raise IntegrityError("a caught failure inside the view")
        except IntegrityError:
            pass
        with transaction.atomic():
            Effect.objects.create(name="nested-inner")
    return effect_response(request, first)


@method_decorator(csrf_exempt, name="dispatch")
@method_decorator(idempotent(required=True), name="post")
class ClassBased(View):
    def post(self, request: HttpRequest) -> HttpResponse:
        return effect_response(request, record_effect(request, "cbv"))


class DrfApiView(APIView):
    @idempotent(required=True)
    def post(self, request: Request) -> Response:
        effect = record_effect(request, "drf-apiview")
        payload = {**effect_payload(request, effect), "echo": request.data}
        return Response(payload, status=201, headers={"Location": f"/probe/effects/{effect.pk}"})


class ReadsData(BasePermission):
    """A permission that looks at the body: DRF's parser consumes the request stream."""

    def has_permission(self, request: Request, view: Any) -> bool:
        return request.data.get("allowed", "yes") != "no"


class DrfDataPermission(APIView):
    permission_classes = [ReadsData]

    @idempotent(required=True, methods=["POST", "PATCH"])
    def post(self, request: Request) -> Response:
        effect = record_effect(request, "drf-data-permission")
        return Response({**effect_payload(request, effect), "echo": request.data}, status=201)

    patch = post


@method_decorator(idempotent(required=True), name="post")
class DrfMethodDecorated(APIView):
    """``method_decorator`` on an APIView: the decorator finds the view through DRF."""

    def post(self, request: Request) -> Response:
        effect = record_effect(request, "drf-method-decorator")
        return Response(effect_payload(request, effect), status=201)


class DrfViewSet(viewsets.ViewSet):
    @idempotent
    def create(self, request: Request) -> Response:
        effect = record_effect(request, "drf-viewset")
        return Response({**effect_payload(request, effect), "echo": request.data}, status=201)


@csrf_exempt
@idempotent
async def async_effect(request: HttpRequest) -> HttpResponse:
    effect = await Effect.objects.acreate(
        name="async", payload=request.headers.get("Idempotency-Key", "")[:255]
    )
    status = int(request.GET.get("status", 201))
    if request.GET.get("raise"):
        raise ProbeError("the async probe view raised on purpose")
    return JsonResponse({"effect": effect.pk, "nonce": uuid.uuid4().hex}, status=status)


@csrf_exempt
@idempotent(atomic=False)
def lease(request: HttpRequest) -> HttpResponse:
    """Lease mode with ``IDEMPOTENCY["LEASE"]``; ``raise=1`` raises after the effect."""
    effect = record_effect(request, "lease")
    if request.GET.get("raise"):
        raise ProbeError("the lease probe view raised on purpose")
    return effect_response(request, effect)


@csrf_exempt
@idempotent(atomic=False, lease=timedelta(seconds=3))
def lease_short(request: HttpRequest) -> HttpResponse:
    """Lease mode with a three-second lease, for the gunicorn crash test."""
    return effect_response(request, record_effect(request, "lease-short"))


@csrf_exempt
def undecorated(request: HttpRequest) -> HttpResponse:
    """For the middleware (and the bare-view comparison): no decorator."""
    return effect_response(request, record_effect(request, "undecorated"))


@csrf_exempt
def undecorated_raising(request: HttpRequest) -> HttpResponse:
    record_effect(request, "undecorated-raising")
    raise ProbeError("the undecorated probe view raised on purpose")


@csrf_exempt
async def undecorated_async(request: HttpRequest) -> HttpResponse:
    effect = await Effect.objects.acreate(
        name="undecorated-async", payload=request.headers.get("Idempotency-Key", "")[:255]
    )
    if request.GET.get("raise"):
        raise ProbeError("the undecorated async probe view raised on purpose")
    return JsonResponse({"effect": effect.pk, "nonce": uuid.uuid4().hex}, status=201)


# -- DRF and class-based views under the middleware (paths under /probe/mw/) -------------------


class DrfPlain(APIView):
    """A DRF view without the mixin: the middleware runs its authenticators for the owner."""

    permission_classes = [IsAuthenticated]

    def post(self, request: Request) -> Response:
        effect = record_effect(request, "drf-plain")
        return Response(effect_payload(request, effect), status=201)


class DrfSafe(IdempotentMixin, APIView):
    """The recommended set-up: the stored response only after authentication and permissions."""

    idempotency_required = True
    permission_classes = [IsAdminUser]

    def post(self, request: Request) -> Response:
        effect = record_effect(request, "drf-safe")
        return Response(effect_payload(request, effect), status=201)


class DrfAtomicMixin(IdempotentMixin, APIView):
    """Atomic mode through the mixin, open to anyone."""

    permission_classes: list[type] = []

    def post(self, request: Request) -> Response:
        effect = record_effect(request, "drf-atomic-mixin")
        return Response(effect_payload(request, effect), status=201)


@method_decorator(csrf_exempt, name="dispatch")
@method_decorator(idempotent, name="dispatch")
class ClassDispatch(View):
    """A class-based view whose ``dispatch`` is decorated: ``as_view()`` copies what the
    decorator marks on it (non-atomic requests) to the view function."""

    def post(self, request: HttpRequest) -> HttpResponse:
        return effect_response(request, record_effect(request, "cbv-dispatch"))


class DrfLease(IdempotentMixin, APIView):
    """Lease mode through the mixin: non-atomic under ATOMIC_REQUESTS by itself."""

    idempotency_atomic = False
    idempotency_lease = timedelta(seconds=30)
    idempotency_ttl = timedelta(hours=48)
    permission_classes: list[type] = []

    def post(self, request: Request) -> Response:
        effect = record_effect(request, "drf-lease")
        return Response(effect_payload(request, effect), status=201)


@method_decorator(csrf_exempt, name="dispatch")
@method_decorator(
    idempotent(atomic=False, lease=timedelta(seconds=30), ttl=timedelta(hours=48)), name="post"
)
class ClassLease(View):
    """Options on a handler method: the middleware must leave them to the decorator."""

    def post(self, request: HttpRequest) -> HttpResponse:
        return effect_response(request, record_effect(request, "cbv-lease"))


class DrfViewSetLease(viewsets.ViewSet):
    permission_classes: list[type] = []

    @idempotent(atomic=False, lease=timedelta(seconds=30), ttl=timedelta(hours=48))
    def create(self, request: Request) -> Response:
        effect = record_effect(request, "drf-viewset-lease")
        return Response(effect_payload(request, effect), status=201)
