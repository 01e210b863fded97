"""Phased requests (``@idempotent(phases=True)``) on every backend, in one process.

Failures here are exceptions and leases expired by hand; ``tests/test_flows_crash.py`` kills
real gunicorn workers at every crash point.
"""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.db.transaction import TransactionManagementError
from django.test import Client, RequestFactory, override_settings
from django.utils import timezone

from django_idempotency import idempotent
from django_idempotency.flows.phases import Flow, FlowFailed, derive_key, record_key
from django_idempotency.models import FlowRun, IdempotencyRecord, ProcessedEvent
from testproject.shop.models import Effect
from testproject.shop.probe_flows import REMOTE_CALLS, ProbeError
from tests.probes import body, effects, post, problem

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("remote_calls")]

URL = "/probe/flow/"


def expire_lease(key: str) -> None:
    """As if the lease had run out: the record is abandoned."""
    IdempotencyRecord.objects.filter(key=key).update(
        locked_until=timezone.now() - timedelta(seconds=1)
    )


def test_a_first_run_commits_each_phase_and_stores_the_response(client: Client) -> None:
    key = str(uuid.uuid4())
    response = post(client, URL, key)
    assert response.status_code == 201
    data = body(response)
    assert data["resumed"] is False
    record = IdempotencyRecord.objects.get(key=key)
    assert data["two"] == {"id": f"ch_{record_key(record, 'two')[:8]}", "calls": 1}
    assert effects("flow-one", key) == effects("flow-three", key) == 1
    run = FlowRun.objects.get(record__key=key)
    assert run.state == FlowRun.State.COMPLETED
    assert run.recovery_point == "three"
    assert list(run.results) == ["one", "two", "three"]
    assert run.results["one"]["model"] == "shop.effect"
    assert run.request["method"] == "POST"

    replay = post(client, URL, key)
    assert replay["Idempotent-Replayed"] == "true"
    assert replay.content == response.content
    assert effects(key=key) == 2  # flow-one and flow-three; the call has its own key
    assert sum(REMOTE_CALLS.values()) == 1


