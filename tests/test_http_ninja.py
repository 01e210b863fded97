"""django-ninja: ``@idempotent`` on Ninja operations (django_idempotency.http.ninja), with the
real ``django-ninja`` package, on every database pass.

The decorator runs after Ninja's authentication and validation: the owner is ``request.auth``,
a refused credential never gets a stored response, and the stored bytes are the ones Ninja sent.
"""

from __future__ import annotations

import base64
import json
import threading
import uuid
from collections import Counter

import pytest
from django.contrib.auth.models import User
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, connections
from django.test import Client
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("ninja")

from django_idempotency.models import IdempotencyRecord
from testproject.shop import probe_ninja
from tests.probes import body, effects, post, problem

SYNC = "/probe/ninja/orders"
REQUIRED = "/probe/ninja/required"
ASYNC = "/probe/ninja/async/orders"
ASYNC_REQUIRED = "/probe/ninja/async/required"
ORDER = {"item": "tea", "quantity": 2}
ANN = {"Authorization": "Bearer token-ann"}
BOB = {"Authorization": "Bearer token-bob"}

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("url", [SYNC, REQUIRED, ASYNC, ASYNC_REQUIRED])
def test_a_retry_replays_the_bytes_ninja_sent(client: Client, url: str) -> None:
    first = post(client, url, "k-1", ORDER, headers=ANN)
    assert first.status_code == 201, first.content
    assert body(first)["item"] == "tea"
    again = post(client, url, "k-1", ORDER, headers=ANN)
    assert again.status_code == 201
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert again["Content-Type"] == first["Content-Type"]
    assert effects() == 1
    record = IdempotencyRecord.objects.get()
    assert bytes(record.response_body or b"") == first.content


@pytest.mark.parametrize("url", [SYNC, ASYNC])
def test_two_principals_with_one_key_get_their_own_answers(client: Client, url: str) -> None:
    ann = post(client, url, "shared", ORDER, headers=ANN)
    bob = post(client, url, "shared", ORDER, headers=BOB)
    assert ann.status_code == bob.status_code == 201
    assert "Idempotent-Replayed" not in bob
    assert body(ann)["owner"] == "token-ann" and body(bob)["owner"] == "token-bob"
    assert post(client, url, "shared", ORDER, headers=BOB).content == bob.content
    assert effects(key="shared") == 2
    owners = set(IdempotencyRecord.objects.values_list("owner", flat=True))
    assert len(owners) == 2
    assert not any("token" in owner for owner in owners)  # an HMAC, never the token


def test_query_string_keys_are_owners_too(client: Client) -> None:
    """APIKeyQuery carries no Authorization header: the owner is still the key, not anonymous."""
    ann = post(client, f"{SYNC}?api_key=token-ann", "q", ORDER)
    bob = post(client, f"{SYNC}?api_key=token-bob", "q", ORDER)
    assert "Idempotent-Replayed" not in bob
    assert body(ann)["owner"] == "token-ann" and body(bob)["owner"] == "token-bob"
    assert effects(key="q") == 2


def test_a_django_user_is_the_same_owner_as_under_the_other_adapters(client: Client) -> None:
    ann = User.objects.create_user("ann", password="pw")
    token = base64.b64encode(b"ann:pw").decode()
    response = post(client, SYNC, "u", ORDER, headers={"Authorization": f"Basic {token}"})
    assert response.status_code == 201
    assert IdempotencyRecord.objects.get().owner == f"user:{ann.pk}"


