"""Outside security review of issue 37 (data protection): erasure scope, binding of sealed
values to their owner, and undecryptable or erased records never running again; all backends.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from django_idempotency.models import IdempotencyRecord
from django_idempotency.protection import erase_owner
from django_idempotency.protection.core import ERASED
from tests.probes import effects, post, problem
from tests.protection_helpers import keys, new_key

pytestmark = pytest.mark.django_db

URL = "/probe/secret/"
K1, K2 = new_key(), new_key()


def secret() -> str:
    return f"s3cr3t{uuid.uuid4().hex}"


def send(client: Client, key: str, text: str) -> Any:
    return post(client, URL, key, {"secret": text})


#: Owners a database could take for ``user:1`` (case, trailing or leading space, accents) or
#: that a LIKE pattern would match.
LOOKALIKES = ["user:1", "USER:1", "user:1 ", " user:1", "usér:1", "user:10", "user:%", "user:_"]


def completed(owner: str) -> IdempotencyRecord:
    return IdempotencyRecord.objects.create(
        owner=owner,
        key="k",
        fingerprint="f",
        method="POST",
        path="/p/",
        state=IdempotencyRecord.State.COMPLETED,
        token=uuid.uuid4(),
        response_status=201,
        response_headers={"Content-Type": "text/plain"},
        response_body=b"body of " + owner.encode(),
        expires_at=timezone.now() + timezone.timedelta(hours=1),
    )


@pytest.mark.parametrize("target", LOOKALIKES)
def test_erasure_takes_exactly_one_owner(target: str) -> None:
    for owner in LOOKALIKES:
        completed(owner)
    assert erase_owner(target).records == 1
    for record in IdempotencyRecord.objects.all():
        erased = ERASED in record.response_headers
        assert erased == (record.owner == target), (record.owner, target)


def test_a_sealed_response_copied_to_another_owners_row_does_not_open() -> None:
    """Same key, same body, two users: bob's row given ann's sealed response answers a
    problem, never ann's response (the existing test sends another body, so KeyReused answers
    it whatever the binding)."""
    ann, bob = User.objects.create_user("ann"), User.objects.create_user("bob")
    clients = {name: Client() for name in ("ann", "bob")}
    clients["ann"].force_login(ann)
    clients["bob"].force_login(bob)
    text = secret()
    with keys(K1):
        send(clients["ann"], "same", text)
        send(clients["bob"], "same", text)
        a = IdempotencyRecord.objects.get(owner=f"user:{ann.pk}")
        IdempotencyRecord.objects.filter(owner=f"user:{bob.pk}").update(
            response_body=a.response_body, response_headers=a.response_headers
        )
        details = problem(send(clients["bob"], "same", text), 422)
    assert details["type"].endswith("#response-undecryptable")
    assert effects("secret") == 2


def test_an_undecryptable_record_never_runs_again_with_another_body(client: Client) -> None:
    with keys(K1):
        send(client, "k", secret())
    with keys(K2):
        for body in (secret(), secret()):
            details = problem(send(client, "k", body), 422)
            assert details["type"].endswith(("#key-reused", "#response-undecryptable"))
    with keys():  # no keys at all
        problem(send(client, "k", secret()), 422)
    assert effects("secret") == 1


def test_an_erased_record_never_runs_again_under_either_key_setting(client: Client) -> None:
    with keys(K1):
        send(client, "k", secret())
    erase_owner("anonymous")
    for listed in ((K1,), (K2,), ()):
        with keys(*listed):
            problem(send(client, "k", secret()), 410)
    assert effects("secret") == 1
