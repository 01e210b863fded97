"""The demo in the test project: the orders API, its unprotected copy, and ``retry_storm``.

An order's ``OrderConfirmed`` event is written to the outbox with the order. The billing
consumer runs eagerly here (no ``CELERY_BROKER_URL`` in the test settings), so the event is
applied when a relay runs in the test process. Delivery through real brokers is proven in the
consumer and outbox tests; these tests are about the demo's wiring.
"""

from __future__ import annotations

import json
import uuid
from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.test import Client

from django_idempotency.models import IdempotencyRecord, OutboxEntry, ProcessedEvent
from django_idempotency.outbox.relay import Relay
from testproject.shop.models import LedgerEntry, Order, Payment
from testproject.shop.tasks import apply_order_confirmed

ORDERS = "/api/orders/"
UNSAFE = "/api/unsafe-orders/"
ORDER = {
    "reference": "A-1",
    "amount_cents": 1250,
    "provider": "stripe",
    "external_payment_id": "pi_1",
}


def post(client: Client, path: str, body: Any, key: str | None = None) -> Any:
    headers = {} if key is None else {"Idempotency-Key": f'"{key}"'}
    return client.post(path, json.dumps(body), content_type="application/json", headers=headers)


@pytest.mark.django_db(transaction=True)
def test_order_is_created_once_and_its_event_applied_once(client: Client) -> None:
    key = str(uuid.uuid4())
    first = post(client, ORDERS, ORDER, key)
    assert first.status_code == 201, first.content
    data = first.json()
    assert data["created"] is True
    assert data["order"]["reference"] == "A-1"
    assert data["payment"] == {"provider": "stripe", "external_payment_id": "pi_1"}
    assert first["Location"] == f"/api/orders/{data['order']['id']}/"
    assert uuid.UUID(data["event_id"]).version == 7
    # The Location answers (it was a 404).
    shown = client.get(first["Location"])
    assert shown.status_code == 200
    assert shown.json() == {"order": data["order"], "payment": data["payment"]}

    # The event is in the outbox, with the order, and has not left yet.
    message = OutboxEntry.objects.get()
    assert (message.event_id, message.state) == (data["event_id"], "pending")
    assert message.ordering_key == f"order-{data['order']['id']}"
    assert not LedgerEntry.objects.exists()

    # The relay sends it and the billing consumer applies it once.
    assert Relay().drain().sent == 1
    entry = LedgerEntry.objects.get()
    assert (entry.order_id, entry.event_id, entry.amount_cents) == (
        data["order"]["id"],
        data["event_id"],
        1250,
    )
    assert ProcessedEvent.objects.filter(event_id=data["event_id"]).count() == 1

    # A retry with the same key is a replay: same answer, nothing runs, nothing is published.
    again = post(client, ORDERS, ORDER, key)
    assert again.status_code == 201
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert again["Location"] == first["Location"]
    assert (Order.objects.count(), Payment.objects.count(), LedgerEntry.objects.count()) == (
        1,
        1,
        1,
    )
    assert OutboxEntry.objects.count() == 1
    assert Relay().drain().claimed == 0

    # The broker delivering the same event again changes nothing.
    event = {"event_id": data["event_id"], "order_id": data["order"]["id"], "amount_cents": 1250}
    for _ in range(3):
        apply_order_confirmed.delay(event)
    assert LedgerEntry.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_same_payment_under_another_key_returns_the_existing_order(client: Client) -> None:
    first = post(client, ORDERS, ORDER, str(uuid.uuid4())).json()
    second = post(client, ORDERS, ORDER, str(uuid.uuid4()))
    assert second.status_code == 200
    assert second.json()["created"] is False
    assert second.json()["order"]["id"] == first["order"]["id"]
    assert second.json()["event_id"] == first["event_id"]
    assert Relay().drain().sent == 1  # one event, for the one order
    assert (Order.objects.count(), Payment.objects.count(), LedgerEntry.objects.count()) == (
        1,
        1,
        1,
    )
    assert IdempotencyRecord.objects.count() == 2


@pytest.mark.django_db
def test_key_is_required(client: Client) -> None:
    response = post(client, ORDERS, ORDER)
    assert response.status_code == 400
    assert response["Content-Type"] == "application/problem+json"
    assert response.json()["type"].endswith("#missing-key")
    assert not Order.objects.exists()


@pytest.mark.django_db
def test_key_reused_for_another_order_is_refused(client: Client) -> None:
    key = str(uuid.uuid4())
    assert post(client, ORDERS, ORDER, key).status_code == 201
    response = post(client, ORDERS, {**ORDER, "amount_cents": 999}, key)
    assert response.status_code == 422
    assert response.json()["type"].endswith("#key-reused")
    assert Order.objects.count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({**ORDER, "amount_cents": 0}, "amount_cents"),
        ({**ORDER, "amount_cents": True}, "amount_cents"),
        ({**ORDER, "reference": " "}, "reference"),
        ({**ORDER, "provider": "x" * 51}, "provider"),
        ({k: v for k, v in ORDER.items() if k != "external_payment_id"}, "external_payment_id"),
        ([1, 2], "body"),
    ],
)
def test_invalid_orders_are_refused(client: Client, body: Any, field: str) -> None:
    response = post(client, ORDERS, body, str(uuid.uuid4()))
    assert response.status_code == 400
    assert response["Content-Type"] == "application/problem+json"
    assert field in response.json()["errors"]
    assert not Order.objects.exists()


