"""The cheaper end of a transactional test (tests/fast_flush.py) leaves what Django's flush
leaves: every table empty but the content types and permissions, on every backend."""

from __future__ import annotations

import uuid

import pytest
from django.apps import apps
from django.contrib.auth.models import Permission, User
from django.contrib.contenttypes.models import ContentType
from django.db import connection, transaction

from testproject.shop.models import Order, Payment
from tests.fast_flush import KEPT, empty_tables


def row_counts() -> dict[str, int]:
    return {
        model._meta.db_table: model._default_manager.count()
        for model in apps.get_models()
        if model._meta.managed and not model._meta.proxy
    }


@pytest.mark.django_db(transaction=True)
def test_every_table_is_emptied_but_the_content_types_and_permissions() -> None:
    content_types = ContentType.objects.count()
    permissions = Permission.objects.count()
    assert content_types and permissions
    with transaction.atomic():
        # Referenced rows first, then rows that reference them: the DELETEs run in table
        # order, with the foreign keys deferred or unchecked.
        user = User.objects.create(username=f"u-{uuid.uuid4()}")
        order = Order.objects.create(customer=user, reference="r", amount_cents=1)
        Payment.objects.create(order=order, provider="p", external_payment_id="x", amount_cents=1)
    assert any(row_counts().values())
    empty_tables(connection.alias)
    counts = row_counts()
    kept = {table: counts.pop(table) for table in KEPT}
    assert kept == {"django_content_type": content_types, "auth_permission": permissions}
    assert not any(counts.values()), {table: n for table, n in counts.items() if n}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("round_", range(2))
def test_a_transactional_test_starts_with_empty_tables(round_: int) -> None:
    """Each round finds what the previous one wrote gone (the teardown ran)."""
    counts = row_counts()
    for table in KEPT:
        counts.pop(table)
    assert not any(counts.values())
    Order.objects.create(reference=f"round {round_}", amount_cents=1)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("round_", range(2))
def test_content_types_and_permissions_a_test_adds_are_gone_after_it(round_: int) -> None:
    """Regression: the kept tables were never looked at, so a permission (or content type) a
    test created outlived it, where Django's flush removes it (and post_migrate writes back
    only the models' own): each round here finds none left by the round before."""
    assert not ContentType.objects.filter(app_label="fast_flush_test").exists()
    content_type = ContentType.objects.create(app_label="fast_flush_test", model="gone")
    Permission.objects.create(codename="gone", name="Gone", content_type=content_type)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("round_", range(2))
def test_content_types_and_permissions_a_test_deletes_are_back_after_it(round_: int) -> None:
    """Regression, the other way: a permission a test deleted stayed deleted, where the flush's
    post_migrate writes it again."""
    permission = Permission.objects.get(codename="add_user")
    assert permission.content_type == ContentType.objects.get_for_model(User)
    permission.delete()
