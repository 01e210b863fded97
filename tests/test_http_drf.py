"""DRF and class-based views: the stored response only after DRF's checks (the mixin), DRF's
user as the owner under the middleware, the decorator's options honoured under the middleware,
and lease mode under ATOMIC_REQUESTS."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.contrib.auth.models import AnonymousUser, User
from django.db import connection
from django.test import Client, RequestFactory, override_settings

from django_idempotency.http.drf import authenticated_request
from django_idempotency.models import IdempotencyRecord
from testproject.shop.probe_views import DrfPlain
from tests.probes import effects, post, problem
from tests.test_middleware import with_middleware

PASSWORD = "pw-for-tests"


@pytest.fixture(autouse=True)
def installed() -> Iterator[None]:
    with override_settings(MIDDLEWARE=with_middleware(), IDEMPOTENCY={"PATHS": [r"^/probe/mw/"]}):
        yield


def basic(user: User) -> dict[str, str]:
    token = base64.b64encode(f"{user.username}:{PASSWORD}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


def make_user(name: str = "ann", *, staff: bool = False) -> User:
    return User.objects.create_user(name, password=PASSWORD, is_staff=staff)


# -- the mixin: DRF's checks first -------------------------------------------------------------

SAFE = "/probe/mw/drf/safe/"
PLAIN = "/probe/mw/drf/plain/"


@pytest.mark.django_db
def test_the_mixin_replays_only_after_authentication(client: Client) -> None:
    ann = make_user(staff=True)
    first = post(client, SAFE, "k", headers=basic(ann))
    assert first.status_code == 201
    assert post(client, SAFE, "k", headers=basic(ann))["Idempotent-Replayed"] == "true"
    assert IdempotencyRecord.objects.get().owner == f"user:{ann.pk}"
    User.objects.filter(pk=ann.pk).update(is_active=False)  # the credential is revoked
    refused = post(client, SAFE, "k", headers=basic(ann))
    assert refused.status_code in (401, 403)
    assert "Idempotent-Replayed" not in refused
    assert effects() == 1


@pytest.mark.django_db
def test_the_mixin_replays_only_after_the_permission_checks(client: Client) -> None:
    ann = make_user(staff=True)
    assert post(client, SAFE, "k", headers=basic(ann)).status_code == 201
    User.objects.filter(pk=ann.pk).update(is_staff=False)  # the permission is withdrawn
    refused = post(client, SAFE, "k", headers=basic(ann))
    assert refused.status_code == 403
    assert "Idempotent-Replayed" not in refused


@pytest.mark.django_db
def test_the_middleware_leaves_mixin_views_to_the_mixin_and_its_options(client: Client) -> None:
    ann = make_user(staff=True)
    problem(post(client, SAFE, None, headers=basic(ann)), 400)  # idempotency_required
    assert effects() == 0


# -- a DRF view without the mixin, under the middleware ----------------------------------------


@pytest.mark.django_db
def test_under_the_middleware_the_owner_is_drfs_user(client: Client) -> None:
    """Basic authentication is DRF's, not Django's: the owner was a hash of the header."""
    ann = make_user()
    first = post(client, PLAIN, "k", headers=basic(ann))
    assert first.status_code == 201
    assert IdempotencyRecord.objects.get().owner == f"user:{ann.pk}"
    # The same user, other credentials (here a session): one owner, so a replay.
    client.force_login(ann)
    assert post(client, PLAIN, "k")["Idempotent-Replayed"] == "true"
    assert effects() == 1


@pytest.mark.django_db
def test_under_the_middleware_a_revoked_credential_gets_no_replay(client: Client) -> None:
    ann = make_user()
    assert post(client, PLAIN, "k", headers=basic(ann)).status_code == 201
    User.objects.filter(pk=ann.pk).update(is_active=False)
    refused = post(client, PLAIN, "k", headers=basic(ann))
    assert refused.status_code in (401, 403)
    assert "Idempotent-Replayed" not in refused
    assert effects() == 1


# -- options on handler methods and DRF actions, under the middleware --------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("url", ["/probe/mw/cbv-lease/", "/probe/mw/drf/viewset-lease/"])
def test_the_middleware_honours_the_decorators_options_on_methods(
    client: Client, url: str
) -> None:
    """The middleware ran these atomic, with no lease and the default TTL."""
    first = post(client, url, "k")
    assert first.status_code == 201
    record = IdempotencyRecord.objects.get()
    assert record.expires_at - record.created_at == timedelta(hours=48)  # not the default 24
    assert post(client, url, "k")["Idempotent-Replayed"] == "true"
    assert effects() == 1


# -- lease mode under ATOMIC_REQUESTS ----------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("url", ["/probe/lease/", "/probe/lease-short/", "/probe/mw/drf/lease/"])
def test_lease_mode_marks_the_view_non_atomic_itself(
    client: Client, monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    """Every lease-mode request answered 500 (ImproperlyConfigured) under ATOMIC_REQUESTS."""
    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", True)
    first = post(client, url, "k")
    assert first.status_code == 201, first.content  # type: ignore[attr-defined]
    assert post(client, url, "k")["Idempotent-Replayed"] == "true"
    assert effects() == 1


@pytest.mark.django_db
def test_authenticated_request_leaves_the_django_request_as_it_was() -> None:
    ann = make_user()
    request = RequestFactory().post("/", headers=basic(ann))
    django_user = AnonymousUser()
    request.user = django_user
    drf_request = authenticated_request(request, DrfPlain)
    assert drf_request is not None and drf_request.user == ann
    assert request.user is django_user
    assert not hasattr(request, "auth")
    User.objects.filter(pk=ann.pk).update(is_active=False)
    assert authenticated_request(request, DrfPlain) is None
