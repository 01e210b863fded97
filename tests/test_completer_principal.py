"""The completer resumes a flow as the principal that started it, or not at all (issue 34, 2).

A run stores its principal's model label and primary key. The completer loads that model's row
again; when it cannot (another model now, gone, inactive, or a run stored with a key alone) it
rolls the flow forward to failure with its compensations, and never runs a phase as anyone
else. Real flows, through the completer, on every backend.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client, RequestFactory
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from django_idempotency.flows.completer import complete_abandoned, load_principal
from django_idempotency.flows.phases import FlowFailed
from django_idempotency.models import FlowRun, IdempotencyRecord
from testproject.shop.models import Effect, ServiceAccount
from testproject.shop.probe_flows import ProbeError, flow_whoami
from tests.probes import post, problem

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/probe/flow-whoami/"


def superuser() -> Any:
    return get_user_model().objects.create_superuser("root", "root@example.com", "pw")


def abandon_as(principal: Any, url: str = URL) -> str:
    """``principal`` (set as ``request.user`` the way an authentication middleware does)
    starts a flow that stops after phase one and never comes back."""
    key = str(uuid.uuid4())
    request = RequestFactory().post(
        url,
        data=json.dumps({"ride": 1}),
        content_type="application/json",
        headers={"Idempotency-Key": key, "X-Flow-Raise": "one"},
    )
    request.user = principal
    with pytest.raises(ProbeError):
        flow_whoami(request)
    return key


def abandon_logged_in(client: Client, user: Any) -> str:
    """``user`` signs in with a session and starts a flow that stops after phase one."""
    client.force_login(user)
    key = str(uuid.uuid4())
    with pytest.raises(ProbeError):
        post(client, URL, key, data={"ride": 1}, headers={"X-Flow-Raise": "one"})
    return key


def ran_as(phase: str, key: str) -> list[str]:
    """Who ran ``phase`` of the flow with ``key``."""
    payloads = Effect.objects.filter(name=f"whoami-{phase}", payload__startswith=f"{key} ")
    return [payload.split(" ", 1)[1] for payload in payloads.values_list("payload", flat=True)]


def assert_refused(key: str, why: str) -> None:
    [done] = complete_abandoned()
    assert (done.key, done.outcome, done.status) == (key, "refused", FlowFailed.status)
    assert why in done.detail
    assert ran_as("two", key) == []  # no phase ran as anyone
    assert Effect.objects.filter(name="whoami-undo-one", payload=key).count() == 1
    run = FlowRun.objects.get(record__key=key)
    assert run.state == FlowRun.State.FAILED
    record = IdempotencyRecord.objects.get(key=key)
    assert record.state == IdempotencyRecord.State.COMPLETED
    assert record.response_status == FlowFailed.status
    assert complete_abandoned() == []
    assert Effect.objects.filter(name="whoami-undo-one", payload=key).count() == 1


def test_a_service_accounts_flow_is_resumed_as_that_account_not_as_the_user_with_its_key() -> None:
    root = superuser()
    account = ServiceAccount.objects.create(pk=root.pk, name="billing-bot")
    key = abandon_as(account)
    assert FlowRun.objects.get(record__key=key).request["principal"] == "shop.serviceaccount"

    [done] = complete_abandoned()

    assert (done.outcome, done.status) == ("completed", 201)
    assert ran_as("one", key) == ran_as("two", key) == [f"shop.serviceaccount:{root.pk}"]


def test_a_session_users_flow_is_resumed_as_that_user(client: Client) -> None:
    user = get_user_model().objects.create_user("alice", password="pw")
    key = abandon_logged_in(client, user)
    [done] = complete_abandoned()
    assert (done.outcome, done.status) == ("completed", 201)
    assert ran_as("two", key) == [f"auth.user:{user.pk}"]


def test_a_flow_of_a_user_deactivated_after_phase_one_is_rolled_forward(client: Client) -> None:
    user = get_user_model().objects.create_user("bob", password="pw")
    key = abandon_logged_in(client, user)
    get_user_model().objects.filter(pk=user.pk).update(is_active=False)

    assert_refused(key, "is inactive")

    # Deactivated, the user's session no longer signs them in; once reactivated, their own
    # retry gets the stored failure, and the flow does not run again.
    get_user_model().objects.filter(pk=user.pk).update(is_active=True)
    late = post(client, URL, key, data={"ride": 1})
    assert late["Idempotent-Replayed"] == "true"
    assert problem(late, FlowFailed.status)["compensated"] == ["one"]
    assert ran_as("two", key) == []


def test_a_flow_of_a_deleted_user_is_rolled_forward(client: Client) -> None:
    user = get_user_model().objects.create_user("carol", password="pw")
    key = abandon_logged_in(client, user)
    get_user_model().objects.filter(pk=user.pk).delete()
    assert_refused(key, "no longer exists")


def test_a_deleted_service_account_is_not_replaced_by_the_user_with_its_key() -> None:
    root = superuser()
    account = ServiceAccount.objects.create(pk=root.pk, name="billing-bot")
    key = abandon_as(account)
    account.delete()
    assert_refused(key, "no longer exists")


def test_a_principal_whose_model_is_gone_is_refused() -> None:
    """The app was renamed or the model removed: its label names no model any more."""
    root = superuser()
    key = abandon_as(ServiceAccount.objects.create(pk=root.pk, name="billing-bot"))
    run = FlowRun.objects.get(record__key=key)
    run.request = {**run.request, "principal": "billing.apiclient"}
    run.save(update_fields=["request"])
    assert_refused(key, "'billing.apiclient' is not installed any more")


def test_a_principal_whose_label_now_names_another_kind_of_model_is_refused() -> None:
    """The label names a model whose rows are no principals (not authenticated)."""
    root = superuser()
    key = abandon_as(ServiceAccount.objects.create(pk=root.pk, name="billing-bot"))
    run = FlowRun.objects.get(record__key=key)
    run.request = {**run.request, "principal": "shop.effect"}
    run.save(update_fields=["request"])
    Effect.objects.create(pk=root.pk, name="not-a-principal")
    assert_refused(key, "is not authenticated")


def test_a_run_stored_before_the_principal_model_was_is_refused() -> None:
    """A run written by the previous version holds a primary key alone: the model that wrote
    it is unknown, so it is not loaded from AUTH_USER_MODEL (a superuser with that key)."""
    root = superuser()
    key = abandon_as(ServiceAccount.objects.create(pk=root.pk, name="billing-bot"))
    run = FlowRun.objects.get(record__key=key)
    legacy = dict(run.request)
    del legacy["principal"]
    run.request = legacy
    run.save(update_fields=["request"])
    assert_refused(key, "without its model")


def test_an_anonymous_flow_is_still_completed(client: Client) -> None:
    key = str(uuid.uuid4())
    with pytest.raises(ProbeError):
        post(client, URL, key, data={"ride": 1}, headers={"X-Flow-Raise": "one"})
    assert FlowRun.objects.get(record__key=key).request["user"] is None
    [done] = complete_abandoned()
    assert (done.outcome, done.status) == ("completed", 201)
    assert ran_as("two", key) == ["anonymous"]


def test_a_refused_flow_is_rolled_forward_even_when_the_view_answers_a_stored_status() -> None:
    """As an anonymous request the view answers 200 before its second phase: the run is
    rolled forward all the same, and phase one compensated (not stored as a success)."""
    root = superuser()
    account = ServiceAccount.objects.create(pk=root.pk, name="billing-bot")
    key = abandon_as(account, URL + "?members-only=1")
    account.delete()
    assert_refused(key, "no longer exists")


def test_a_key_that_matches_another_spelling_is_refused() -> None:
    """A lookup that matches the stored key spelled otherwise (a collation that ignores case
    or trailing spaces, an integer key written "01") finds another row than the one stored."""
    root = superuser()
    key = abandon_as(ServiceAccount.objects.create(pk=root.pk, name="billing-bot"))
    run = FlowRun.objects.get(record__key=key)
    run.request = {**run.request, "user": f"0{root.pk}"}
    run.save(update_fields=["request"])
    assert_refused(key, "no longer exists")


STORED = st.one_of(
    st.none(),
    st.text(),  # NUL, lone surrogates, huge
    st.integers(),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@pytest.mark.django_db
@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(
    user=st.one_of(STORED, st.sampled_from(["1", "01", "1 ", " 1", "1\x00", 1])),
    principal=st.one_of(STORED, st.sampled_from(["shop.serviceaccount", "auth.user", "auth"])),
)
def test_any_stored_principal_is_loaded_exactly_or_refused(user: Any, principal: Any) -> None:
    """Whatever a run's JSON holds (tampered, or written by another version), the completer
    loads exactly that principal or refuses with a reason; it never raises."""
    ServiceAccount.objects.get_or_create(pk=1, defaults={"name": "bot"})
    loaded, refusal = load_principal({"user": user, "principal": principal})
    if user is None:
        assert (loaded, refusal) == (None, "")
    elif loaded is None:
        assert refusal
    else:
        assert refusal == ""
        assert loaded._meta.label_lower == principal and str(loaded.pk) == str(user)
