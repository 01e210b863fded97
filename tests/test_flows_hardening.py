"""Phased views at their edges (issue 25): names that collide, errors that repeat, multipart
bodies, URL arguments no JSON column stores, and a stale holder's pause."""

from __future__ import annotations

import base64
import gc
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import AnonymousUser
from django.core.exceptions import ImproperlyConfigured
from django.core.files.uploadedfile import SimpleUploadedFile
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import RequestFactory
from django.utils import timezone

from django_idempotency import idempotent
from django_idempotency.flows.completer import complete_abandoned, rebuild_request
from django_idempotency.flows.phases import Flow, FlowFailed, get_flow_view, stored_view_args
from django_idempotency.models import FlowRun, IdempotencyRecord
from testproject.shop.models import Effect
from testproject.shop.probe_flows import ProbeError
from tests.probes import effects, in_thread

pytestmark = [pytest.mark.django_db(transaction=True)]

SEEN: list[dict[str, Any]] = []
"""What the views below saw, run by run (the test's request or the completer's)."""


def keyed(request: HttpRequest, key: str) -> HttpRequest:
    request.META["HTTP_IDEMPOTENCY_KEY"] = key
    request.user = AnonymousUser()
    return request


def json_post(key: str, path: str = "/flow", body: bytes = b"{}") -> HttpRequest:
    return keyed(RequestFactory().post(path, data=body, content_type="application/json"), key)


def run_of(key: str) -> FlowRun:
    return FlowRun.objects.get(record__key=key)


@pytest.fixture(autouse=True)
def _seen() -> Any:
    SEEN.clear()
    yield
    SEEN.clear()


# --- 8. two views of one name -------------------------------------------------------------------


def charge_view(amount: int, name: str | None = None) -> Callable[..., Any]:
    """A factory of phased views, as a project would write one per price."""

    @idempotent(phases=True, lease=30, name=name)
    def view(request: HttpRequest, flow: Flow) -> HttpResponse:
        key = request.headers["Idempotency-Key"]
        flow.phase("reserve", lambda: Effect.objects.create(name="reserve", payload=key).pk)
        if request.headers.get("X-Stop"):
            raise ProbeError("stopped after reserve")
        flow.phase(
            "charge", lambda: Effect.objects.create(name=f"charge-{amount}", payload=key).pk
        )
        return JsonResponse({"charged": amount}, status=201)

    return view


CHARGE_500 = charge_view(500, name="charge_500")
CHARGE_900 = charge_view(900, name="charge_900")


def test_a_second_view_of_the_same_name_is_refused_with_a_way_out() -> None:
    first = charge_view(500)
    with pytest.raises(ImproperlyConfigured) as refused:
        charge_view(900)
    message = str(refused.value)
    assert "charge_view.<locals>.view" in message
    assert "@idempotent(phases=True, name='charge_500')" in message
    assert get_flow_view(f"{__name__}:charge_view.<locals>.view").func is first.__wrapped__  # type: ignore[attr-defined]


def test_a_dropped_view_frees_its_name() -> None:
    first = charge_view(500)
    del first
    gc.collect()
    second = charge_view(900)  # the first can never run again: nothing holds it
    assert get_flow_view(f"{__name__}:charge_view.<locals>.view").func is second.__wrapped__  # type: ignore[attr-defined]


def test_a_name_must_be_usable() -> None:
    for bad in ("", " ", "a:b", 7):
        with pytest.raises(ImproperlyConfigured, match="name"):
            charge_view(1, name=bad)  # type: ignore[arg-type]
    with pytest.raises(ImproperlyConfigured, match="phases=True"):
        idempotent(name="x")


def test_named_views_of_one_factory_are_each_completed_by_their_own_code() -> None:
    keys = {500: str(uuid.uuid4()), 900: str(uuid.uuid4())}
    for amount, view in ((500, CHARGE_500), (900, CHARGE_900)):
        request = json_post(keys[amount])
        request.META["HTTP_X_STOP"] = "1"
        with pytest.raises(ProbeError):
            view(request)
    assert {run_of(keys[500]).flow, run_of(keys[900]).flow} == {
        f"{__name__}:charge_500",
        f"{__name__}:charge_900",
    }
    outcomes = {done.key: done.outcome for done in complete_abandoned()}
    assert outcomes == {keys[500]: "completed", keys[900]: "completed"}
    assert effects("charge-500", keys[500]) == effects("charge-900", keys[900]) == 1
    assert effects("charge-900", keys[500]) == effects("charge-500", keys[900]) == 0


# --- 9. a view that keeps answering an error -----------------------------------------------------


@idempotent(phases=True, lease=30)
def always_unavailable(request: HttpRequest, flow: Flow) -> HttpResponse:
    key = request.headers["Idempotency-Key"]
    flow.phase(
        "booked",
        lambda: Effect.objects.create(name="booked", payload=key).pk,
        compensate=lambda result, _key: Effect.objects.create(name="unbooked", payload=key),
    )
    return HttpResponse(status=int(request.GET.get("status", "503")))