@pytest.mark.parametrize("url", [SYNC, ASYNC])
def test_a_request_ninja_refuses_never_gets_a_replay(
    client: Client, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert post(client, url, "r", ORDER, headers=ANN).status_code == 201
    monkeypatch.setattr(probe_ninja, "TOKENS", {"token-bob"})  # ann's token is revoked
    refused = post(client, url, "r", ORDER, headers=ANN)
    assert refused.status_code == 401
    assert "Idempotent-Replayed" not in refused
    assert refused.content != b"" and b"effect" not in refused.content
    assert effects() == 1


@pytest.mark.parametrize("url", [SYNC, ASYNC])
def test_a_reused_key_with_another_body_is_a_422_problem(client: Client, url: str) -> None:
    assert post(client, url, "b", ORDER, headers=ANN).status_code == 201
    reused = problem(post(client, url, "b", {"item": "coffee"}, headers=ANN), 422)
    assert reused["type"].endswith("#key-reused")
    assert effects() == 1


@pytest.mark.parametrize("url", [REQUIRED, ASYNC_REQUIRED])
def test_errors_are_problem_json(client: Client, url: str) -> None:
    problem(post(client, url, None, ORDER, headers=ANN), 400)  # required key missing
    problem(post(client, url, "x" * 10_000, ORDER, headers=ANN), 400)  # malformed key
    assert effects() == 0


def test_an_invalid_body_is_ninjas_422_and_claims_nothing(client: Client) -> None:
    invalid = post(client, SYNC, "v", {"quantity": "many"}, headers=ANN)
    assert invalid.status_code == 422
    assert "detail" in body(invalid)
    assert not IdempotencyRecord.objects.exists()
    assert post(client, SYNC, "v", ORDER, headers=ANN).status_code == 201  # the key is free


@pytest.mark.django_db(transaction=True)
def test_lease_mode_commits_the_claim_and_replays(client: Client) -> None:
    url = "/probe/ninja/lease"
    first = post(client, url, "l", ORDER, headers=ANN)
    assert first.status_code == 201, first.content
    again = post(client, url, "l", ORDER, headers=ANN)
    assert again["Idempotent-Replayed"] == "true" and again.content == first.content
    assert effects() == 1


def test_the_router_mounted_twice_replays_each_mounts_bytes(client: Client) -> None:
    """Ninja clones the operations per mount; each stored response is its own API's bytes."""
    first = post(client, SYNC, "m", ORDER, headers=ANN)
    v2 = "/probe/ninja-v2/orders"
    second = post(client, v2, "m2", ORDER, headers=ANN)
    assert second.content.startswith(b"{\n  ")  # the second API's indented renderer
    assert not first.content.startswith(b"{\n")
    assert post(client, v2, "m2", ORDER, headers=ANN).content == second.content
    assert post(client, SYNC, "m", ORDER, headers=ANN).content == first.content
    assert effects() == 2


def test_a_streamed_operation_is_refused() -> None:
    from ninja import NinjaAPI

    from django_idempotency.http.ninja import idempotent

    api = NinjaAPI(urls_namespace=f"s-{uuid.uuid4().hex}")
    try:
        from ninja.streaming import JSONL
    except ImportError:
        pytest.skip("this django-ninja has no streaming responses")

    with pytest.raises(ImproperlyConfigured, match="stream"):

        @api.post("/s", response=JSONL[int])
        @idempotent
        def s(request: object) -> object:
            yield 1


@given(token=st.text(min_size=1, max_size=300))
def test_a_token_principal_is_a_bounded_hmac_never_the_token(token: str) -> None:
    from types import SimpleNamespace

    from django_idempotency.http.ninja import ninja_owner

    request = SimpleNamespace(auth=token, headers={}, user=None)
    owner = ninja_owner(request)
    assert owner.startswith("auth:") and len(owner) <= 255
    assert owner == ninja_owner(SimpleNamespace(auth=token, headers={}, user=None))
    if len(token) > 8:
        assert token not in owner


def test_an_unknown_principal_is_a_clear_configuration_error() -> None:
    from types import SimpleNamespace

    from django_idempotency.http.ninja import ninja_owner

    with pytest.raises(ImproperlyConfigured, match=r"request\.auth"):
        ninja_owner(SimpleNamespace(auth=object(), headers={}, user=None))


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("url", [SYNC, ASYNC])
def test_concurrent_duplicates_get_409(url: str) -> None:
    """Real threads: while the first request holds the key, a duplicate gets a 409 problem
    (SQLite serialises writers: the duplicate waits for the commit and replays instead)."""
    key = str(uuid.uuid4())
    count = 6
    barrier = threading.Barrier(count)
    replies: list[tuple[int, dict[str, str], bytes]] = []
    lock = threading.Lock()

    def send() -> None:
        try:
            barrier.wait(60)
            response = Client().post(
                url,
                json.dumps(ORDER),
                content_type="application/json",
                headers={**ANN, "Idempotency-Key": key, "X-Probe-Sleep": "2"},
            )
            with lock:
                replies.append((response.status_code, dict(response.items()), response.content))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=send) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(replies) == count
    assert effects(key=key) == 1
    statuses = Counter(status for status, _, _ in replies)
    originals = [r for r in replies if r[0] == 201 and "Idempotent-Replayed" not in r[1]]
    assert len(originals) == 1, statuses
    for status, headers, content in replies:
        if status == 409:
            assert headers["Content-Type"] == "application/problem+json"
            assert json.loads(content)["type"].endswith("#in-progress")
        else:
            assert status == 201 and content == originals[0][2]
    if connection.vendor != "sqlite":
        assert statuses == {201: 1, 409: count - 1}, statuses


def test_a_principal_of_another_model_is_not_the_user_with_its_pk() -> None:
    """``request.auth`` goes through the one owner mapping (``principal_owner``): an API client
    row with pk 1 and user 1 are two owners (issue 34, finding 3, for Ninja too)."""
    from types import SimpleNamespace

    from django_idempotency.http.ninja import ninja_owner
    from testproject.shop.models import ServiceAccount

    user = User.objects.create_user("ninja-principal-user")
    account = ServiceAccount.objects.create(pk=user.pk, name="ninja-client")
    as_user = ninja_owner(SimpleNamespace(auth=user, headers={}, user=None))
    as_account = ninja_owner(SimpleNamespace(auth=account, headers={}, user=None))
    assert as_user == f"user:{user.pk}"
    assert as_account == f"principal:shop.serviceaccount:{account.pk}"
