"""Helpers for the HTTP tests: post to the probe views and count their effects."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from django.contrib.auth.models import AnonymousUser
from django.db import connections
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.http.response import HttpResponseBase
from django.test import Client, RequestFactory

from django_idempotency import idempotent
from testproject.shop.models import Effect

PROBLEM = "application/problem+json"


def post(
    client: Client,
    url: str,
    key: str | None = None,
    data: Any = None,
    *,
    method: str = "post",
    headers: dict[str, str] | None = None,
    raw: bytes | None = None,
    content_type: str = "application/json",
) -> HttpResponseBase:
    """Send ``data`` as JSON (or ``raw`` bytes) with an ``Idempotency-Key`` header."""
    all_headers = dict(headers or {})
    if key is not None:
        all_headers["Idempotency-Key"] = key
    body = raw if raw is not None else json.dumps({} if data is None else data)
    response: HttpResponseBase = getattr(client, method)(
        url, data=body, content_type=content_type, headers=all_headers
    )
    return response


def effects(name: str | None = None, key: str | None = None) -> int:
    queryset = Effect.objects.all()
    if name is not None:
        queryset = queryset.filter(name=name)
    if key is not None:
        queryset = queryset.filter(payload=key)
    return queryset.count()


def problem(response: HttpResponseBase, status: int) -> dict[str, Any]:
    """Assert ``response`` is an RFC 9457 problem with ``status``; return its body."""
    assert response.status_code == status, (
        response.status_code,
        getattr(response, "content", b""),
    )
    assert response["Content-Type"] == PROBLEM
    body: dict[str, Any] = json.loads(response.content)  # type: ignore[attr-defined]
    assert body["status"] == status
    assert body["type"].startswith("https://")
    assert body["title"] and body["detail"]
    return body


def body(response: HttpResponseBase) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(response.content)  # type: ignore[attr-defined]
    return result


def in_thread(target: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``target`` in a started thread with its own database connection.

    Returns the thread and a dict that gets ``result`` or ``error`` (the exception the target
    raised, for the test thread to assert on) once it ends.
    """
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = target()
        except Exception as exc:  # noqa: BLE001 - handed to the test thread, which asserts on it
            outcome["error"] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def counted_view(name: str) -> tuple[Callable[[str], HttpResponse], Counter[str]]:
    """``(send, ran)``: ``send(key)`` posts ``{}`` to ``/NAME`` with the Idempotency-Key ``key``,
    straight to an ``@idempotent`` view, which creates an Effect ``name`` (payload: the key) and
    answers 201 with the key and the effect's id; ``ran[key]`` counts the times the view ran
    for ``key``, committed or not."""
    ran: Counter[str] = Counter()

    @idempotent
    def create(request: HttpRequest) -> HttpResponse:
        key = request.headers["Idempotency-Key"]
        ran[key] += 1
        effect = Effect.objects.create(name=name, payload=key)
        return JsonResponse({"key": key, "effect": effect.pk}, status=201)

    def send(key: str) -> HttpResponse:
        request = RequestFactory().post(f"/{name}", data=b"{}", content_type="application/json")
        request.META["HTTP_IDEMPOTENCY_KEY"] = key
        request.user = AnonymousUser()
        response: HttpResponse = create(request)
        return response

    return send, ran
