"""Keys, owners, event ids, consumer names and ordering keys compare byte for byte, on every
backend: case and trailing spaces included.

MariaDB's default utf8mb4 collations ignore case; the test database is created with
``utf8mb4_unicode_ci`` on purpose (testproject/settings.py), so the migrations must override it.
``utf8mb4_bin`` (migration 0002) still ignored trailing spaces, being PAD SPACE; migration 0009
gives the columns a NO PAD one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from importlib import import_module

import pytest
from django.core.management import call_command
from django.db import connection, transaction
from django.db.models import Model
from django.test import Client
from django.utils import timezone

from django_idempotency.checks import check_binary_collation
from django_idempotency.collation import (
    IDENTITY_COLUMNS,
    compares_bytes,
    non_binary_columns,
    set_collation,
)
from django_idempotency.events.core import count_delivery, try_reserve
from django_idempotency.models import EventDelivery, IdempotencyRecord, OutboxEntry, ProcessedEvent
from django_idempotency.outbox import core as outbox
from django_idempotency.outbox.relay import Relay
from django_idempotency.outbox.transports import OutboxMessage
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


def _collations() -> dict[tuple[str, str], str]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT table_name, column_name, collation_name FROM information_schema.columns "
            "WHERE table_schema = DATABASE() AND table_name IN %s",
            [tuple(IDENTITY_COLUMNS)],
        )
        rows = cursor.fetchall()
    names = {(table, column.name) for table, spec in IDENTITY_COLUMNS.items() for column in spec}
    return {(str(t), str(c)): str(coll) for t, c, coll in rows if (str(t), str(c)) in names}


@contextmanager
def collation_set_to(collation: str) -> Iterator[None]:
    """Give the identity columns ``collation``, then put back what each had (what the
    migrations gave it), so that no later test runs on a collation the migrations did not set."""
    before = _collations()
    set_collation(connection, collation)
    try:
        yield
    finally:
        for table, spec in IDENTITY_COLUMNS.items():
            for column in spec:
                set_collation(connection, before[table, column.name], {table: (column,)})
        assert _collations() == before


@pytest.fixture
def collation_changed_back() -> Iterator[None]:
    with collation_set_to("utf8mb4_unicode_ci"):
        yield


@pytest.mark.mysql
@pytest.mark.django_db(transaction=True)
def test_a_collation_changed_back_fails_the_check(collation_changed_back: None) -> None:
    messages = check_binary_collation(databases=["default"])
    assert {message.id for message in messages} == {"django_idempotency.E010"}
    assert len(messages) == 8  # two identity columns in each of the four tables
    assert "django_idempotency_processedevent.event_id" in " ".join(m.msg for m in messages)


# --- Trailing spaces (PAD SPACE) and case, on every identity column ----------------------------

VARIANTS = ["order-42", "order-42 ", "order-42  ", "Order-42", "ORDER-42 "]
"""Five values that a PAD SPACE or case-insensitive collation takes for fewer."""


@pytest.mark.django_db(transaction=True)
def test_event_ids_that_differ_only_in_trailing_spaces_are_two_events() -> None:
    """On MariaDB ``utf8mb4_bin`` pads: the second reservation returned False, and a different
    event was skipped as a duplicate."""
    with transaction.atomic():
        assert [try_reserve(event, "billing") for event in VARIANTS] == [True] * 5
        assert try_reserve("order-42", "billing ") is True  # another consumer
        assert try_reserve("order-42", "saga:checkout:charge ") is True
        assert try_reserve("order-42 ", "billing") is False  # the same event, the same bytes
    assert ProcessedEvent.objects.count() == 7


@pytest.mark.django_db(transaction=True)
def test_delivery_counters_keep_trailing_space_variants_apart() -> None:
    assert [count_delivery(event, "billing").count for event in VARIANTS] == [1] * 5
    assert count_delivery("order-42", "billing ").count == 1
    assert count_delivery("order-42 ", "billing").count == 2


def _row(model: type[Model], column: str, value: str, index: int) -> Model:
    """A row of ``model`` whose other identity columns are fixed and ``column`` is ``value``."""
    now = timezone.now()
    later = now + timezone.timedelta(days=1)
    fields: dict[str, dict[str, object]] = {
        "django_idempotency_idempotencyrecord": {
            "owner": "user:1",
            "key": "key-1",
            "fingerprint": "f",
            "method": "POST",
            "path": "/",
            "expires_at": later,
        },
        "django_idempotency_processedevent": {
            "consumer": "c",
            "event_id": "e",
            "expires_at": later,
        },
        "django_idempotency_eventdelivery": {
            "consumer": "c",
            "event_id": "e",
            "expires_at": later,
        },
        "django_idempotency_outboxentry": {
            "event_id": f"e-{index}",
            "destination": "shop.effect",
            "payload": {},
            "ordering_key": f"k-{index}",
        },
    }
    values = {**fields[model._meta.db_table], column: value}
    return model.objects.create(**values)


MODELS: dict[str, type[Model]] = {
    model._meta.db_table: model
    for model in (IdempotencyRecord, ProcessedEvent, EventDelivery, OutboxEntry)
}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("table", "column"),
    [(table, column.name) for table, spec in IDENTITY_COLUMNS.items() for column in spec],
)
def test_every_identity_column_keeps_trailing_spaces_and_case_apart(
    table: str, column: str
) -> None:
    """Each value is its own row (the unique keys take all five), and ``=`` finds only it."""
    model = MODELS[table]
    for index, value in enumerate(VARIANTS):
        _row(model, column, value, index)  # an IntegrityError here: the unique key padded
    for value in VARIANTS:
        assert model.objects.filter(**{column: value}).count() == 1, repr(value)
    assert model.objects.filter(**{column: "order-42   "}).count() == 0


class Recording:
    """An outbox transport that acknowledges every message and keeps their destinations."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def send(self, messages: list[OutboxMessage]) -> list[BaseException | None]:
        self.sent.extend(message.destination for message in messages)
        return [None] * len(messages)

    def close(self) -> None:
        pass


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("null_default_transport")
def test_a_parked_ordering_key_holds_back_only_itself() -> None:
    """On MariaDB the outbox's ordering key had the table's case-insensitive default: a parked
    ``Order-7`` held back ``order-7`` and ``Order-7 `` for good."""
    with transaction.atomic():
        outbox.send("parked", {}, key="Order-7")
        outbox.send("other-case", {}, key="order-7")
        outbox.send("trailing-space", {}, key="Order-7 ")
        outbox.send("behind", {}, key="Order-7")
    OutboxEntry.objects.filter(destination="parked").update(state=OutboxEntry.State.PARKED)
    transport = Recording()
    Relay(transports={"default": transport}).drain()
    assert sorted(transport.sent) == ["other-case", "trailing-space"]
    assert OutboxEntry.objects.get(destination="behind").state == OutboxEntry.State.PENDING


