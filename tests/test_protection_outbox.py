"""Outbox payloads encrypted at rest (``OUTBOX_ENCRYPT``, issue 37): the relay decrypts them just
before it sends, and never sends one that no key opens."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import pytest
from django.db import transaction

from django_idempotency.models import OutboxEntry
from django_idempotency.outbox import core as outbox
from django_idempotency.outbox.relay import Relay
from django_idempotency.outbox.transports import OutboxMessage
from django_idempotency.protection import rotate_keys
from django_idempotency.protection.core import SEALED, stored_key_id
from tests.protection_helpers import keys, leaked, new_key

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("null_default_transport")]

K1, K2 = new_key(), new_key()


class Recording:
    def __init__(self) -> None:
        self.sent: list[OutboxMessage] = []

    def send(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        self.sent.extend(messages)
        return [None] * len(messages)

    def close(self) -> None:
        pass


def relay(transport: Recording) -> Relay:
    return Relay(transports={"default": transport}, backoff=0.001, max_backoff=0.001)


def write(payload: Any, key: str | None = None) -> str:
    with transaction.atomic():
        return outbox.send("topic", payload, key=key)


def test_an_encrypted_payload_is_sent_as_written_and_stored_as_ciphertext() -> None:
    text = f"card{uuid.uuid4().hex}"
    with keys(K1, OUTBOX_ENCRYPT=True):
        event = write({"card": text, "n": [1, 2.5, None]}, key="order-1")
        row = OutboxEntry.objects.get()
        assert set(row.payload) == {SEALED, "@data"}
        assert leaked(text) == []
        assert row.event_id == event and row.ordering_key == "order-1"  # still readable
        transport = Recording()
        assert relay(transport).run_once().sent == 1
    [message] = transport.sent
    assert message.payload == {"card": text, "n": [1, 2.5, None]}
    assert message.event_id == event


def test_without_outbox_encrypt_payloads_stay_as_written() -> None:
    with keys(K1):
        write({"plain": True})
    assert OutboxEntry.objects.get().payload == {"plain": True}


def test_a_payload_that_no_key_opens_is_never_sent(caplog: pytest.LogCaptureFixture) -> None:
    with keys(K1, OUTBOX_ENCRYPT=True):
        write({"a": 1}, key="k")
        write({"b": 2}, key="k")  # behind it: held back, never overtaking
        write({"c": 3})
    transport = Recording()
    with keys(K2, OUTBOX_ENCRYPT=True):
        result = relay(transport).run_once()
    assert transport.sent == []
    assert result.sent == 0
    first = OutboxEntry.objects.order_by("pk").first()
    assert first is not None
    assert f"undecryptable outbox message id={first.pk}" in caplog.text
    assert "cannot" not in str(first.payload)
    assert OutboxEntry.objects.filter(state="sent").count() == 0
    with keys(K2, K1, OUTBOX_ENCRYPT=True):  # the key is back: all three go, in order
        relay(transport).drain()
    assert [m.payload for m in transport.sent if m.ordering_key == "k"] == [{"a": 1}, {"b": 2}]
    assert len(transport.sent) == 3


def test_rotation_reseals_unsent_payloads_and_encrypts_plaintext_ones() -> None:
    write({"before": "keys"})
    with keys(K1, OUTBOX_ENCRYPT=True):
        write({"under": "k1"})
    with keys(K2, K1, OUTBOX_ENCRYPT=True):
        [_, _, messages] = rotate_keys()
        assert messages.resealed == 2
        kids = {stored_key_id(p) for p in OutboxEntry.objects.values_list("payload", flat=True)}
        assert len(kids) == 1 and None not in kids
    transport = Recording()
    with keys(K2, OUTBOX_ENCRYPT=True):
        relay(transport).drain()
    assert sorted(str(m.payload) for m in transport.sent) == [
        "{'before': 'keys'}",
        "{'under': 'k1'}",
    ]


def test_the_reserved_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="reserved for an encrypted payload"):
        write({SEALED: "x", "@data": "y"})


def test_a_change_capture_message_is_written_as_it_is() -> None:
    """A change-capture reader (Debezium) reads the row from the log, not through the relay
    that decrypts: its payload stays as written."""
    from django.conf import settings

    from tests.outbox_helpers import NULL_TRANSPORTS

    capture = {"BACKEND": "django_idempotency.outbox.capture.ChangeCaptureTransport"}
    transports = {**settings.IDEMPOTENCY.get("OUTBOX_TRANSPORTS", {}), **NULL_TRANSPORTS}
    settings_ = {"OUTBOX_ENCRYPT": True, "OUTBOX_TRANSPORTS": {**transports, "cdc": capture}}
    with keys(K1, **settings_), transaction.atomic():
        outbox.send("orders.confirmed", {"order_id": 1}, transport="cdc")
        outbox.send("orders.confirmed", {"order_id": 2})
    payloads = dict(OutboxEntry.objects.values_list("transport", "payload"))
    assert payloads["cdc"] == {"order_id": 1}
    assert stored_key_id(payloads["default"]) is not None
