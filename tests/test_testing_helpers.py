"""django_idempotency.testing: each helper passes on what it claims and fails on anything else.

Run against the demo's order endpoint (``@idempotent(required=True)``) and its unprotected copy,
with Django's test client, on the configured database.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client, override_settings

from django_idempotency.testing import (
    assert_not_replayed,
    assert_problem,
    assert_replayed,
    send_twice,
)
from testproject.shop.models import Order

ORDER = {
    "reference": "T-1",
    "amount_cents": 1250,
    "provider": "stripe",
    "external_payment_id": "pi_testing_1",
}


def post(client: Client, path: str, data: dict[str, Any], key: str | None = None) -> Any:
    headers = {"Idempotency-Key": key} if key else {}
    return client.post(path, data, content_type="application/json", headers=headers)


@pytest.mark.django_db
def test_send_twice_returns_the_answer_and_its_replay(client: Client) -> None:
    first, retry = send_twice(client, "/api/orders/", ORDER)
    assert first.status_code == 201
    assert retry.content == first.content
    assert Order.objects.count() == 1


@pytest.mark.django_db
def test_send_twice_fails_on_a_view_that_runs_twice(client: Client) -> None:
    with pytest.raises(AssertionError, match="not a replay"):
        send_twice(client, "/api/unsafe-orders/", ORDER)
    assert Order.objects.count() == 2


@pytest.mark.django_db
def test_assert_replayed_compares_with_the_first_answer(client: Client) -> None:
    first = post(client, "/api/orders/", ORDER, key="k-1")
    assert_not_replayed(first)
    with pytest.raises(AssertionError, match="not a replay"):
        assert_replayed(first)
    retry = post(client, "/api/orders/", ORDER, key="k-1")
    assert_replayed(retry, first)
    other = post(client, "/api/orders/", {**ORDER, "external_payment_id": "pi_2"}, key="k-2")
    other_replay = post(client, "/api/orders/", {**ORDER, "external_payment_id": "pi_2"}, "k-2")
    with pytest.raises(AssertionError, match="differs from the first answer"):
        assert_replayed(other_replay, first)
    with pytest.raises(AssertionError, match="a replay, where the view should have run"):
        assert_not_replayed(retry)
    assert other.status_code == 201


@pytest.mark.django_db
def test_assert_problem_checks_the_type_and_the_status(client: Client) -> None:
    missing = post(client, "/api/orders/", ORDER)
    body = assert_problem(missing, "missing-key", 400)
    assert body["status"] == 400
    with pytest.raises(AssertionError, match="missing-key"):
        assert_problem(missing, "key-reused")
    with pytest.raises(AssertionError, match="status 400, not 422"):
        assert_problem(missing, "missing-key", 422)
    with pytest.raises(AssertionError, match="not application/problem"):
        assert_problem(post(client, "/api/orders/", ORDER, key="k-3"), "missing-key")


@pytest.mark.django_db
def test_assert_problem_follows_the_configured_type_base(client: Client) -> None:
    base = "https://api.example.com/errors#"
    with override_settings(IDEMPOTENCY={"PROBLEM_TYPE_BASE": base}):
        body = assert_problem(post(client, "/api/orders/", ORDER), "missing-key", 400)
    assert body["type"] == base + "missing-key"