def test_only_a_no_pad_binary_collation_compares_bytes() -> None:
    assert compares_bytes("utf8mb4_nopad_bin")
    assert compares_bytes("utf8mb4_0900_bin")  # MySQL 8
    assert not compares_bytes("utf8mb4_bin")  # PAD SPACE
    assert not compares_bytes("utf8mb4_unicode_ci")
    assert not compares_bytes("utf8mb4_unicode_nopad_ci")
    assert not compares_bytes(None)


@pytest.fixture
def padded_binary() -> Iterator[None]:
    with collation_set_to("utf8mb4_bin"):
        yield


@pytest.mark.mysql
@pytest.mark.django_db(transaction=True)
def test_a_pad_space_binary_collation_fails_the_check(padded_binary: None) -> None:
    """``utf8mb4_bin`` was what E010 asked for; it pads, so it is refused now."""
    messages = check_binary_collation(databases=["default"])
    assert {message.id for message in messages} == {"django_idempotency.E010"}
    assert len(messages) == 8
    text = " ".join(f"{m.msg} {m.hint}" for m in messages)
    assert "'utf8mb4_bin'" in text and "trailing spaces" in text
    assert "utf8mb4_nopad_bin" in text
    assert "django_idempotency_outboxentry.ordering_key" in text


@pytest.mark.mysql
@pytest.mark.django_db(transaction=True)
def test_an_upgrade_from_padded_columns_is_not_stopped_by_its_own_check() -> None:
    """``migrate`` runs E010 before it migrates: a check that asked for NO PAD before
    ``0009_nopad_collation`` ran would stop the one migration that gives it."""
    nopad = import_module("django_idempotency.migrations.0009_nopad_collation")
    ((_, before),) = nopad.Migration.dependencies
    call_command("migrate", "django_idempotency", before, verbosity=0, skip_checks=False)
    try:
        collations = _collations()
        assert collations["django_idempotency_processedevent", "event_id"] == "utf8mb4_bin"
        assert not compares_bytes(collations["django_idempotency_outboxentry", "ordering_key"])
        assert check_binary_collation(databases=["default"]) == []
    finally:
        call_command("migrate", "django_idempotency", verbosity=0, skip_checks=False)
    assert non_binary_columns(connection) == []
    assert all(compares_bytes(collation) for collation in _collations().values())
