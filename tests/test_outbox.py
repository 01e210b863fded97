"""``outbox.publish`` and ``outbox.send``: one row in the caller's transaction, or nothing.

Runs on every backend. The NOTIFY tests run in the PostgreSQL pass: a second connection
runs ``LISTEN`` and sees the notification only once the producer's transaction commits.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, connections, transaction
from django.db.transaction import TransactionManagementError
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from django_idempotency import new_event_id
from django_idempotency.models import OutboxEntry
from django_idempotency.outbox import core as outbox
from testproject.shop.models import Order
from testproject.shop.tasks import apply_order_confirmed
from tests.outbox_helpers import NULL_TRANSPORTS

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("null_default_transport")]


def only_row() -> OutboxEntry:
    (row,) = OutboxEntry.objects.all()
    return row


@pytest.mark.django_db(transaction=True)
def test_publish_outside_a_transaction_is_refused_and_writes_nothing() -> None:
    with pytest.raises(TransactionManagementError, match=r"inside transaction\.atomic"):
        outbox.publish(apply_order_confirmed, args=[{"order_id": 1}])
    assert not OutboxEntry.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_send_outside_a_transaction_is_refused() -> None:
    with pytest.raises(TransactionManagementError):
        outbox.send("orders.confirmed", {"order_id": 1})


def test_publish_writes_one_pending_row_with_a_uuid7_event_id() -> None:
    with transaction.atomic():
        event_id = outbox.publish(
            apply_order_confirmed,
            args=[{"order_id": 7}],
            key="order-7",
            headers={"tenant": "acme"},
            queue="billing",
        )

    row = only_row()
    assert uuid.UUID(event_id).version == 7
    assert row.event_id == event_id
    assert row.destination == "billing.apply_order_confirmed"
    assert row.transport == "default"
    assert row.payload == {
        "args": [{"order_id": 7}],
        "kwargs": {},
        "options": {"queue": "billing"},
    }
    assert row.headers == {"tenant": "acme"}
    assert row.ordering_key == "order-7"
    assert (row.state, row.attempts, row.available_at, row.locked_until) == (
        "pending",
        0,
        None,
        None,
    )
    assert row.sent_at is None
    assert row.expires_at is None  # pending rows never expire


def test_publish_keeps_the_event_id_the_call_already_carries() -> None:
    in_kwargs, in_mapping = str(new_event_id()), str(new_event_id())
    with transaction.atomic():
        first = outbox.publish("shop.effect", kwargs={"event_id": in_kwargs})
        second = outbox.publish(apply_order_confirmed, args=[{"event_id": in_mapping}])

    assert (first, second) == (in_kwargs, in_mapping)
    assert set(OutboxEntry.objects.values_list("event_id", flat=True)) == {in_kwargs, in_mapping}


def test_send_writes_a_topic_message() -> None:
    event_id = uuid.uuid4()
    with transaction.atomic():
        returned = outbox.send("orders.confirmed", {"order_id": 3}, key="3", event_id=event_id)

    row = only_row()
    assert returned == row.event_id == str(event_id)
    assert (row.destination, row.payload, row.ordering_key) == (
        "orders.confirmed",
        {"order_id": 3},
        "3",
    )


def test_rolled_back_transaction_publishes_nothing() -> None:
    class Abort(Exception):
        pass

    with pytest.raises(Abort), transaction.atomic():
        Order.objects.create(reference="R-1", amount_cents=100)
        outbox.publish(apply_order_confirmed, args=[{"order_id": 1}])
        raise Abort

    assert not OutboxEntry.objects.exists()
    assert not Order.objects.exists()


def test_a_rolled_back_savepoint_takes_its_message_with_it() -> None:
    with transaction.atomic():
        outbox.send("kept", {})
        try:
            with transaction.atomic():
                outbox.send("dropped", {})
                raise ValueError
        except ValueError:
            pass

    assert list(OutboxEntry.objects.values_list("destination", flat=True)) == ["kept"]


def test_publish_is_one_statement() -> None:
    with transaction.atomic(), CaptureQueriesContext(connection) as queries:
        outbox.publish("shop.effect", kwargs={"x": 1})
    statements = [q["sql"] for q in queries.captured_queries if "INSERT" in q["sql"]]
    assert len(statements) == 1
    if connection.vendor == "postgresql":
        assert "pg_notify" in statements[0]


def nested(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


def test_a_payload_nested_to_the_limit_is_stored() -> None:
    with transaction.atomic():
        outbox.send("t", nested(31))  # MariaDB's JSON limit, on every backend
    assert OutboxEntry.objects.count() == 1


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: outbox.send("", {}), ValueError, "destination"),
        (lambda: outbox.send("x" * 256, {}), ValueError, "255"),
        (lambda: outbox.send("t", {"when": object()}), TypeError, "JSON-serialisable"),
        (lambda: outbox.send("t", {"ratio": float("nan")}), TypeError, "JSON compliant"),
        (lambda: outbox.publish("t", args=[float("inf")]), TypeError, "JSON compliant"),
        (lambda: outbox.send("t", {}, key=""), ValueError, "ordering key"),
        (lambda: outbox.send("t", {}, headers={"a": 1}), TypeError, "strings"),  # type: ignore[dict-item]
        (lambda: outbox.send("t", {}, event_id=""), ValueError, "empty"),
        (lambda: outbox.send("t", {}, transport="kafka"), ImproperlyConfigured, "kafka"),
        (lambda: outbox.publish("t", flavour=5), TypeError, "flavour"),
        (lambda: outbox.send("t", nested(32)), ValueError, "nested 32 levels deep"),
        (lambda: outbox.publish("t", args=[nested(200_000)]), ValueError, "levels deep"),
    ],
    ids=[
        "empty-destination",
        "long-destination",
        "not-json",
        "nan",
        "infinity",
        "empty-key",
        "header-not-str",
        "empty-event-id",
        "unknown-transport",
        "unsupported-option",
        "too-deep",
        "far-too-deep",  # json.dumps itself would raise RecursionError
    ],
)
def test_bad_input_raises_a_clear_error_and_writes_nothing(
    call: Any, error: type[Exception], match: str
) -> None:
    with transaction.atomic():
        with pytest.raises(error, match=match):
            call()
        # The transaction is still usable: the error came before any statement.
        outbox.send("after", {})
    assert list(OutboxEntry.objects.values_list("destination", flat=True)) == ["after"]


def test_a_payload_of_none_is_stored_as_json_null() -> None:
    """None is JSON (null): it was written as SQL NULL, which the column refuses (an
    IntegrityError from the INSERT, which on PostgreSQL aborted the caller's transaction)."""
    with transaction.atomic():
        outbox.send("orders.cancelled", None)
        outbox.send("after", {})

    rows = OutboxEntry.objects.order_by("id").values_list("destination", "payload")
    assert list(rows) == [("orders.cancelled", None), ("after", {})]


@pytest.mark.parametrize(
    ("payload", "headers", "refused_on", "match"),
    [
        ({"name": "caf\udce9"}, None, ("postgresql", "mysql"), "lone surrogate"),
        ({}, {"file": "caf\udce9"}, ("postgresql", "mysql"), "lone surrogate"),
        ({"text": "a\x00b"}, None, ("postgresql",), "NUL character"),
        ({}, {"h": "a\x00b"}, ("postgresql",), "NUL character"),
        ({"text": "a\\u0000b"}, None, (), ""),  # a backslash and "u0000": no NUL
    ],
    ids=["surrogate-payload", "surrogate-header", "nul-payload", "nul-header", "escaped-nul"],
)
def test_json_the_database_cannot_store_is_refused_before_the_insert(
    payload: Any, headers: dict[str, str] | None, refused_on: tuple[str, ...], match: str
) -> None:
    """PostgreSQL's jsonb refuses NUL and lone surrogates, MySQL's JSON lone surrogates: the
    INSERT raised a DataError or IntegrityError, which on PostgreSQL aborted the transaction."""
    with transaction.atomic():
        if connection.vendor in refused_on:
            with pytest.raises(TypeError, match=match):
                outbox.send("t", payload, headers=headers)
        else:
            outbox.send("t", payload, headers=headers)
        outbox.send("after", {})  # the transaction is still usable

    kept = [] if connection.vendor in refused_on else [("t", payload, headers or {})]
    rows = OutboxEntry.objects.order_by("id").values_list("destination", "payload", "headers")
    assert list(rows) == [*kept, ("after", {}, {})]


def test_a_named_transport_is_stored() -> None:
    transports = {
        "default": {"BACKEND": "django_idempotency.outbox.transports.CeleryTransport"},
        "kafka": {"BACKEND": "tests.test_relay.RecordingTransport"},
    }
    with override_settings(IDEMPOTENCY={"OUTBOX_TRANSPORTS": transports}), transaction.atomic():
        outbox.send("orders.confirmed", {}, transport="kafka")
    assert only_row().transport == "kafka"


# --- NOTIFY (PostgreSQL) --------------------------------------------------------------------


def listener() -> Any:
    wrapper = connections.create_connection("default")
    wrapper.ensure_connection()
    wrapper.set_autocommit(True)
    with wrapper.cursor() as cursor:
        cursor.execute(f"LISTEN {outbox.NOTIFY_CHANNEL}")
    return wrapper


def notifications(wrapper: Any, timeout: float) -> int:
    return sum(1 for _ in wrapper.connection.notifies(timeout=timeout, stop_after=10))


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_notify_arrives_on_commit_once_per_transaction() -> None:
    wrapper = listener()
    try:
        with transaction.atomic():
            for index in range(3):
                outbox.send("orders.confirmed", {"n": index})
            assert notifications(wrapper, 0.3) == 0  # nothing before COMMIT
        assert notifications(wrapper, 2.0) == 1  # identical notifications folded into one
    finally:
        wrapper.close()


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_no_notify_for_a_rollback_or_when_turned_off() -> None:
    wrapper = listener()
    try:
        with pytest.raises(ZeroDivisionError), transaction.atomic():
            outbox.send("orders.confirmed", {})
            1 / 0  # noqa: B018
        with (
            override_settings(
                IDEMPOTENCY={"OUTBOX_NOTIFY": False, "OUTBOX_TRANSPORTS": NULL_TRANSPORTS}
            ),
            transaction.atomic(),
        ):
            outbox.send("orders.confirmed", {})
        assert notifications(wrapper, 0.5) == 0
        assert OutboxEntry.objects.count() == 1
    finally:
        wrapper.close()


def test_the_kill_after_commit_probe_refuses_outside_the_test_server(client: Any) -> None:
    """It SIGKILLs its process after COMMIT: never the test process or a demo server."""
    response = client.post(
        "/probe/outbox/order-then-die/",
        b'{"queue": "q", "outbox": "a", "on_commit": "b"}',
        content_type="application/json",
    )
    assert response.status_code == 403
    assert not OutboxEntry.objects.exists()


def test_a_message_over_the_payload_limit_is_refused_and_writes_nothing() -> None:
    """Issue 25 item 16: a payload over MariaDB's ``max_allowed_packet`` dropped the
    connection mid-transaction ("server has gone away"). Every backend now refuses a message
    over ``OUTBOX_MAX_PAYLOAD_BYTES`` (payload and headers, as UTF-8 JSON) first."""
    limit = {"OUTBOX_MAX_PAYLOAD_BYTES": 100, "OUTBOX_TRANSPORTS": NULL_TRANSPORTS}
    with override_settings(IDEMPOTENCY=limit):
        at_limit = "é" * 46  # '"' + 92 bytes + '"' = 94, with headers "{}" = 96 bytes
        with transaction.atomic():
            outbox.send("t", at_limit, headers={})
            with pytest.raises(ValueError, match=r"is 102 bytes .* the most is 100 "):
                outbox.send("t", "é" * 49)
            with pytest.raises(ValueError, match="OUTBOX_MAX_PAYLOAD_BYTES"):
                outbox.send("t", "x", headers={"h": "y" * 100})
    assert list(OutboxEntry.objects.values_list("payload", flat=True)) == [at_limit]


def test_the_default_payload_limit_is_one_mebibyte() -> None:
    with transaction.atomic():
        outbox.send("t", "x" * (1024 * 1024 - 10))
        with pytest.raises(ValueError, match="the most is 1048576"):
            outbox.send("t", "x" * (1024 * 1024))
    assert OutboxEntry.objects.count() == 1


@pytest.mark.parametrize("value", [0, -1, "1MB", 1.5, True])
def test_a_bad_payload_limit_is_improperly_configured(value: Any) -> None:
    with (
        override_settings(IDEMPOTENCY={"OUTBOX_MAX_PAYLOAD_BYTES": value}),
        transaction.atomic(),
        pytest.raises(ImproperlyConfigured, match="OUTBOX_MAX_PAY"),
    ):
        outbox.send("t", {})


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ([1, 2, 3], None, "do not fit the task's signature"),
        (None, {"nope": 1}, "do not fit the task's signature"),
        (None, None, "do not fit the task's signature"),  # `event` is required
        ("ab", None, "must be a list or tuple"),
        (b"ab", None, "must be a list or tuple"),
        ([{"order_id": 1}], ["x"], "kwargs must be a mapping"),
    ],
)
def test_publish_refuses_a_call_the_task_can_never_run(args: Any, kwargs: Any, match: str) -> None:
    """Issue 25 item 14: stored unchecked, the worker failed every delivery with TypeError."""
    with transaction.atomic(), pytest.raises(TypeError, match=match):
        outbox.publish(apply_order_confirmed, args=args, kwargs=kwargs)
    assert OutboxEntry.objects.count() == 0


