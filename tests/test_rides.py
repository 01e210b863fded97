"""The ride checkout of docs/flows.md against a real (small) payment provider over HTTP."""

from __future__ import annotations

import uuid

import pytest
from django.test import Client, override_settings

from django_idempotency.flows.completer import complete_abandoned
from django_idempotency.flows.phases import record_key
from django_idempotency.models import FlowRun, IdempotencyRecord
from testproject.shop import rides
from testproject.shop.models import Receipt, Ride
from tests.probes import body, post
from tests.psp import Provider

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/api/rides/"
RIDE = {"origin": [52.52, 13.40], "target": [52.50, 13.45]}


def test_a_ride_is_created_charged_and_receipted_once(psp: Provider) -> None:
    client = Client()
    key = str(uuid.uuid4())
    response = post(client, URL, key, RIDE)
    assert response.status_code == 201, response.content
    data = body(response)
    ride = Ride.objects.get(pk=data["ride"])
    assert (ride.status, ride.charge_id) == (Ride.Status.CHARGED, data["charge"])
    assert Receipt.objects.get(ride=ride).amount_cents == rides.RIDE_PRICE_CENTS
    assert psp.charge_keys() == [
        record_key(IdempotencyRecord.objects.get(key=key), "charge_created")
    ]

    replay = post(client, URL, key, RIDE)
    assert replay["Idempotent-Replayed"] == "true"
    assert replay.content == response.content
    assert (Ride.objects.count(), Receipt.objects.count(), len(psp.calls)) == (1, 1, 1)


def test_a_declined_card_is_the_stored_answer(psp: Provider) -> None:
    psp.decline.add("guest")
    client = Client()
    key = str(uuid.uuid4())
    response = post(client, URL, key, RIDE)
    assert response.status_code == 402
    assert body(response)["declined"] == "card_declined"
    assert post(client, URL, key, RIDE)["Idempotent-Replayed"] == "true"
    assert len(psp.calls) == 1
    assert Receipt.objects.count() == 0


def test_an_invalid_ride_is_refused_before_any_phase(psp: Provider) -> None:
    response = post(Client(), URL, str(uuid.uuid4()), {"origin": "here"})
    assert response.status_code == 400
    assert not FlowRun.objects.exists()
    assert psp.calls == []


def test_the_provider_down_then_the_completer_finishes_the_ride(psp: Provider) -> None:
    client = Client(raise_request_exception=False)
    key = str(uuid.uuid4())
    with override_settings(PSP_URL="http://127.0.0.1:9"):  # nothing listens there
        response = post(client, URL, key, RIDE)
    assert response.status_code == 500  # the view's own error (ProviderError), not the app's
    run = FlowRun.objects.get(record__key=key)
    assert run.recovery_point == "ride_created"
    assert "ProviderError" in run.last_error

    [done] = complete_abandoned()
    assert (done.outcome, done.status) == ("completed", 201)
    assert len(psp.charges) == 1
    assert (Ride.objects.count(), Receipt.objects.count()) == (1, 1)
    late = post(client, URL, key, RIDE)
    assert late["Idempotent-Replayed"] == "true"
    assert body(late)["charge"] == "ch_1"
    assert IdempotencyRecord.objects.get(key=key).state == IdempotencyRecord.State.COMPLETED


def test_a_ride_rolled_forward_is_cancelled_and_refunded_once(
    psp: Provider, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = Client(raise_request_exception=False)
    key = str(uuid.uuid4())

    def broken(ride: Ride, charge: dict[str, object]) -> Receipt:
        raise RuntimeError("the receipt printer is on fire")

    monkeypatch.setattr(rides, "finish", broken)
    assert post(client, URL, key, RIDE).status_code == 500
    outcomes = [complete_abandoned(max_attempts=2)[0].outcome for _ in range(2)]
    monkeypatch.undo()
    assert outcomes == ["raised", "failed"]
    assert Ride.objects.get().status == Ride.Status.CANCELLED
    refund_key = record_key(IdempotencyRecord.objects.get(key=key), "charge_created:compensate")
    assert [call for call in psp.calls if call[0] == "/v1/refunds"] == [
        ("/v1/refunds", refund_key)
    ]
    late = post(client, URL, key, RIDE)
    assert (late.status_code, late["Idempotent-Replayed"]) == (502, "true")
    assert len(psp.refunds) == 1


def test_the_completer_runs_the_view_as_the_requests_user(psp: Provider) -> None:
    from django.contrib.auth import get_user_model

    user = get_user_model().objects.create_user("rider", password="x")
    client = Client(raise_request_exception=False)
    client.force_login(user)
    key = str(uuid.uuid4())
    with override_settings(PSP_URL="http://127.0.0.1:9"):
        assert post(client, URL, key, RIDE).status_code == 500
    assert IdempotencyRecord.objects.get(key=key).owner == f"user:{user.pk}"

    [done] = complete_abandoned()
    assert done.outcome == "completed"
    assert Ride.objects.get().customer == user
    [charge] = psp.charges.values()
    assert psp.charge_keys() == [
        record_key(IdempotencyRecord.objects.get(key=key), "charge_created")
    ]
    assert (charge["id"], charge["customer"]) == (Ride.objects.get().charge_id, f"user-{user.pk}")
    assert post(client, URL, key, RIDE)["Idempotent-Replayed"] == "true"