@pytest.mark.parametrize("status", [503, 500, 401, 403, 409, 429])
def test_a_flow_that_keeps_answering_an_error_ends_within_max_attempts(status: int) -> None:
    key = str(uuid.uuid4())
    request = keyed(RequestFactory().post(f"/unavailable?status={status}"), key)
    assert always_unavailable(request).status_code == status
    assert run_of(key).attempts == 1
    outcomes = []
    for _ in range(10):  # bounded: far more passes than max_attempts needs
        done = complete_abandoned(max_attempts=3)
        if not done:
            break
        outcomes.append(done[0].outcome)
    assert outcomes == ["paused", "paused", "failed"]
    run = run_of(key)
    assert (run.state, run.attempts) == (FlowRun.State.FAILED, 3)
    assert f"the view returned {status}" in run.last_error
    assert effects("unbooked", key) == 1
    record = IdempotencyRecord.objects.get(key=key)
    assert (record.state, record.response_status) == (
        IdempotencyRecord.State.COMPLETED,
        FlowFailed.status,
    )


# --- 10. multipart ------------------------------------------------------------------------------


@idempotent(phases=True, lease=30)
def upload_view(request: HttpRequest, flow: Flow) -> HttpResponse:
    key = request.headers["Idempotency-Key"]
    upload = request.FILES["doc"]
    seen = {
        "fields": {name: request.POST.getlist(name) for name in request.POST},
        "file": (upload.name, upload.read()),
    }
    SEEN.append(seen)
    flow.phase("stored", lambda: Effect.objects.create(name="upload", payload=key).pk)
    if request.headers.get("X-Stop"):
        raise ProbeError("stopped after stored")
    return JsonResponse({"size": len(seen["file"][1])}, status=201)


def multipart_post(key: str, **headers: str) -> HttpRequest:
    data = {
        "title": "Quarterly report",
        "tags": ["a", "b\u00e9"],
        "doc": SimpleUploadedFile("report.pdf", b"%PDF-\x00\xff binary", "application/pdf"),
    }
    request = RequestFactory().post("/upload?x=1", data=data, headers=headers)
    return keyed(request, key)


def test_a_multipart_post_to_a_phased_view_is_stored_and_completed() -> None:
    key = str(uuid.uuid4())
    assert upload_view(multipart_post(key)).status_code == 201
    second = str(uuid.uuid4())
    with pytest.raises(ProbeError):
        upload_view(multipart_post(second, X_Stop="1"))
    [done] = complete_abandoned()
    assert (done.key, done.outcome, done.status) == (second, "completed", 201)
    first_run, completer_run = SEEN[1], SEEN[2]
    assert completer_run == first_run
    assert first_run["fields"] == {"title": ["Quarterly report"], "tags": ["a", "b\u00e9"]}
    assert first_run["file"] == ("report.pdf", b"%PDF-\x00\xff binary")
    assert effects("upload", second) == 1


# --- 11. URL arguments no JSON column takes -----------------------------------------------------


@idempotent(phases=True, lease=30)
def named_view(request: HttpRequest, flow: Flow, name: str) -> HttpResponse:
    key = request.headers["Idempotency-Key"]
    SEEN.append({"name": name, "body": request.body})
    flow.phase("named", lambda: Effect.objects.create(name="named", payload=key).pk)
    if request.headers.get("X-Stop"):
        raise ProbeError("stopped after named")
    return JsonResponse({"ok": True}, status=201)


@pytest.mark.parametrize("name", ["a\x00b", "\ud800lone", "line\nbreak\u2028", "\U0001f600"])
def test_url_arguments_are_stored_exactly_and_given_back_to_the_completer(name: str) -> None:
    key = str(uuid.uuid4())
    request = json_post(key, body=b'{"n": 1}')
    request.META["HTTP_X_STOP"] = "1"
    with pytest.raises(ProbeError):
        named_view(request, name=name)
    run = run_of(key)
    assert stored_view_args(run.request) == ([], {"name": name})
    [done] = complete_abandoned()
    assert (done.outcome, done.status) == ("completed", 201)
    assert SEEN[-1] == {"name": name, "body": b'{"n": 1}'}


def test_a_run_stored_by_the_earlier_version_still_completes() -> None:
    key = str(uuid.uuid4())
    request = json_post(key)
    request.META["HTTP_X_STOP"] = "1"
    with pytest.raises(ProbeError):
        named_view(request, name="old")
    run = run_of(key)
    run.request = {**run.request, "view_args": [[], {"name": "old"}]}  # the list form
    run.save()
    assert rebuild_request(run, run.record).body == b"{}"
    [done] = complete_abandoned()
    assert done.outcome == "completed"
    assert SEEN[-1]["name"] == "old"


# --- A stale holder's pause ----------------------------------------------------------------------


def test_a_stale_holders_pause_leaves_the_new_holders_lease_alone() -> None:
    key = str(uuid.uuid4())
    new_lease = timezone.now() + timedelta(minutes=10)

    @idempotent(phases=True, lease=30)
    def view(request: HttpRequest, flow: Flow) -> HttpResponse:
        flow.phase("first", lambda: Effect.objects.create(name="first", payload=key).pk)

        def taken_over() -> int:  # another process took the record over: new token and lease
            return IdempotencyRecord.objects.filter(key=key).update(
                token=uuid.uuid4(), locked_until=new_lease
            )

        thread, outcome = in_thread(taken_over)
        thread.join(60)
        assert outcome.get("result") == 1, outcome
        raise ProbeError("the stale holder fails after the takeover")

    with pytest.raises(ProbeError):
        view(json_post(key))
    record = IdempotencyRecord.objects.get(key=key)
    assert record.locked_until == new_lease
    assert run_of(key).attempts == 0  # nor is the new holder's run counted against
    assert base64.b64decode(run_of(key).request["body"]) == b"{}"