def test_a_phased_view_works_under_atomic_requests(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each phase commits on its own, so the view is marked non-atomic as lease mode is."""
    from django.db import connection

    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", True)
    key = str(uuid.uuid4())
    assert post(client, URL, key).status_code == 201
    assert post(client, URL, key)["Idempotent-Replayed"] == "true"
    assert effects("flow-one", key) == effects("flow-three", key) == 1


@pytest.mark.parametrize("after", ["one", "two", "three"])
def test_a_retry_after_a_failure_resumes_at_the_first_phase_not_done(
    client: Client, after: str
) -> None:
    key = str(uuid.uuid4())
    with pytest.raises(ProbeError):
        post(client, URL, key, headers={"X-Flow-Raise": after})
    record = IdempotencyRecord.objects.get(key=key)
    assert record.state == IdempotencyRecord.State.IN_PROGRESS
    assert record.locked_until is not None and record.locked_until <= timezone.now()
    run = FlowRun.objects.get(record=record)
    assert run.recovery_point == after
    assert run.attempts == 1
    assert "ProbeError" in run.last_error

    response = post(client, URL, key)  # the lease was given up: resumes at once
    assert response.status_code == 201, response.content
    data = body(response)
    assert data["resumed"] is True
    assert data["two"]["calls"] == 1  # stored, never called again
    assert effects("flow-one", key) == effects("flow-three", key) == 1
    assert sum(REMOTE_CALLS.values()) == 1
    assert Effect.objects.get(name="flow-one", payload=key).pk == data["one"]


class _UnstorableError(ProbeError):
    """An error whose text holds a NUL and a lone surrogate (an undecodable file name)."""

    def __str__(self) -> str:
        return "in caf\udce9 \x00 here"


def test_an_error_text_no_database_stores_is_kept_escaped_and_the_flow_resumes(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A NUL (refused by PostgreSQL) or a lone surrogate (not UTF-8) in the view's error made
    the write that keeps the recovery point fail: the error was replaced by a database or
    encoding error, and the lease was not given up."""
    from testproject.shop import probe_flows

    monkeypatch.setattr(probe_flows, "ProbeError", _UnstorableError)
    key = str(uuid.uuid4())
    with pytest.raises(_UnstorableError):
        post(client, URL, key, headers={"X-Flow-Raise": "one"})
    run = FlowRun.objects.get(record__key=key)
    assert run.last_error == "_UnstorableError: in caf\\udce9 \\x00 here"
    assert (run.recovery_point, run.attempts) == ("one", 1)
    monkeypatch.undo()
    assert post(client, URL, key).status_code == 201  # the lease was given up: resumes at once


def test_a_model_result_comes_back_from_the_database_on_resume(client: Client) -> None:
    key = str(uuid.uuid4())
    with pytest.raises(ProbeError):
        post(client, URL, key, headers={"X-Flow-Raise": "one"})
    Effect.objects.filter(name="flow-one", payload=key).update(payload=key + "-edited")
    response = post(client, URL, key)
    assert response.status_code == 201
    effect = Effect.objects.get(pk=body(response)["one"])
    assert effect.payload == key + "-edited"  # fetched by reference, not a stale copy


def test_a_concurrent_retry_gets_409_while_the_lease_is_live(client: Client) -> None:
    key = str(uuid.uuid4())
    with pytest.raises(ProbeError):
        post(client, URL, key, headers={"X-Flow-Raise": "one"})
    IdempotencyRecord.objects.filter(key=key).update(
        locked_until=timezone.now() + timedelta(seconds=30)
    )
    problem(post(client, URL, key), 409)
    expire_lease(key)
    assert post(client, URL, key).status_code == 201


def test_a_holder_that_lost_its_claim_cannot_commit_a_phase(client: Client) -> None:
    key = str(uuid.uuid4())

    @idempotent(phases=True, lease=30)
    def view(request, flow: Flow):  # type: ignore[no-untyped-def]
        def steal() -> Effect:
            _take_over(key)  # another process took the claim over while this phase ran
            return Effect.objects.create(name="stolen-phase", payload=key)

        flow.phase("first", steal)
        raise AssertionError("the phase must not commit")

    request = RequestFactory().post(
        "/x", data=b"{}", content_type="application/json", HTTP_IDEMPOTENCY_KEY=key
    )
    request.user = _anonymous()
    response = view(request)
    assert problem(response, 409)["detail"].startswith("This request's lease ran out")
    assert effects("stolen-phase") == 0
    assert not FlowRun.objects.filter(record__key=key).exists()


def _take_over(key: str) -> None:
    """Another process takes the record over (new token), on its own connection."""
    from tests.probes import in_thread

    thread, outcome = in_thread(
        lambda: IdempotencyRecord.objects.filter(key=key).update(token=uuid.uuid4())
    )
    thread.join(60)
    assert outcome.get("result") == 1, outcome


def _anonymous():  # type: ignore[no-untyped-def]
    from django.contrib.auth.models import AnonymousUser

    return AnonymousUser()


def test_a_returned_server_error_keeps_the_recovery_point(client: Client) -> None:
    key = str(uuid.uuid4())
    response = post(client, URL, key, headers={"X-Flow-Status": "503"})
    assert response.status_code == 503
    record = IdempotencyRecord.objects.get(key=key)
    assert record.state == IdempotencyRecord.State.IN_PROGRESS
    assert FlowRun.objects.get(record=record).recovery_point == "three"
    assert post(client, URL, key).status_code == 201
    assert effects("flow-one", key) == effects("flow-three", key) == 1


def test_a_view_that_fails_before_any_phase_leaves_no_record(client: Client) -> None:
    @idempotent(phases=True)
    def view(request, flow: Flow):  # type: ignore[no-untyped-def]
        raise ProbeError("before any phase")

    key = str(uuid.uuid4())
    request = RequestFactory().post(
        "/x", data=b"{}", content_type="application/json", HTTP_IDEMPOTENCY_KEY=key
    )
    request.user = _anonymous()
    with pytest.raises(ProbeError):
        view(request)
    assert not IdempotencyRecord.objects.filter(key=key).exists()


def test_unresumable_call_interrupted_rolls_forward_to_failure(client: Client) -> None:
    key = str(uuid.uuid4())
    url = "/probe/flow-unresumable/"
    with pytest.raises(ProbeError):
        post(client, url, key, headers={"X-Flow-Raise": "inside-two"})
    assert FlowRun.objects.get(record__key=key).started == "two"

    failed = problem(post(client, url, key), FlowFailed.status)
    assert failed["type"].endswith("#flow-failed")
    assert failed["interrupted"] == "two"
    assert failed["compensated"] == ["one"]
    assert sum(REMOTE_CALLS.values()) == 1  # never called again
    assert effects("flow-undo-one", key) == 1
    assert effects("flow-refund-two", key) == 0  # its outcome is unknown: no result to undo
    assert FlowRun.objects.get(record__key=key).state == FlowRun.State.FAILED
    replay = post(client, url, key)
    assert replay["Idempotent-Replayed"] == "true"
    assert replay.status_code == FlowFailed.status
    assert effects("flow-undo-one", key) == 1
    assert ProcessedEvent.objects.filter(consumer="django_idempotency.flow.compensate").count()


def test_the_derived_key_is_a_stable_uuid8_per_request_and_phase() -> None:
    key = derive_key("user:1", "abc", "f1", "charge")
    assert key == derive_key("user:1", "abc", "f1", "charge")
    others = {
        derive_key("user:2", "abc", "f1", "charge"),
        derive_key("user:1", "abd", "f1", "charge"),
        derive_key("user:1", "abc", "f2", "charge"),
        derive_key("user:1", "abc", "f1", "refund"),
    }
    assert len(others | {key}) == 5
    parsed = uuid.UUID(key)
    assert parsed.version == 8 and parsed.variant == uuid.RFC_4122


def test_a_result_that_is_not_json_rolls_the_phase_back() -> None:
    @idempotent(phases=True)
    def view(request, flow: Flow):  # type: ignore[no-untyped-def]
        flow.phase("bad", lambda: (Effect.objects.create(name="bad-phase"), object())[1])
        raise AssertionError("unreachable")

    request = RequestFactory().post(
        "/x", data=b"{}", content_type="application/json", HTTP_IDEMPOTENCY_KEY="k-json"
    )
    request.user = _anonymous()
    with pytest.raises(TypeError, match="cannot be stored"):
        view(request)
    assert effects("bad-phase") == 0


def test_a_json_result_is_returned_as_stored_on_the_first_run_too() -> None:
    seen = []

    @idempotent(phases=True)
    def view(request, flow: Flow):  # type: ignore[no-untyped-def]
        seen.append(flow.phase("tuple", lambda: (1, {2: "x"})))
        return json_response()

    request = RequestFactory().post(
        "/x", data=b"{}", content_type="application/json", HTTP_IDEMPOTENCY_KEY="k-tuple"
    )
    request.user = _anonymous()
    assert view(request).status_code == 201
    assert seen == [[1, {"2": "x"}]]


def json_response():  # type: ignore[no-untyped-def]
    from django.http import JsonResponse

    return JsonResponse({}, status=201)


def test_phases_inside_an_atomic_block_are_refused() -> None:
    @idempotent(phases=True)
    def view(request, flow: Flow):  # type: ignore[no-untyped-def]
        with transaction.atomic():
            flow.phase("nested", lambda: 1)
        return json_response()

    request = RequestFactory().post(
        "/x", data=b"{}", content_type="application/json", HTTP_IDEMPOTENCY_KEY="k-nested"
    )
    request.user = _anonymous()
    with pytest.raises(TransactionManagementError, match=r"inside transaction\.atomic"):
        view(request)


def test_a_phase_name_used_twice_is_refused() -> None:
    @idempotent(phases=True)
    def view(request, flow: Flow):  # type: ignore[no-untyped-def]
        flow.phase("same", lambda: 1)
        flow.phase("same", lambda: 2)
        return json_response()

    request = RequestFactory().post(
        "/x", data=b"{}", content_type="application/json", HTTP_IDEMPOTENCY_KEY="k-twice"
    )
    request.user = _anonymous()
    with pytest.raises(ValueError, match="appears twice"):
        view(request)


def test_a_request_without_a_key_runs_its_phases_unrecorded(client: Client) -> None:
    response = post(client, URL, None)
    assert response.status_code == 201
    assert body(response)["resumed"] is False
    assert not FlowRun.objects.exists()
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.django_db(databases=["default", "other"], transaction=True)
def test_an_unrecorded_phase_is_one_transaction_on_the_configured_database() -> None:
    """Without a key, a phase still runs in a transaction on IDEMPOTENCY["DATABASE"] (it once
    opened it on "default", so its writes to the business data's database each autocommitted:
    a phase that failed halfway left its first write behind)."""

    def half_done() -> None:
        Effect.objects.using("other").create(name="unrecorded-half", payload="first write")
        raise ProbeError("the phase failed after its first write")

    @idempotent(phases=True)
    def view(request, flow: Flow):  # type: ignore[no-untyped-def]
        flow.phase("half", half_done)
        raise AssertionError("unreachable")

    request = RequestFactory().post("/x", data=b"{}", content_type="application/json")
    request.user = _anonymous()
    with override_settings(IDEMPOTENCY={"DATABASE": "other"}), pytest.raises(ProbeError):
        view(request)
    assert not Effect.objects.using("other").filter(name="unrecorded-half").exists()
    assert not IdempotencyRecord.objects.using("other").exists()


def test_async_views_are_refused() -> None:
    with pytest.raises(ImproperlyConfigured, match="coroutine"):

        @idempotent(phases=True)
        async def view(request, flow):  # type: ignore[no-untyped-def]
            return None


def test_a_run_left_by_an_expired_key_is_discarded(client: Client) -> None:
    key = str(uuid.uuid4())
    with pytest.raises(ProbeError):
        post(client, URL, key, data={"a": 1}, headers={"X-Flow-Raise": "two"})
    IdempotencyRecord.objects.filter(key=key).update(expires_at=timezone.now())
    response = post(client, URL, key, data={"a": 2})  # a new request under the expired key
    assert response.status_code == 201
    assert body(response)["resumed"] is False
    assert effects("flow-one", key) == 2
    # Its foreign call went out under a key of its own, not the earlier request's.
    assert sorted(REMOTE_CALLS.values()) == [1, 1]
    run = FlowRun.objects.get(record__key=key)
    assert run.state == FlowRun.State.COMPLETED
    assert json.loads(__import__("base64").b64decode(run.request["body"])) == {"a": 2}


@pytest.mark.postgres
@pytest.mark.mysql
def test_concurrent_resumes_and_the_completer_race_to_one_run(client: Client) -> None:
    """Eight retries and the completer resume one abandoned flow at once: one of them runs."""
    import threading

    from django_idempotency.flows.completer import complete_abandoned
    from tests.probes import in_thread

    key = str(uuid.uuid4())
    with pytest.raises(ProbeError):
        post(client, URL, key, headers={"X-Flow-Raise": "one"})
    barrier = threading.Barrier(9)

    def retry() -> int:
        barrier.wait()
        response = post(Client(), URL, key)
        return response.status_code if not response.has_header("Idempotent-Replayed") else 0

    def complete() -> str:
        barrier.wait()
        return ",".join(done.outcome for done in complete_abandoned())

    threads = [in_thread(retry) for _ in range(8)] + [in_thread(complete)]
    for thread, _ in threads:
        thread.join(60)
    outcomes = [outcome.get("result", outcome.get("error")) for _, outcome in threads]
    ran = outcomes[:8].count(201) + (outcomes[8] == "completed")
    assert ran == 1, outcomes
    assert set(outcomes[:8]) <= {201, 409, 0}, outcomes  # 0: a replay of the finished run
    assert effects("flow-one", key) == effects("flow-three", key) == 1
    assert sum(REMOTE_CALLS.values()) == 1
    assert IdempotencyRecord.objects.get(key=key).state == IdempotencyRecord.State.COMPLETED


def test_the_statements_a_flow_adds(client: Client) -> None:
    """The cost in docs/flows.md: per phase, one fence and one write of the run."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as queries:
        assert post(client, URL, str(uuid.uuid4())).status_code == 201
    statements = [query["sql"] for query in queries.captured_queries]
    runs = [sql for sql in statements if "django_idempotency_flowrun" in sql]
    fences = [
        sql
        for sql in statements
        if sql.startswith("UPDATE") and "idempotencyrecord" in sql and "'completed'" not in sql
    ]
    # The run: read once, created by phase one, moved by the call and by phase three, then
    # marked completed with the response. The fence: phase one, the call (before and after),
    # phase three.
    assert [sql.split()[0] for sql in runs] == ["SELECT", "INSERT", "UPDATE", "UPDATE", "UPDATE"]
    assert len(fences) == 4
