"""Hypothesis: any URL argument and any body go through a phased view's stored request.

The first phase stores what the completer needs to send the request again (docs/flows.md, "The
completer"). Whatever the URL arguments (text with NULs, lone surrogates, line separators, any
plane) and whatever the body (any bytes, any JSON), the run must store them, the completer must
get them back byte for byte, and the view must never answer 500. Run on PostgreSQL (``jsonb``
refuses a raw ``\\u0000``) and on MariaDB; SQLite stores any text.
"""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

import pytest
from django.contrib.auth.models import AnonymousUser
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import RequestFactory
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from django_idempotency import idempotent
from django_idempotency.flows.completer import complete_one, rebuild_request
from django_idempotency.flows.phases import Flow, stored_view_args
from django_idempotency.models import FlowRun
from testproject.shop.models import Effect
from testproject.shop.probe_flows import ProbeError

pytestmark = [pytest.mark.postgres, pytest.mark.mysql, pytest.mark.django_db(transaction=True)]

SEEN: dict[str, tuple[dict[str, Any], bytes]] = {}
"""What the view saw on its last run, by idempotency key."""


@idempotent(phases=True, lease=30)
def stored(request: HttpRequest, flow: Flow, **kwargs: Any) -> HttpResponse:
    key = request.headers["Idempotency-Key"]
    SEEN[key] = (kwargs, request.body)
    flow.phase("kept", lambda: Effect.objects.create(name="stored-request", payload=key).pk)
    if request.headers.get("X-Stop"):
        raise ProbeError("stopped after the first phase")
    return JsonResponse({"ok": True}, status=201)


any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
"""Any code point, lone surrogates and NUL included."""
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | any_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4),
    max_leaves=10,
)
bodies = st.one_of(
    st.binary(max_size=300).map(lambda raw: (raw, "application/octet-stream")),
    json_values.map(
        lambda value: (json.dumps(value).encode("utf-8"), "application/json; charset=utf-8")
    ),
    any_text.map(
        lambda text: (text.encode("utf-8", "surrogatepass"), "text/plain; charset=utf-8")
    ),
)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    kwargs=st.dictionaries(st.from_regex(r"[a-z]{1,8}", fullmatch=True), any_text, max_size=3),
    body=bodies,
)
def test_any_url_argument_and_body_is_stored_and_given_back_exactly(
    kwargs: dict[str, str], body: tuple[bytes, str]
) -> None:
    raw, content_type = body
    key = str(uuid.uuid4())
    request = RequestFactory().post(
        "/stored", data=raw, content_type=content_type, headers={"X-Stop": "1"}
    )
    request.META["HTTP_IDEMPOTENCY_KEY"] = key
    request.user = AnonymousUser()
    with pytest.raises(ProbeError):  # the view's own error, after its phase: never a 500
        stored(request, **kwargs)
    run = FlowRun.objects.select_related("record").get(record__key=key)
    assert stored_view_args(run.request) == ([], kwargs)
    assert base64.b64decode(run.request["body"]) == raw
    rebuilt = rebuild_request(run, run.record)
    assert rebuilt.body == raw
    assert rebuilt.META.get("CONTENT_TYPE") == request.META.get("CONTENT_TYPE")

    SEEN.pop(key)
    run.record.locked_until = run.record.created_at  # as if the lease had run out
    run.record.save(update_fields=["locked_until"])
    done = complete_one(run)
    assert (done.outcome, done.status) == ("completed", 201), done
    assert SEEN.pop(key) == (kwargs, raw)