def test_publish_accepts_a_call_that_fits_the_bound_task() -> None:
    with transaction.atomic():
        outbox.publish(apply_order_confirmed, args=[{"order_id": 1}])
        outbox.publish(apply_order_confirmed, kwargs={"event": {"order_id": 2}})
    assert OutboxEntry.objects.count() == 2


class Validating:
    """A transport that refuses a destination it cannot serve, at send time."""

    def send(self, messages: Any) -> list[BaseException | None]:
        return [None] * len(messages)

    def close(self) -> None:
        pass

    def validate_message(self, destination: str, payload: Any, headers: dict[str, str]) -> None:
        if not isinstance(payload, dict) or "args" not in payload:
            raise ValueError(f"{destination}: not a task call")


def test_a_transport_with_validate_message_refuses_what_it_can_never_send() -> None:
    """Issue 25 item 15: stored anyway, such a message was retried for an hour, holding back
    its key. A transport without the method is not asked (nor built) in the producer."""
    from django_idempotency.outbox.transports import close_transports

    transports = {
        "default": {"BACKEND": "tests.test_outbox.Validating"},
        "plain": {"BACKEND": "tests.test_relay.RecordingTransport"},
    }
    try:
        with override_settings(IDEMPOTENCY={"OUTBOX_TRANSPORTS": transports}):
            with transaction.atomic(), pytest.raises(ValueError, match="not a task call"):
                outbox.send("shop.effect", {"order_id": 1})
            with transaction.atomic():
                outbox.send("shop.effect", {"args": [], "kwargs": {}})
                outbox.send("anything", {"order_id": 1}, transport="plain")
    finally:
        close_transports()
    assert sorted(OutboxEntry.objects.values_list("destination", flat=True)) == [
        "anything",
        "shop.effect",
    ]


WITHOUT_CELERY = """
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("celery", "kombu"):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)
        return None

sys.meta_path.insert(0, Block())
from django.conf import settings
settings.configure(
    INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "django_idempotency"],
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
    USE_TZ=True,
)
import django
django.setup()
from django.core.management import call_command
from django.db import transaction
from django_idempotency import outbox
call_command("migrate", verbosity=0)
try:
    with transaction.atomic():
        outbox.publish("shop.apply", [1])
except ImportError as error:
    print(type(error).__name__, error)
"""


@pytest.mark.django_db(databases=[])
def test_publish_without_celery_names_the_extra() -> None:
    """A bare install (Celery hidden from a fresh interpreter, the default transport a
    CeleryTransport): ``publish()`` raises an ImportError that says what to install, not a raw
    ``No module named 'celery'``."""
    import subprocess
    import sys

    from tests.workers import REPO

    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_CELERY],
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "pip install 'django-idempotency[celery]'" in done.stdout, done.stdout
    assert done.stdout.startswith("ImportError outbox.publish() needs Celery"), done.stdout
