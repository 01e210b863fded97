"""The admin with encryption at rest (issue 37): decrypted to viewers, key ids and never keys,
and the erasure action behind its own permission."""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.urls import reverse

from django_idempotency.models import FlowRun, IdempotencyRecord
from django_idempotency.protection.core import ERASED, erase_owner
from django_idempotency.protection.keys import key_id
from testproject.shop.probe_flows import ProbeError
from tests.probes import effects, post, problem
from tests.protection_helpers import keys, new_key

pytestmark = pytest.mark.django_db

RECORDS = reverse("admin:django_idempotency_idempotencyrecord_changelist")
K1, K2 = new_key(), new_key()
KID1 = key_id(base64.urlsafe_b64decode(K1))


def change_url(record: Any) -> str:
    return reverse("admin:django_idempotency_idempotencyrecord_change", args=[record.pk])


def staff(*codenames: str) -> Client:
    user = User.objects.create_user(f"staff-{uuid.uuid4().hex[:8]}", is_staff=True)
    user.user_permissions.add(*Permission.objects.filter(codename__in=codenames))
    client = Client()
    client.force_login(user)
    return client


def send(client: Client, key: str, text: str) -> Any:
    return post(client, "/probe/secret/", key, {"secret": text})


def test_a_viewer_sees_the_decrypted_response_and_the_key_id_never_the_key(
    client: Client,
) -> None:
    text = f"visible{uuid.uuid4().hex}"
    with keys(K1):
        send(client, "k", text)
        record = IdempotencyRecord.objects.get(key="k")
        viewer = staff("view_idempotencyrecord")
        page = viewer.get(change_url(record)).content.decode()
        listing = viewer.get(RECORDS).content.decode()
    assert text in page  # the body, decrypted
    assert f"/probe/secrets/{text}" in page  # the Location header, decrypted
    assert f"Encrypted with key {KID1}" in page
    assert KID1 in listing
    assert K1 not in page and K1 not in listing
    assert K1.rstrip("=") not in page


def test_an_undecryptable_record_says_so_and_an_erased_one_says_when(client: Client) -> None:
    with keys(K1):
        send(client, "k", "x")
    record = IdempotencyRecord.objects.get(key="k")
    viewer = staff("view_idempotencyrecord")
    with keys(K2):
        page = viewer.get(change_url(record)).content.decode()
    assert f"Encrypted with key {KID1}; it cannot be shown" in page
    assert "not in ENCRYPTION_KEYS" in page
    erase_owner(record.owner)
    page = viewer.get(change_url(record)).content.decode()
    assert "Erased at " in page
    assert "erased" in viewer.get(RECORDS).content.decode()


def test_a_plaintext_record_is_marked_not_encrypted(client: Client) -> None:
    send(client, "k", "plain")
    record = IdempotencyRecord.objects.get(key="k")
    page = staff("view_idempotencyrecord").get(change_url(record)).content.decode()
    assert "Not encrypted" in page


def test_the_erasure_action_needs_its_own_permission_confirms_and_spares_other_owners() -> None:
    ann, bob = User.objects.create_user("ann"), User.objects.create_user("bob")
    texts = {}
    for user in (ann, bob):
        client = Client()
        client.force_login(user)
        texts[user.username] = f"t{uuid.uuid4().hex}"
        with keys(K1):
            send(client, "same", texts[user.username])
    ann_record = IdempotencyRecord.objects.get(owner=f"user:{ann.pk}")
    data = {"action": "erase_owners", "_selected_action": [ann_record.pk]}

    deleter = staff("view_idempotencyrecord", "delete_idempotencyrecord")
    choices = deleter.get(RECORDS).context["action_form"].fields["action"].choices
    assert "erase_owners" not in [name for name, _ in choices]
    deleter.post(RECORDS, {**data, "post": "yes"})
    assert ERASED not in IdempotencyRecord.objects.get(pk=ann_record.pk).response_headers

    eraser = staff("view_idempotencyrecord", "erase_idempotencyrecord")
    confirm = eraser.post(RECORDS, data)
    assert confirm.status_code == 200
    assert f"user:{ann.pk}" in confirm.content.decode()
    assert ERASED not in IdempotencyRecord.objects.get(pk=ann_record.pk).response_headers
    done = eraser.post(RECORDS, {**data, "post": "yes"}, follow=True)
    assert "Erased 1 record of 1 owner(s)" in done.content.decode()
    assert ERASED in IdempotencyRecord.objects.get(pk=ann_record.pk).response_headers
    ann_client = Client()
    ann_client.force_login(ann)
    problem(send(ann_client, "same", texts["ann"]), 410)
    bob_record = IdempotencyRecord.objects.get(owner=f"user:{bob.pk}")
    assert ERASED not in bob_record.response_headers
    assert effects("secret") == 2


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("remote_calls")
def test_a_flow_run_is_shown_decrypted(client: Client) -> None:
    text = f"card{uuid.uuid4().hex}"
    with keys(K1):
        with pytest.raises(ProbeError):
            post(client, "/probe/flow/", "f", {"card": text}, headers={"X-Flow-Raise": "two"})
        run = FlowRun.objects.get()
        url = reverse("admin:django_idempotency_flowrun_change", args=[run.pk])
        page = staff("view_flowrun").get(url).content.decode()
    body = base64.b64encode(json.dumps({"card": text}).encode()).decode()
    assert body in page  # the stored request, decrypted (its body is kept in base64)
    assert "/probe/flow/" in page and "ch_" in page  # the path, and phase two's result
    assert f"Encrypted with key {KID1}" in page
    assert K1 not in page


@pytest.mark.usefixtures("null_default_transport")
def test_an_outbox_payload_is_shown_decrypted() -> None:
    from django.db import transaction

    from django_idempotency.models import OutboxEntry
    from django_idempotency.outbox import core as outbox

    text = f"card{uuid.uuid4().hex}"
    with keys(K1, OUTBOX_ENCRYPT=True):
        with transaction.atomic():
            outbox.send("topic", {"card": text})
        row = OutboxEntry.objects.get()
        url = reverse("admin:django_idempotency_outboxentry_change", args=[row.pk])
        page = staff("view_outboxentry").get(url).content.decode()
    assert text in page and f"Encrypted with key {KID1}" in page and K1 not in page
