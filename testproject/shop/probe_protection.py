"""A view for the data-protection tests: it answers with the request's ``secret`` in its body
and in two replayed headers, so a test can look for that text in every stored column."""

from __future__ import annotations

import json

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from django_idempotency import idempotent
from testproject.shop.probe_views import record_effect


@csrf_exempt
@idempotent
def secret_echo(request: HttpRequest) -> HttpResponse:
    """One effect; the body's ``secret`` in the answer's body, ``Location`` and
    ``Content-Disposition``; ``pad`` more bytes of padding (``bench/`` uses 1 kB bodies)."""
    data = json.loads(request.body or b"{}")
    secret = str(data.get("secret", ""))
    effect = record_effect(request, "secret")
    body = {"effect": effect.pk, "echo": secret, "padding": "x" * int(data.get("pad", 0))}
    response = JsonResponse(body, status=201)
    response["Location"] = f"/probe/secrets/{secret}"
    response["Content-Disposition"] = f'attachment; filename="{secret}.json"'
    return response
