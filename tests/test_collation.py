"""Keys, owners, event ids and consumer names compare byte for byte, on every backend.

MariaDB's default utf8mb4 collations ignore case; the test database is created with
``utf8mb4_unicode_ci`` on purpose (testproject/settings.py), so migration 0002 must override it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.db import connection, transaction
from django.test import Client

from django_idempotency.checks import check_binary_collation
from django_idempotency.collation import BINARY_COLLATION, non_binary_columns, set_collation
from django_idempotency.events.core import count_delivery, try_reserve
from django_idempotency.models import EventDelivery, IdempotencyRecord
from tests.probes import effects, post


@pytest.mark.django_db(transaction=True)
def test_event_ids_that_differ_only_in_case_are_two_events() -> None:
    with transaction.atomic():
        assert try_reserve("evt_1NqQaB", "billing") is True
        assert try_reserve("evt_1NqQAb", "billing") is True  # another event, not a duplicate
        assert try_reserve("evt_1NqQaB", "Billing") is True  # another consumer
        assert try_reserve("evt_1NqQAb", "billing") is False


@pytest.mark.django_db(transaction=True)
def test_delivery_counters_keep_case_variants_apart() -> None:
    assert count_delivery("evt_1NqQaB", "billing").count == 1
    assert count_delivery("evt_1NqQAb", "billing").count == 1
    assert EventDelivery.objects.count() == 2


@pytest.mark.django_db(transaction=True)
def test_keys_that_differ_only_in_case_are_two_requests(client: Client) -> None:
    first = post(client, "/probe/effect/", "Order-7f3A")
    second = post(client, "/probe/effect/", "order-7f3a")
    assert (first.status_code, second.status_code) == (201, 201)
    assert effects() == 2  # the second ran; it is not a replay of the first
    assert set(IdempotencyRecord.objects.values_list("key", flat=True)) == {
        "Order-7f3A",
        "order-7f3a",
    }


@pytest.mark.django_db
def test_the_check_is_clean_after_migrate() -> None:
    assert check_binary_collation(databases=["default"]) == []
    assert check_binary_collation() == []  # no database asked for: no query


@pytest.mark.mysql
@pytest.mark.django_db
def test_the_migration_overrides_a_case_insensitive_default() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT @@collation_database")
        (default,) = cursor.fetchone()
    assert not default.endswith("_bin")  # utf8mb4_unicode_ci, as most servers are set up
    assert non_binary_columns(connection) == []


@pytest.fixture
def collation_changed_back() -> Iterator[None]:
    set_collation(connection, "utf8mb4_unicode_ci")
    try:
        yield
    finally:
        set_collation(connection, BINARY_COLLATION)


@pytest.mark.mysql
@pytest.mark.django_db(transaction=True)
def test_a_collation_changed_back_fails_the_check(collation_changed_back: None) -> None:
    messages = check_binary_collation(databases=["default"])
    assert {message.id for message in messages} == {"django_idempotency.E010"}
    assert len(messages) == 6  # two identity columns in each of the three tables
    assert "django_idempotency_processedevent.event_id" in " ".join(m.msg for m in messages)