@pytest.mark.django_db
def test_body_that_is_not_json_is_refused(client: Client) -> None:
    response = client.post(
        ORDERS, b"{oops", content_type="application/json", headers={"Idempotency-Key": "k-1"}
    )
    assert response.status_code == 400
    assert "body" in response.json()["errors"]


@pytest.mark.django_db
def test_get_is_not_allowed(client: Client) -> None:
    assert client.get(ORDERS).status_code == 405
    assert client.get(UNSAFE).status_code == 405


@pytest.mark.django_db(transaction=True)
def test_unprotected_endpoint_duplicates_everything(client: Client) -> None:
    key = str(uuid.uuid4())
    responses = [post(client, UNSAFE, ORDER, key) for _ in range(3)]
    assert [r.status_code for r in responses] == [201, 201, 201]
    assert not any(r.has_header("Idempotent-Replayed") for r in responses)
    assert Order.objects.count() == 3
    assert LedgerEntry.objects.count() == 3
    assert len({r.json()["event_id"] for r in responses}) == 3
    assert not Payment.objects.exists()
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_home_page_tells_the_story(client: Client) -> None:
    post(client, UNSAFE, {**ORDER, "reference": "DUP-1"})
    post(client, UNSAFE, {**ORDER, "reference": "DUP-1"})
    response = client.get("/")
    assert response.status_code == 200
    content = response.content.decode()
    for text in (
        "/api/orders/",
        "/api/unsafe-orders/",
        "retry_storm",
        "/admin/django_idempotency/idempotencyrecord/",
        "<code>DUP-1</code>: 2 orders",
    ):
        assert text in content


def storm(*args: str) -> dict[str, Any]:
    out = StringIO()
    call_command("retry_storm", *args, "--json", "--check", stdout=out)
    return json.loads(out.getvalue())


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.django_db(transaction=True)
def test_retry_storm_in_process() -> None:
    """Twelve concurrent retries of one order with one key, and four redeliveries of its event.

    With the app: exactly one execution, one order, one ledger entry; every other request was a
    replay or a 409. Without: every request creates an order and publishes its own event, and
    the naive consumer applies each delivery, so the counts are deterministic, not a race.
    """
    result = storm("--in-process", "--requests", "12", "--redeliveries", "4")
    protected, unprotected = result["protected"], result["unprotected"]
    assert protected["requests_sent"] == 12
    assert protected["executions"] == 1
    assert protected["replays"] + protected["conflicts"] == 11
    assert protected["other"] == {}, protected["first_error"]
    assert protected["orders_created"] == 1
    assert protected["redeliveries"] == 4
    assert protected["ledger_entries"] == 1
    assert unprotected["executions"] == 12
    assert unprotected["orders_created"] == 12
    assert unprotected["ledger_entries"] == 12 + 4
    assert Order.objects.count() == 13
    assert LedgerEntry.objects.count() == 1 + 16


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.django_db(transaction=True)
def test_retry_storm_over_http(live_server: Any) -> None:
    result = storm("--url", live_server.url, "--requests", "8", "--redeliveries", "2")
    protected, unprotected = result["protected"], result["unprotected"]
    assert protected["executions"] == 1
    assert protected["replays"] + protected["conflicts"] == 7
    assert (protected["orders_created"], protected["ledger_entries"]) == (1, 1)
    assert (unprotected["orders_created"], unprotected["ledger_entries"]) == (8, 10)


@pytest.mark.django_db
def test_retry_storm_prints_a_table_and_rejects_bad_arguments() -> None:
    with pytest.raises(CommandError, match="--requests"):
        call_command("retry_storm", "--in-process", "--requests", "0")
    with pytest.raises(CommandError, match="--redeliveries"):
        call_command("retry_storm", "--in-process", "--redeliveries", "-1")
    with pytest.raises(CommandError, match="No server answers at"):
        call_command("retry_storm", "--url", "http://127.0.0.1:9")


@pytest.mark.django_db(transaction=True)
def test_retry_storm_table(capsys: pytest.CaptureFixture[str]) -> None:
    out = StringIO()
    call_command(
        "retry_storm", "--in-process", "--requests", "1", "--redeliveries", "1", stdout=out
    )
    text = out.getvalue()
    for label in (
        "requests sent",
        "replays served",
        "conflicts (409)",
        "orders created",
        "ledger entries",
        "With the app: 1 order, 1 ledger entry.",
    ):
        assert label in text
